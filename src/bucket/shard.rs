//! Sub-bucket choice for rules split into shards.
//!
//! A rule with `shards = k` is held in k Redis keys `rl2:<tenant>:<route>:<i>`
//! (no hash tag, so they spread over Redis Cluster nodes), each with 1/k of
//! the capacity and refill. A request starts at a sub-bucket picked
//! uniformly at random, so the sub-buckets drain evenly; when that one
//! refuses, the limiter tries the next ones in turn and refuses only when
//! none can take it (see [`super::Limiter`]).

use std::cell::Cell;
use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroU32;

thread_local! {
    /// Per-thread xorshift state, seeded from the process's random hasher.
    static STATE: Cell<u64> = Cell::new(RandomState::new().hash_one(std::thread::current().id()) | 1);
}

/// A uniformly chosen sub-bucket index in `0..shards`.
pub fn pick(shards: NonZeroU32) -> u32 {
    if shards.get() == 1 {
        return 0;
    }
    STATE.with(|state| {
        // xorshift64*: fast, and plenty for spreading load.
        let mut x = state.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        state.set(x);
        let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
        // Truncation is the point: the high bits scaled into 0..shards.
        (((r >> 32) * u64::from(shards.get())) >> 32) as u32
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_cover_every_shard_about_evenly() {
        let k = NonZeroU32::new(8).unwrap();
        let mut counts = [0u32; 8];
        for _ in 0..80_000 {
            counts[pick(k) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
        assert_eq!(pick(NonZeroU32::MIN), 0);
    }
}
