//! What the bucket-client actor's mailbox costs a decision.
//!
//! One thread, one actix System, as on a proxy worker. A store that grants
//! at once (no Redis) is asked for one decision at a time, N times: through
//! the worker's `BucketClient` actor (a message, its queue, a oneshot
//! reply), through the same queue as a plain struct on the worker (no
//! mailbox: a `RefCell` queue, a oneshot reply, the call on a local task),
//! and directly (`take_batch` of one key). The differences per decision are
//! the mailbox's cost and the queue's; Redis round trips come on top of
//! all three. Median of 7 rounds. Run: `cargo bench --bench mailbox`.

#![allow(clippy::unwrap_used)] // Bench code: a failed unwrap is a failed run.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::rc::Rc;
use std::time::Duration;

use tokio::sync::oneshot;

use tollgate::bucket::decision::GroupGrant;
use tollgate::bucket::store::{Answer, BatchStore, Item};
use tollgate::bucket::{Ask, BucketClient, BucketSpec, Decision, Grant, SharedStore};
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

/// The coalescing queue without an actor: decisions queue in a `RefCell`,
/// one call at a time goes out on a local task, replies go by oneshot.
#[derive(Clone)]
struct Plain(Rc<RefCell<PlainState>>);

struct PlainState {
    queue: VecDeque<(BucketSpec, Ask, oneshot::Sender<Grant>)>,
    busy: bool,
}

impl Plain {
    fn new() -> Self {
        Self(Rc::new(RefCell::new(PlainState {
            queue: VecDeque::new(),
            busy: false,
        })))
    }

    async fn take(&self, spec: BucketSpec, ask: Ask) -> Grant {
        let (tx, rx) = oneshot::channel();
        self.0.borrow_mut().queue.push_back((spec, ask, tx));
        self.dispatch();
        rx.await.unwrap()
    }

    fn dispatch(&self) {
        let batch: Vec<_> = {
            let mut state = self.0.borrow_mut();
            if state.busy || state.queue.is_empty() {
                return;
            }
            state.busy = true;
            let n = state.queue.len().min(16);
            state.queue.drain(..n).collect()
        };
        let this = self.clone();
        actix_web::rt::spawn(async move {
            let items: Vec<_> = batch
                .iter()
                .map(|(s, a, _)| Item::One("rl2:{t}:r", *s, *a))
                .collect();
            let answers = Instant.take_batch(&items).await.unwrap();
            for ((_, _, tx), answer) in batch.into_iter().zip(answers) {
                if let Answer::One(grant) = answer {
                    let _ = tx.send(grant);
                }
            }
            this.0.borrow_mut().busy = false;
            this.dispatch();
        });
    }
}

fn main() {
    actix::System::new().block_on(async {
        let spec = BucketSpec::of(NonZeroU32::new(100).unwrap(), NonZeroU32::new(10).unwrap());
        let client = BucketClient::start(Instant, Metrics::new(), false, 16);
        let clock = SystemClock::new();
        let plain = Plain::new();
        let (mut via_actor, mut via_plain, mut direct) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..7 {
            let started = clock.now_micros();
            for _ in 0..N {
                client
                    .take("rl2:{t}:r", &spec, Ask::single(1))
                    .await
                    .unwrap();
            }
            via_actor.push((clock.now_micros() - started) as f64 * 1000.0 / N as f64);
            let started = clock.now_micros();
            for _ in 0..N {
                plain.take(spec, Ask::single(1)).await;
            }
            via_plain.push((clock.now_micros() - started) as f64 * 1000.0 / N as f64);
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
        let (actor, queue, call) = (
            median(&mut via_actor),
            median(&mut via_plain),
            median(&mut direct),
        );
        println!("decisions per round              {N}");
        println!("through the bucket-client actor  {actor:8.0} ns per decision (median of 7)");
        println!("through a plain struct queue     {queue:8.0} ns per decision");
        println!("direct call                      {call:8.0} ns per decision");
        println!(
            "the mailbox's cost               {:8.0} ns per decision",
            actor - queue
        );
    });
}
