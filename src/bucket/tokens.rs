//! Token-bucket arithmetic, the in-process twin of `lua/token_bucket.lua`.
//!
//! Pure functions over a [`TokenState`] and an explicit `now`, so the math is
//! tested with a hand-advanced clock. The rules match the script exactly:
//! refill `min(capacity, tokens + elapsed × rate)`, a cost above capacity is
//! clamped to capacity, a rejection changes nothing and reports the real
//! time until the deficit is refilled, rounded up to whole milliseconds; an
//! admission that leaves less than one more request's tokens reports when
//! the next could pass.

use super::decision::{BucketSpec, Decision};

/// The two numbers a bucket keeps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenState {
    /// Tokens available at `updated_ms` (fractional).
    pub tokens: f64,
    /// Time of the last change, in the owning clock's milliseconds.
    pub updated_ms: u64,
}

impl TokenState {
    /// A full bucket as of `now_ms`.
    pub fn full(spec: &BucketSpec, now_ms: u64) -> Self {
        Self {
            tokens: f64::from(spec.capacity.get()),
            updated_ms: now_ms,
        }
    }

    /// Tokens available at `now_ms` after refilling.
    pub fn available(&self, spec: &BucketSpec, now_ms: u64) -> f64 {
        let elapsed_ms = now_ms.saturating_sub(self.updated_ms) as f64;
        let refilled = self.tokens + elapsed_ms * spec.refill_per_second / 1000.0;
        refilled.min(f64::from(spec.capacity.get()))
    }

    /// Refills to `now_ms` and tries to take `cost` tokens.
    pub fn take(&mut self, spec: &BucketSpec, cost: u32, now_ms: u64) -> Decision {
        let cost = f64::from(cost.min(spec.capacity.get()));
        let tokens = self.available(spec, now_ms);
        if tokens < cost {
            let retry = ((cost - tokens) * 1000.0 / spec.refill_per_second).ceil();
            return Decision {
                allowed: false,
                remaining: tokens.floor() as u64,
                retry_after_ms: (retry as u64).max(1),
            };
        }
        self.tokens = tokens - cost;
        self.updated_ms = now_ms;
        let next = if self.tokens < cost {
            ((cost - self.tokens) * 1000.0 / spec.refill_per_second).ceil() as u64
        } else {
            0
        };
        Decision {
            allowed: true,
            remaining: self.tokens.floor() as u64,
            retry_after_ms: next,
        }
    }

    /// Whether the bucket is full at `now_ms`, so forgetting it loses nothing.
    pub fn is_full(&self, spec: &BucketSpec, now_ms: u64) -> bool {
        self.available(spec, now_ms) >= f64::from(spec.capacity.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};
    use proptest::prelude::*;
    use std::num::NonZeroU32;
    use std::time::Duration;

    fn spec(capacity: u32, refill: f64) -> BucketSpec {
        BucketSpec {
            capacity: NonZeroU32::new(capacity).unwrap(),
            refill_per_second: refill,
        }
    }

    #[test]
    fn burst_to_capacity_then_reject_then_one_token_after_one_interval() {
        let clock = ManualClock::new(10_000);
        let s = spec(3, 2.0);
        let mut state = TokenState::full(&s, clock.now_ms());
        let remaining: Vec<_> = (0..3)
            .map(|_| state.take(&s, 1, clock.now_ms()))
            .map(|d| (d.allowed, d.remaining))
            .collect();
        assert_eq!(remaining, vec![(true, 2), (true, 1), (true, 0)]);

        let rejected = state.take(&s, 1, clock.now_ms());
        assert!(!rejected.allowed);
        assert_eq!(rejected.retry_after_ms, 500);

        clock.advance(Duration::from_millis(499));
        assert!(!state.take(&s, 1, clock.now_ms()).allowed);
        clock.advance(Duration::from_millis(1));
        let d = state.take(&s, 1, clock.now_ms());
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
    }

    #[test]
    fn retry_after_uses_the_real_deficit_not_integer_division() {
        // 1 / refill would be 0 with integer math; the deficit gives 4 ms.
        let s = spec(1, 250.0);
        let mut state = TokenState::full(&s, 0);
        assert!(state.take(&s, 1, 0).allowed);
        assert_eq!(state.take(&s, 1, 0).retry_after_ms, 4);
        assert_eq!(state.take(&s, 1, 1).retry_after_ms, 3);
    }

    #[test]
    fn refill_never_exceeds_capacity() {
        let s = spec(5, 100.0);
        let mut state = TokenState::full(&s, 0);
        state.take(&s, 5, 0);
        assert_eq!(state.take(&s, 1, 1_000_000).remaining, 4);
    }

    #[test]
    fn cost_above_capacity_passes_only_when_full() {
        let s = spec(4, 1.0);
        let mut state = TokenState::full(&s, 0);
        let d = state.take(&s, 10, 0);
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
        let d = state.take(&s, 10, 1_000);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 3_000);
    }

    #[test]
    fn rejection_leaves_state_untouched() {
        let s = spec(1, 1.0);
        let mut state = TokenState::full(&s, 0);
        state.take(&s, 1, 0);
        let before = state;
        state.take(&s, 1, 300);
        assert_eq!(state, before);
    }

    proptest! {
        #[test]
        fn admitted_never_exceeds_capacity_plus_refill(
            capacity in 1u32..500,
            refill in 0.5f64..1000.0,
            gaps in proptest::collection::vec(0u64..50, 1..400),
        ) {
            let s = spec(capacity, refill);
            let mut state = TokenState::full(&s, 0);
            let mut now = 0;
            let mut admitted = 0u64;
            for gap in gaps {
                now += gap;
                let d = state.take(&s, 1, now);
                if d.allowed { admitted += 1; } else { prop_assert!(d.retry_after_ms >= 1); }
            }
            let bound = f64::from(capacity) + now as f64 * refill / 1000.0;
            prop_assert!(admitted as f64 <= bound + 1e-9);
        }
    }
}
