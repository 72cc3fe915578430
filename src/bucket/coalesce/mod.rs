//! Coalesced Redis calls: one worker's queue of decisions.
//!
//! Owns how one proxy worker's decisions reach Redis. Every decision that
//! needs Redis takes a ticket in this worker's [`Coalesced`] client, a
//! queue kept on the worker's own thread (no message crosses threads, no
//! channel, no lock). When fewer calls than `redis.max_calls_in_flight`
//! (1 by default) are in flight, the decision goes out in the worker's
//! current turn, once the tasks it was already woken for have run: the
//! decisions of requests that arrived together ride one call, and a lone
//! one waits for nothing. Decisions arriving while that many calls are in
//! flight queue up and ride the next call together, up to
//! `redis.max_keys_per_call` keys in one script call with one reading of
//! Redis's clock. On a Redis Cluster a call holds the keys of one hash
//! slot (every bucket of a tenant shares its slot through the `{tenant}`
//! hash tag; sub-bucket keys have their own): each slot has its own calls
//! in flight and its own queue.
//!
//! The limits of a request with several (`take_group`) queue and ride
//! like single decisions, every key of the request in the same call (a
//! group is never split; all its keys share the tenant's slot); each key
//! counts against the cap.
//!
//! A decision costs no allocation, channel or timer of its own once the
//! worker is warm: tickets, key buffers and batches are reused, a decision
//! waits on its ticket (the sender's task wakes it), only a call has a
//! timer, and one task sends a group's calls back to back while decisions
//! wait. Each call is bounded by `redis.timeout_ms` and reported (by the
//! store) to the breaker of the primary it went to, once, success or
//! failure; when it fails every decision in it hears
//! [`RedisCallError::CallFailed`] and is decided locally. A decision waits
//! less than two timeouts in all: one that has waited a timeout by the
//! time its call would go out (the calls ahead of it were slow) is decided
//! locally instead and never sent, and so is one whose request is gone, so
//! neither spends tokens nobody uses.

mod tickets;

use std::cell::RefCell;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::join_all;
use redis::cluster_routing::Slot;
use tokio::time::Instant;

use super::decision::{Ask, BucketSpec, Grant, GroupGrant, GroupLimit};
use super::redis::RedisBucket;
use super::store::{Answer, BatchStore, Item, SharedStore};
use crate::redis_client::RedisCallError;
use crate::telemetry::{Metrics, RedisErrorKind};
use tickets::{Group, Job, Pool, State};

/// What one worker's client keeps.
struct Inner<B> {
    /// This worker's script client.
    redis: B,
    /// Error counts and keys per call.
    metrics: Metrics,
    /// Whether keys are grouped by Cluster slot.
    cluster: bool,
    /// Most keys in one call, and calls in flight per group.
    limits: CallLimits,
    /// The queues and tickets.
    state: RefCell<State>,
}

/// Decisions one client may hold waiting or in flight before more are
/// turned away (and decided locally): a worker's requests in flight, with
/// room to spare.
const MAX_WAITING: usize = 4096;

/// How a worker's calls are bounded (`redis.max_keys_per_call`,
/// `redis.max_calls_in_flight`).
#[derive(Debug, Clone, Copy)]
pub struct CallLimits {
    /// Most keys one call carries.
    pub max_keys: usize,
    /// Most calls of one group in flight at once: with more than one, a
    /// decision that arrives while a call is out goes in the next call at
    /// once instead of waiting for the first to come back.
    pub max_in_flight: usize,
}

/// One proxy worker's client of the shared buckets, over `B` (Redis in
/// production): the store its limiter uses. Clones share the queue; it
/// lives on the worker's thread.
pub struct Coalesced<B: BatchStore = RedisBucket> {
    /// The worker's queue.
    inner: Rc<Inner<B>>,
}

