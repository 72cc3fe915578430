//! What the worker's decision queue costs a decision.
//!
//! One thread, one actix System, as on a proxy worker. A store that grants
//! at once (no Redis) is asked N times: through the worker's `Coalesced`
//! client one decision at a time (each call carries one: a ticket, a task
//! for the call, a wake-up), through it 16 decisions at a time (16 ride
//! one call), and directly (`take_batch` of one key). The differences are
//! what the queue costs a decision; Redis round trips come on top. Median
//! of 7 rounds. Run: `cargo bench --bench mailbox`.

#![allow(clippy::unwrap_used)] // Bench code: a failed unwrap is a failed run.

use std::num::NonZeroU32;
use std::time::Duration;

use futures_util::future::join_all;

use tollgate::bucket::decision::GroupGrant;
use tollgate::bucket::store::{Answer, BatchStore, Item};
use tollgate::bucket::{Ask, BucketSpec, CallLimits, Coalesced, Decision, Grant, SharedStore};
use tollgate::clock::{Clock, SystemClock};
use tollgate::redis_client::RedisCallError;
use tollgate::telemetry::Metrics;

/// Grants every ask at once.
#[derive(Clone)]
struct Instant;

impl BatchStore for Instant {
    fn timeout(&self) -> Duration {
        Duration::from_millis(5)
    }

    async fn take_batch(&self, batch: &[Item<'_>]) -> Result<Vec<Answer>, RedisCallError> {
        Ok(batch
            .iter()
            .map(|item| match item {
                Item::One(_, _, ask) => Answer::One(Grant {
                    granted: ask.want,
                    decision: ADMITTED,
                    block_ms: 0,
                }),
                Item::Group(group, ask) => Answer::Group(GroupGrant {
                    granted: ask.want,
                    decisions: vec![ADMITTED; group.len()],
                    block_ms: 0,
                }),
            })
            .collect())
    }
}

/// What `Instant` answers.
const ADMITTED: Decision = Decision {
    allowed: true,
    remaining: 1,
    retry_after_ms: 0,
};

const N: u64 = 200_000;

/// Decisions in flight at once in the second run.
const AT_ONCE: usize = 16;

fn main() {
    actix::System::new().block_on(async {
        let spec = BucketSpec::of(NonZeroU32::new(100).unwrap(), NonZeroU32::new(10).unwrap());
        let limits = CallLimits {
            max_keys: AT_ONCE,
            max_in_flight: 1,
        };
        let client = Coalesced::start(Instant, Metrics::new(), false, limits);
        let clock = SystemClock::new();
        let (mut alone, mut together, mut direct) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..7 {
            let started = clock.now_micros();
            for _ in 0..N {
                client
                    .take("rl2:{t}:r", &spec, Ask::single(1))
                    .await
                    .unwrap();
            }
            alone.push((clock.now_micros() - started) as f64 * 1000.0 / N as f64);
            let started = clock.now_micros();
            for _ in 0..N / AT_ONCE as u64 {
                let takes = (0..AT_ONCE).map(|_| client.take("rl2:{t}:r", &spec, Ask::single(1)));
                for grant in join_all(takes).await {
                    grant.unwrap();
                }
            }
            together.push((clock.now_micros() - started) as f64 * 1000.0 / N as f64);
            let started = clock.now_micros();
            for _ in 0..N {
                Instant
                    .take_batch(&[Item::One("rl2:{t}:r", spec, Ask::single(1))])
                    .await
                    .unwrap();
            }
            direct.push((clock.now_micros() - started) as f64 * 1000.0 / N as f64);
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (alone, together, call) = (
            median(&mut alone),
            median(&mut together),
            median(&mut direct),
        );
        println!("decisions per round              {N}");
        println!("through the queue, one at a time {alone:8.0} ns per decision (median of 7)");
        println!("through the queue, {AT_ONCE} at a time {together:8.0} ns per decision");
        println!("direct call                      {call:8.0} ns per decision");
    });
}