impl<B: BatchStore> Clone for Coalesced<B> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<B: BatchStore> Coalesced<B> {
    /// A client over `redis`, for the worker whose thread uses it (its
    /// calls run as tasks there), its calls bounded by `limits`.
    pub fn start(redis: B, metrics: Metrics, cluster: bool, limits: CallLimits) -> Self {
        Self {
            inner: Rc::new(Inner {
                redis,
                metrics,
                cluster,
                limits: CallLimits {
                    max_keys: limits.max_keys.max(1),
                    max_in_flight: limits.max_in_flight.max(1),
                },
                state: RefCell::new(State::default()),
            }),
        }
    }

    /// Queues the job `make` builds (from the spare buffers it is given),
    /// sends its group's next call if none is in flight, and waits for
    /// the job's answer.
    async fn ask(&self, make: impl FnOnce(&mut Pool) -> Job) -> Result<Answer, RedisCallError> {
        let id = self.enqueue(make)?;
        Waiting {
            client: self,
            id,
            done: false,
        }
        .await
    }

    /// Queues the job `make` builds and starts its group's sender if
    /// fewer than allowed run; the ticket to wait on.
    fn enqueue(&self, make: impl FnOnce(&mut Pool) -> Job) -> Result<usize, RedisCallError> {
        let mut state = self.inner.state.borrow_mut();
        if state.pool.in_use() >= MAX_WAITING {
            drop(state);
            self.inner.metrics.redis_error(RedisErrorKind::QueueFull);
            return Err(RedisCallError::CallFailed(RedisErrorKind::QueueFull));
        }
        let job = make(&mut state.pool);
        let group = if self.inner.cluster {
            Group::Slot(Slot::for_key(job.item().first_key().as_bytes()))
        } else {
            Group::Server
        };
        let id = state.pool.issue(job);
        let queue = state.queues.entry(group);
        queue.waiting.push_back(id);
        let start = queue.in_flight < self.inner.limits.max_in_flight;
        if start {
            queue.in_flight += 1;
        }
        drop(state);
        if start {
            let client = self.clone();
            tokio::task::spawn_local(async move { client.send(group).await });
        }
        Ok(id)
    }

    /// One sender of `group`: makes calls one after the other while
    /// decisions wait, then ends. Its first call takes its decisions when
    /// the task first runs, after the tasks the worker was already woken
    /// for: the decisions of requests that arrived together ride one call
    /// instead of the first going alone. A finished call's successor
    /// leaves once the decisions it answered have run on (the next turn
    /// of the worker), with what queued meanwhile: under load the
    /// answered requests reach their upstreams first, and the next call
    /// carries more.
    async fn send(&self, group: Group) {
        while let Some((batch, keys)) = self.next_batch(group) {
            self.inner.metrics.redis_keys_per_call(keys);
            let answers = {
                let items: Vec<Item<'_>> = batch.iter().map(|(_, job)| job.item()).collect();
                answers_for(&self.inner.redis, &self.inner.metrics, &items, keys).await
            };
            self.settle(batch, answers);
            if self.ends_if_idle(group) {
                return;
            }
            // The next call leaves after the decisions just answered have
            // run on, and with whatever arrived meanwhile.
            tokio::task::yield_now().await;
        }
    }

    /// Ends this sender of `group` when no decision waits: a lone call
    /// (low load) costs no extra turn of the worker, and a decision that
    /// comes later starts a sender of its own. Whether it ended.
    fn ends_if_idle(&self, group: Group) -> bool {
        let mut state = self.inner.state.borrow_mut();
        let idle = state
            .queues
            .get_mut(group)
            .is_none_or(|queue| queue.waiting.is_empty());
        if idle {
            state.queues.sender_ends(group);
        }
        idle
    }

    /// `group`'s next call: its oldest decisions still waiting, up to the
    /// cap, and their key count. Decisions that are gone are freed, and
    /// those that have waited a timeout are decided locally, neither sent.
    /// None when nothing is left to send: the sender then ends, and a
    /// group with nothing waiting and no sender is forgotten.
    fn next_batch(&self, group: Group) -> Option<(Vec<(usize, Job)>, usize)> {
        let inner = &*self.inner;
        let mut guard = inner.state.borrow_mut();
        let state = &mut *guard;
        let queue = state.queues.get_mut(group)?;
        let pool = &mut state.pool;
        let (now, timeout) = (Instant::now(), inner.redis.timeout());
        let mut batch = pool.spare_batches.pop().unwrap_or_default();
        let mut keys = 0;
        while let Some(&id) = queue.waiting.front() {
            let ticket = &mut pool.tickets[id];
            if ticket.gone {
                queue.waiting.pop_front();
                pool.release(id);
                continue;
            }
            if ticket
                .queued_at
                .is_some_and(|at| now.duration_since(at) >= timeout)
            {
                queue.waiting.pop_front();
                pool.answer(id, Err(RedisCallError::CallFailed(RedisErrorKind::Timeout)));
                continue;
            }
            let job_keys = ticket.job.as_ref().map_or(0, |job| job.item().key_count());
            // A request's limits are never split; one larger than the cap
            // goes alone.
            if keys > 0 && keys + job_keys > inner.limits.max_keys {
                break;
            }
            queue.waiting.pop_front();
            keys += job_keys;
            if let Some(job) = ticket.job.take() {
                batch.push((id, job));
            }
            if keys >= inner.limits.max_keys {
                break;
            }
        }
        if batch.is_empty() {
            pool.spare_batches.push(batch);
            state.queues.sender_ends(group);
            return None;
        }
        Some((batch, keys))
    }

    /// Gives each decision of a finished call its answer.
    fn settle(&self, mut batch: Vec<(usize, Job)>, answers: Vec<Result<Answer, RedisCallError>>) {
        let mut state = self.inner.state.borrow_mut();
        let pool = &mut state.pool;
        for ((id, job), answer) in batch.drain(..).zip(answers) {
            pool.recycle(job);
            pool.answer(id, answer);
        }
        pool.spare_batches.push(batch);
    }
}

/// The answer to each of `items` (of `keys` keys), failures counted in
/// `metrics`: from one call for the whole batch or, when Redis refuses
/// that call for what it carried (a script error), from one call per item,
/// so that one decision's fault fails that decision alone. (A script that
/// failed after writing some keys leaves them charged: the repeat charges
/// them again, which admits fewer, never more.)
async fn answers_for<B: BatchStore>(
    redis: &B,
    metrics: &Metrics,
    items: &[Item<'_>],
    keys: usize,
) -> Vec<Result<Answer, RedisCallError>> {
    let counted = |result: Result<Answer, RedisCallError>| {
        match &result {
            Ok(Answer::Refused) => metrics.redis_error(RedisErrorKind::Refused),
            Err(e) => metrics.redis_error(e.kind()),
            Ok(_) => {}
        }
        result
    };
    match redis.take_batch(items).await {
        Ok(answers) => {
            let mut answers = answers.into_iter();
            items
                .iter()
                .map(|_| counted(answers.next().ok_or(RedisCallError::BadReply)))
                .collect()
        }
        Err(e) if e.is_refusal() && items.len() > 1 => {
            tracing::debug!(error = %e, keys, "Redis refused a shared call; its decisions are asked alone.");
            let alone = items.iter().map(|item| async {
                let answers = redis.take_batch(std::slice::from_ref(item)).await;
                counted(answers.and_then(|mut a| a.pop().ok_or(RedisCallError::BadReply)))
            });
            join_all(alone).await
        }
        Err(e) => {
            tracing::debug!(error = %e, keys, "Redis call failed; its decisions are made locally.");
            let kind = e.kind();
            metrics.redis_error(kind);
            items
                .iter()
                .map(|_| Err(RedisCallError::CallFailed(kind)))
                .collect()
        }
    }
}

/// A decision waiting on its ticket; dropping it gives the ticket up.
struct Waiting<'a, B: BatchStore> {
    /// The client holding the ticket.
    client: &'a Coalesced<B>,
    /// The ticket.
    id: usize,
    /// Whether the answer was read (the ticket is free).
    done: bool,
}

impl<B: BatchStore> Future for Waiting<'_, B> {
    type Output = Result<Answer, RedisCallError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let (client, id) = (self.client, self.id);
        let mut state = client.inner.state.borrow_mut();
        let pool = &mut state.pool;
        let ticket = &mut pool.tickets[id];
        if let Some(answer) = ticket.answer.take() {
            pool.release(id);
            drop(state);
            self.done = true;
            return Poll::Ready(answer);
        }
        match &ticket.waker {
            Some(waker) if waker.will_wake(cx.waker()) => {}
            _ => ticket.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl<B: BatchStore> Drop for Waiting<'_, B> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut state = self.client.inner.state.borrow_mut();
        let pool = &mut state.pool;
        let ticket = &mut pool.tickets[self.id];
        ticket.waker = None;
        if ticket.answer.is_some() {
            pool.release(self.id);
        } else {
            // Freed when its call ends, or skipped when its turn comes.
            ticket.gone = true;
        }
    }
}

impl<B: BatchStore> SharedStore for Coalesced<B> {
    fn timeout(&self) -> Duration {
        self.inner.redis.timeout()
    }

    async fn take(&self, key: &str, spec: &BucketSpec, ask: Ask) -> Result<Grant, RedisCallError> {
        self.ask(|pool| {
            let mut buffer = pool.spare_keys.pop().unwrap_or_default();
            buffer.push_str(key);
            Job::One(buffer, *spec, ask)
        })
        .await
        .and_then(Answer::one)
    }

    async fn take_group(
        &self,
        group: &[(String, GroupLimit)],
        ask: Ask,
    ) -> Result<GroupGrant, RedisCallError> {
        self.ask(|pool| {
            let mut limits = pool.spare_limits.pop().unwrap_or_default();
            limits.truncate(group.len());
            for (mine, (key, limit)) in limits.iter_mut().zip(group) {
                mine.0.clone_from(key);
                mine.1 = *limit;
            }
            let kept = limits.len();
            limits.extend_from_slice(&group[kept..]);
            Job::Group(limits, ask)
        })
        .await
        .and_then(Answer::group)
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use futures_util::future::join_all;

    use std::sync::Arc;

    use super::*;
    use crate::breaker::BreakerGate;
    use crate::bucket::decision::GroupLimit;
    use crate::bucket::store::fake::{FakeStore, Fault};
    use crate::clock::TokioClock;

    const TIMEOUT: Duration = Duration::from_millis(50);

    fn setup(
        max_keys: usize,
        cluster: bool,
    ) -> (FakeStore, Arc<BreakerGate>, Coalesced<FakeStore>) {
        let limits = CallLimits {
            max_keys,
            max_in_flight: 1,
        };
        setup_with(limits, cluster)
    }

    fn setup_with(
        limits: CallLimits,
        cluster: bool,
    ) -> (FakeStore, Arc<BreakerGate>, Coalesced<FakeStore>) {
        let gate = Arc::new(BreakerGate::new());
        let store = FakeStore::new(TokioClock::shared(), TIMEOUT, gate.clone());
        let client = Coalesced::start(store.clone(), Metrics::new(), cluster, limits);
        (store, gate, client)
    }

    /// The successes and failures `gate` heard since it was last asked.
    fn reported(gate: &BreakerGate) -> (u64, u64) {
        let seen = gate.drain();
        (seen.successes, seen.failures)
    }

    fn spec() -> BucketSpec {
        BucketSpec::of(NonZeroU32::new(100).unwrap(), NonZeroU32::new(10).unwrap())
    }

    /// Sends a take of `key` from a task of its own; returns its handle.
    fn send(
        client: &Coalesced<FakeStore>,
        key: &str,
    ) -> actix_web::rt::task::JoinHandle<Result<Grant, RedisCallError>> {
        let (client, key) = (client.clone(), key.to_owned());
        actix_web::rt::spawn(async move { client.take(&key, &spec(), Ask::single(1)).await })
    }

    /// Lets spawned tasks and the actor run until `store` has seen `calls`
    /// calls (no time passes).
    async fn until_calls(store: &FakeStore, calls: usize) {
        for _ in 0..1000 {
            if store.batch_sizes().len() >= calls {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("only {} calls were made", store.batch_sizes().len());
    }

    /// Holds one call in flight for `ms` and sends `n` decisions meanwhile;
    /// returns the first decision's handle and theirs.
    async fn behind_a_slow_call(
        store: &FakeStore,
        client: &Coalesced<FakeStore>,
        ms: u64,
        n: usize,
    ) -> (
        actix_web::rt::task::JoinHandle<Result<Grant, RedisCallError>>,
        Vec<actix_web::rt::task::JoinHandle<Result<Grant, RedisCallError>>>,
    ) {
        store.fail_next(Fault::Slow(Duration::from_millis(ms)));
        let first = send(client, "rl2:{first}:r");
        until_calls(store, 1).await;
        let riders = (0..n)
            .map(|i| send(client, &format!("rl2:{{t{i}}}:r")))
            .collect();
        (first, riders)
    }

    #[actix_web::test]
    async fn a_lone_decision_goes_out_at_once_and_alone() {
        tokio::time::pause();
        let (store, _, client) = setup(16, false);
        let started = tokio::time::Instant::now();
        let grant = client
            .take("rl2:{a}:r", &spec(), Ask::single(1))
            .await
            .unwrap();
        assert!(grant.decision.allowed);
        assert_eq!(started.elapsed(), Duration::ZERO, "no added wait");
        assert_eq!(store.batch_sizes(), [1]);
    }

    #[actix_web::test]
    async fn decisions_of_requests_that_arrive_together_ride_one_call() {
        tokio::time::pause();
        let (store, gate, client) = setup(16, false);
        let started = tokio::time::Instant::now();
        let together: Vec<_> = (0..5)
            .map(|i| send(&client, &format!("rl2:{{t{i}}}:r")))
            .collect();
        for decision in together {
            assert!(decision.await.unwrap().unwrap().decision.allowed);
        }
        assert_eq!(started.elapsed(), Duration::ZERO, "no added wait");
        assert_eq!(store.batch_sizes(), [5], "no call in flight, yet one call");
        assert_eq!(gate.drain().successes, 1);
    }

    #[actix_web::test]
    async fn decisions_arriving_during_a_call_ride_the_next_one_together() {
        tokio::time::pause();
        let (store, gate, client) = setup(16, false);
        let (first, riders) = behind_a_slow_call(&store, &client, 5, 10).await;
        assert!(first.await.unwrap().is_ok());
        for rider in riders {
            assert!(rider.await.unwrap().unwrap().decision.allowed);
        }
        assert_eq!(store.batch_sizes(), [1, 10]);
        assert_eq!(gate.drain().successes, 2, "one success per call");
    }

    #[actix_web::test]
    async fn with_two_calls_in_flight_a_decision_behind_a_slow_call_goes_out_at_once() {
        tokio::time::pause();
        let limits = CallLimits {
            max_keys: 16,
            max_in_flight: 2,
        };
        let (store, _, client) = setup_with(limits, false);
        let started = tokio::time::Instant::now();
        let (first, riders) = behind_a_slow_call(&store, &client, 5, 3).await;
        for rider in riders {
            assert!(rider.await.unwrap().unwrap().decision.allowed);
        }
        assert_eq!(
            started.elapsed(),
            Duration::ZERO,
            "none waited for the slow call"
        );
        assert!(first.await.unwrap().is_ok());
        // The riders, queued in one turn of the worker, went out together
        // beside the slow call.
        assert_eq!(store.batch_sizes(), [1, 3]);
    }

    /// Sends the three limits of one request (tenant `t`) from a task of
    /// its own.
    fn send_group(
        client: &Coalesced<FakeStore>,
        t: &str,
    ) -> actix_web::rt::task::JoinHandle<Result<GroupGrant, RedisCallError>> {
        let limits: Vec<(String, GroupLimit)> = (0..3)
            .map(|i| (format!("rl2:{{{t}}}:r#{i}"), GroupLimit::Bucket(spec())))
            .collect();
        let client = client.clone();
        actix_web::rt::spawn(async move { client.take_group(&limits, Ask::single(1)).await })
    }

    #[actix_web::test]
    async fn a_requests_limits_ride_with_other_decisions_and_are_never_split() {
        tokio::time::pause();
        let (store, gate, client) = setup(4, false);
        let (first, riders) = behind_a_slow_call(&store, &client, 5, 2).await;
        let group = send_group(&client, "g");
        let last = send(&client, "rl2:{z}:r");
        assert!(first.await.unwrap().is_ok());
        let decisions = group.await.unwrap().unwrap().decisions;
        assert_eq!(decisions.len(), 3);
        assert!(decisions.iter().all(|d| d.allowed));
        for rider in riders {
            assert!(rider.await.unwrap().is_ok());
        }
        assert!(last.await.unwrap().is_ok());
        // Two singles and the group's three keys do not fit in 4: the
        // group waits for the next call, whole, with the last single.
        assert_eq!(store.batch_sizes(), [1, 2, 4]);
        assert_eq!(
            store.batches()[2],
            ["rl2:{g}:r#0", "rl2:{g}:r#1", "rl2:{g}:r#2", "rl2:{z}:r"]
        );
        assert_eq!(gate.drain().successes, 3, "one success per call");
    }

    #[actix_web::test]
    async fn a_call_carries_at_most_max_keys() {
        tokio::time::pause();
        let (store, _, client) = setup(4, false);
        let (first, riders) = behind_a_slow_call(&store, &client, 5, 10).await;
        first.await.unwrap().unwrap();
        for rider in riders {
            rider.await.unwrap().unwrap();
        }
        assert_eq!(store.batch_sizes(), [1, 4, 4, 2]);
    }

    #[actix_web::test]
    async fn a_failed_call_fails_each_of_its_decisions_and_counts_once() {
        tokio::time::pause();
        let (store, gate, client) = setup(16, false);
        let (first, riders) = behind_a_slow_call(&store, &client, 5, 5).await;
        // The riders' call, made once the first one ends, breaks off.
        store.fail_next(Fault::Dropped);
        first.await.unwrap().unwrap();
        for rider in riders {
            let failed = rider.await.unwrap();
            assert!(
                matches!(
                    failed,
                    Err(RedisCallError::CallFailed(RedisErrorKind::Connection))
                ),
                "{failed:?}"
            );
        }
        assert_eq!(reported(&gate), (1, 1), "one failure for the call");
    }

    #[actix_web::test]
    async fn a_refused_decision_fails_alone_and_the_breaker_does_not_count_it() {
        tokio::time::pause();
        let (store, gate, client) = setup(16, false);
        store.poison("rl2:{t2}:r");
        let (first, riders) = behind_a_slow_call(&store, &client, 5, 5).await;
        first.await.unwrap().unwrap();
        for (i, rider) in riders.into_iter().enumerate() {
            let answer = rider.await.unwrap();
            if i == 2 {
                assert!(matches!(answer, Err(RedisCallError::Refused)), "{answer:?}");
            } else {
                assert!(answer.unwrap().decision.allowed, "rider {i}");
            }
        }
        assert_eq!(store.batch_sizes(), [1, 5], "no call was repeated");
        assert_eq!(reported(&gate), (2, 0));
    }

    #[actix_web::test]
    async fn a_call_refused_whole_is_asked_again_one_decision_per_call() {
        tokio::time::pause();
        let (store, gate, client) = setup(16, false);
        let (first, riders) = behind_a_slow_call(&store, &client, 5, 4).await;
        // The riders' call fails with a script error: Redis is well.
        store.fail_next(Fault::ScriptError);
        first.await.unwrap().unwrap();
        for rider in riders {
            assert!(rider.await.unwrap().unwrap().decision.allowed);
        }
        assert_eq!(store.batch_sizes(), [1, 4, 1, 1, 1, 1]);
        assert_eq!(
            reported(&gate),
            (5, 0),
            "a refused call is no failure of Redis"
        );
    }

    #[actix_web::test]
    async fn a_decision_waits_less_than_two_timeouts_and_one_late_to_go_out_is_never_sent() {
        tokio::time::pause();
        let (store, _, client) = setup(1, false);
        let started = tokio::time::Instant::now();
        // One key per call, each call 45 ms: the first ends at about 45 ms,
        // when t0 (queued as long, under the timeout) goes out; its call
        // ends at about 90 ms, when t1 and t2 have waited a timeout: they
        // are decided locally then, and never sent.
        let (first, riders) = behind_a_slow_call(&store, &client, 45, 3).await;
        store.fail_next(Fault::Slow(Duration::from_millis(45)));
        first.await.unwrap().unwrap();
        let answers: Vec<_> = join_all(riders)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert!(answers[0].is_ok(), "{:?}", answers[0]);
        for gave_up in &answers[1..] {
            assert!(
                matches!(
                    gave_up,
                    Err(RedisCallError::CallFailed(RedisErrorKind::Timeout))
                ),
                "{gave_up:?}"
            );
        }
        assert!(started.elapsed() < 2 * TIMEOUT);
        tokio::time::sleep(Duration::from_millis(60)).await;
        let sent: Vec<_> = store.batches().concat();
        assert_eq!(sent, ["rl2:{first}:r", "rl2:{t0}:r"]);
    }

    #[actix_web::test]
    async fn a_decision_whose_request_is_gone_is_never_sent_and_its_ticket_is_reused() {
        tokio::time::pause();
        let (store, _, client) = setup(16, false);
        let (first, mut riders) = behind_a_slow_call(&store, &client, 5, 2).await;
        // Both riders queue behind the first call; then t0's request goes.
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        riders.remove(0).abort();
        first.await.unwrap().unwrap();
        for rider in riders {
            assert!(rider.await.unwrap().unwrap().decision.allowed);
        }
        assert_eq!(store.batches().concat(), ["rl2:{first}:r", "rl2:{t1}:r"]);
        // The sender ends when it next finds nothing to send.
        tokio::task::yield_now().await;
        let state = client.inner.state.borrow();
        assert_eq!(state.pool.in_use(), 0, "every ticket is free again");
        assert!(
            state.pool.tickets.len() <= 3,
            "{}",
            state.pool.tickets.len()
        );
        let server = &state.queues.server;
        assert!(server.waiting.is_empty() && server.in_flight == 0);
    }

    #[actix_web::test]
    async fn a_timed_out_call_ends_within_the_timeout() {
        tokio::time::pause();
        let (store, _, client) = setup(16, false);
        store.fail_next(Fault::Slow(TIMEOUT));
        let started = tokio::time::Instant::now();
        let result = client.take("rl2:{slow}:r", &spec(), Ask::single(1)).await;
        assert!(
            matches!(
                result,
                Err(RedisCallError::CallFailed(RedisErrorKind::Timeout))
            ),
            "{result:?}"
        );
        assert!(started.elapsed() <= TIMEOUT + Duration::from_millis(1));
    }

    #[actix_web::test]
    async fn on_a_cluster_a_call_holds_the_keys_of_one_slot() {
        tokio::time::pause();
        let (store, _, client) = setup(16, true);
        store.fail_next(Fault::Slow(Duration::from_millis(5)));
        let first = send(&client, "rl2:{a}:x");
        until_calls(&store, 1).await;
        // Another slot goes out at once; the same slot waits for its call.
        let other = send(&client, "rl2:{b}:x");
        until_calls(&store, 2).await;
        let same = [send(&client, "rl2:{a}:y"), send(&client, "rl2:{a}:z")];
        first.await.unwrap().unwrap();
        other.await.unwrap().unwrap();
        for rider in same {
            rider.await.unwrap().unwrap();
        }
        assert_eq!(
            store.batches(),
            [
                vec!["rl2:{a}:x".to_owned()],
                vec!["rl2:{b}:x".to_owned()],
                vec!["rl2:{a}:y".to_owned(), "rl2:{a}:z".to_owned()],
            ]
        );
    }
}
