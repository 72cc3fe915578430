//! Coalesced Redis calls: one worker's bucket-client actor.
//!
//! Owns how one proxy worker's decisions reach Redis. Every decision that
//! needs Redis becomes a [`Take`] message to this worker's [`BucketClient`],
//! an actor started on the worker's own arbiter, so its messages never
//! cross threads. When no call is in flight the decision goes out at once,
//! alone: no added wait at low load. Decisions arriving while a call is in
//! flight queue up and ride the next call together, up to
//! `redis.max_keys_per_call` keys in one script call with one reading of
//! Redis's clock. On a Redis Cluster a call holds the keys of one hash
//! slot (every bucket of a tenant shares its slot through the `{tenant}`
//! hash tag; sub-bucket keys have their own): each slot has at most one
//! call in flight and its own queue.
//!
//! The limits of a request with several ([`TakeGroup`]) queue and ride
//! like single decisions, every key of the request in the same call (a
//! group is never split; all its keys share the tenant's slot); each key
//! counts against the cap.
//!
//! Each call is bounded by `redis.timeout_ms` and reported (by the store)
//! to the breaker of the primary it went to, once, success or failure;
//! when it fails every decision in it hears
//! [`RedisCallError::CallFailed`] and is decided locally. A decision waits
//! at most two timeouts in all (the call in flight ahead of it, then its
//! own), whatever befalls the client; one that gives up while still queued
//! is decided locally and never sent, so it spends no tokens nobody uses.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use actix::fut::{ActorFutureExt, WrapFuture};
use actix::{Actor, Addr, AsyncContext, Context, Handler, Message};
use futures_util::future::join_all;
use redis::cluster_routing::Slot;
use tokio::sync::oneshot;

use super::decision::{Ask, BucketSpec, Grant, GroupGrant, GroupLimit};
use super::redis::RedisBucket;
use super::store::{Answer, BatchStore, Item, SharedStore};
use crate::redis_client::RedisCallError;
use crate::telemetry::{Metrics, RedisErrorKind};

/// Which calls may share a script call: every key on a single server, the
/// keys of one hash slot on a Cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Group {
    /// One Redis server: one group.
    Server,
    /// One slot of a Redis Cluster.
    Slot(Slot),
}

/// The answer to one decision.
type Reply = oneshot::Sender<Result<Grant, RedisCallError>>;

/// Take tokens from one bucket, as `ask` says, and answer on `reply`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Take {
    /// The bucket's key.
    pub key: String,
    /// The bucket in force.
    pub spec: BucketSpec,
    /// What to take.
    pub ask: Ask,
    /// Where the grant goes; a decision that gave up has dropped the
    /// other end, and is then not sent.
    pub reply: Reply,
}

/// The answer to one group decision.
type GroupReply = oneshot::Sender<Result<GroupGrant, RedisCallError>>;

/// Take the same count from every limit of one request, as `ask` says,
/// or nothing from any, and answer on `reply`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct TakeGroup {
    /// Each limit's key, and the limit in force.
    pub limits: Vec<(String, GroupLimit)>,
    /// What to take.
    pub ask: Ask,
    /// Where the grant goes.
    pub reply: GroupReply,
}

/// A decision waiting for a call.
enum Job {
    /// One bucket.
    One(Take),
    /// Every limit of one request.
    Group(TakeGroup),
}

impl Job {
    /// Whether the decision gave up waiting (no one to answer).
    fn abandoned(&self) -> bool {
        match self {
            Self::One(take) => take.reply.is_closed(),
            Self::Group(take) => take.reply.is_closed(),
        }
    }

    /// The keys it puts in a call.
    fn keys(&self) -> usize {
        match self {
            Self::One(_) => 1,
            Self::Group(take) => take.limits.len(),
        }
    }

    /// What the store is asked for it.
    fn item(&self) -> Item<'_> {
        match self {
            Self::One(take) => Item::One(&take.key, take.spec, take.ask),
            Self::Group(take) => Item::Group(&take.limits, take.ask),
        }
    }

    /// Tells the decision what the call answered (a decision that gave
    /// up has no one to tell).
    fn answer(self, result: Result<Answer, RedisCallError>) {
        match self {
            Self::One(take) => {
                let _ = take.reply.send(result.and_then(Answer::one));
            }
            Self::Group(take) => {
                let _ = take.reply.send(result.and_then(Answer::group));
            }
        }
    }

    /// The key that places it on a Cluster (a group's keys share a slot).
    fn first_key(&self) -> &str {
        match self {
            Self::One(take) => &take.key,
            Self::Group(take) => take.limits.first().map_or("", |(key, _)| key),
        }
    }
}

/// The decisions of one group, and whether its call is in flight.
#[derive(Default)]
struct Queue {
    /// Decisions not sent yet, oldest first.
    waiting: VecDeque<Job>,
    /// Whether a call of this group is in flight.
    busy: bool,
}

/// One proxy worker's client of the shared buckets, over `B` (Redis in
/// production).
pub struct BucketClient<B: BatchStore = RedisBucket> {
    /// This worker's script client.
    redis: B,
    /// Error counts and keys per call.
    metrics: Metrics,
    /// Whether keys are grouped by Cluster slot.
    cluster: bool,
    /// Most keys in one call.
    max_keys: usize,
    /// Each group with decisions waiting or a call in flight.
    queues: HashMap<Group, Queue>,
}

impl<B: BatchStore> BucketClient<B> {
    /// Starts a client on the current arbiter (call it on the worker that
    /// will use it) and returns the store the worker's limiter uses.
    pub fn start(redis: B, metrics: Metrics, cluster: bool, max_keys: usize) -> Coalesced<B> {
        let timeout = redis.timeout();
        let addr = Self {
            redis,
            metrics: metrics.clone(),
            cluster,
            max_keys: max_keys.max(1),
            queues: HashMap::new(),
        }
        .start();
        Coalesced {
            addr,
            timeout,
            metrics,
        }
    }

    /// Sends `group`'s next call, unless one is in flight: its oldest
    /// decisions still waiting for an answer, up to the cap. A group with
    /// nothing left to do is forgotten.
    fn dispatch(&mut self, ctx: &mut Context<Self>, group: Group) {
        let Some(queue) = self.queues.get_mut(&group) else {
            return;
        };
        if queue.busy {
            return;
        }
        let mut batch = Vec::with_capacity(self.max_keys.min(queue.waiting.len()));
        let mut keys = 0;
        while let Some(job) = queue.waiting.front() {
            if job.abandoned() {
                queue.waiting.pop_front();
                continue;
            }
            // A request's limits are never split; one larger than the cap
            // goes alone.
            if keys > 0 && keys + job.keys() > self.max_keys {
                break;
            }
            keys += job.keys();
            batch.extend(queue.waiting.pop_front());
            if keys >= self.max_keys {
                break;
            }
        }
        if batch.is_empty() {
            self.queues.remove(&group);
            return;
        }
        queue.busy = true;
        self.send(ctx, group, batch, keys);
    }

    /// One script call for `batch` (of `keys` keys); its answers go to
    /// their decisions.
    fn send(&mut self, ctx: &mut Context<Self>, group: Group, batch: Vec<Job>, keys: usize) {
        let (redis, metrics) = (self.redis.clone(), self.metrics.clone());
        self.metrics.redis_keys_per_call(keys);
        let call = async move {
            let answers = answers_for(&redis, &metrics, &batch, keys).await;
            (answers, batch)
        };
        ctx.spawn(
            call.into_actor(self)
                .map(move |(answers, batch), client, ctx| {
                    for (job, answer) in batch.into_iter().zip(answers) {
                        job.answer(answer);
                    }
                    if let Some(queue) = client.queues.get_mut(&group) {
                        queue.busy = false;
                    }
                    client.dispatch(ctx, group);
                }),
        );
    }

    /// Queues `job` in its group and sends the group's next call if none is
    /// in flight.
    fn enqueue(&mut self, ctx: &mut Context<Self>, job: Job) {
        let group = if self.cluster {
            Group::Slot(Slot::for_key(job.first_key().as_bytes()))
        } else {
            Group::Server
        };
        self.queues.entry(group).or_default().waiting.push_back(job);
        self.dispatch(ctx, group);
    }
}

/// The answer to each job of `batch` (of `keys` keys), failures counted
/// in `metrics`: from one call for the whole batch or, when Redis refuses
/// that call for what it carried (a script error), from one call per job,
/// so that one decision's fault fails that decision alone. (A script that
/// failed after writing some keys leaves them charged: the repeat charges
/// them again, which admits fewer, never more.)
async fn answers_for<B: BatchStore>(
    redis: &B,
    metrics: &Metrics,
    batch: &[Job],
    keys: usize,
) -> Vec<Result<Answer, RedisCallError>> {
    let items: Vec<Item<'_>> = batch.iter().map(Job::item).collect();
    let counted = |result: Result<Answer, RedisCallError>| {
        match &result {
            Ok(Answer::Refused) => metrics.redis_error(RedisErrorKind::Refused),
            Err(e) => metrics.redis_error(e.kind()),
            Ok(_) => {}
        }
        result
    };
    match redis.take_batch(&items).await {
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

/// Messages one client may hold before senders are turned away (and
/// decide locally): a worker's requests in flight, with room to spare
/// (actix's default is 16).
const MAILBOX: usize = 4096;

impl<B: BatchStore> Actor for BucketClient<B> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(MAILBOX);
    }
}

impl<B: BatchStore> Handler<Take> for BucketClient<B> {
    type Result = ();

    fn handle(&mut self, take: Take, ctx: &mut Context<Self>) {
        self.enqueue(ctx, Job::One(take));
    }
}

impl<B: BatchStore> Handler<TakeGroup> for BucketClient<B> {
    type Result = ();

    fn handle(&mut self, take: TakeGroup, ctx: &mut Context<Self>) {
        self.enqueue(ctx, Job::Group(take));
    }
}

/// The shared store as a worker's limiter sees it: its [`BucketClient`].
pub struct Coalesced<B: BatchStore = RedisBucket> {
    /// The worker's bucket client.
    addr: Addr<BucketClient<B>>,
    /// The bound on one call; a decision waits at most twice this.
    timeout: Duration,
    /// Counts decisions turned away by a full queue.
    metrics: Metrics,
}

impl<B: BatchStore> Clone for Coalesced<B> {
    fn clone(&self) -> Self {
        Self {
            addr: self.addr.clone(),
            timeout: self.timeout,
            metrics: self.metrics.clone(),
        }
    }
}

impl<B: BatchStore> SharedStore for Coalesced<B> {
    fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn take(&self, key: &str, spec: &BucketSpec, ask: Ask) -> Result<Grant, RedisCallError> {
        let (reply, answer) = oneshot::channel();
        let take = Take {
            key: key.to_owned(),
            spec: *spec,
            ask,
            reply,
        };
        if self.addr.try_send(take).is_err() {
            return Err(self.queue_full());
        }
        answered(answer, 2 * self.timeout).await
    }

    async fn take_group(
        &self,
        group: &[(String, GroupLimit)],
        ask: Ask,
    ) -> Result<GroupGrant, RedisCallError> {
        let (reply, answer) = oneshot::channel();
        let take = TakeGroup {
            limits: group.to_vec(),
            ask,
            reply,
        };
        if self.addr.try_send(take).is_err() {
            return Err(self.queue_full());
        }
        answered(answer, 2 * self.timeout).await
    }
}

impl<B: BatchStore> Coalesced<B> {
    /// Counts a decision the full queue turned away; its error.
    fn queue_full(&self) -> RedisCallError {
        self.metrics.redis_error(RedisErrorKind::QueueFull);
        RedisCallError::CallFailed(RedisErrorKind::QueueFull)
    }
}

/// What the bucket client answered on `answer`, waiting at most `limit`.
async fn answered<T>(
    answer: oneshot::Receiver<Result<T, RedisCallError>>,
    limit: Duration,
) -> Result<T, RedisCallError> {
    match tokio::time::timeout(limit, answer).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => Err(RedisCallError::CallFailed(RedisErrorKind::Connection)),
        Err(_) => Err(RedisCallError::CallFailed(RedisErrorKind::Timeout)),
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
        let gate = Arc::new(BreakerGate::new());
        let store = FakeStore::new(TokioClock::shared(), TIMEOUT, gate.clone());
        let client = BucketClient::start(store.clone(), Metrics::new(), cluster, max_keys);
        (store, gate, client)
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
        let seen = gate.drain();
        assert_eq!(
            (seen.successes, seen.failures),
            (1, 1),
            "one failure for the call"
        );
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
        let seen = gate.drain();
        assert_eq!((seen.successes, seen.failures), (2, 0));
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
        let seen = gate.drain();
        assert_eq!(
            (seen.successes, seen.failures),
            (5, 0),
            "a refused call is no failure of Redis"
        );
    }

    #[actix_web::test]
    async fn a_decision_waits_two_timeouts_at_most_and_one_that_gave_up_is_never_sent() {
        tokio::time::pause();
        let (store, _, client) = setup(1, false);
        let started = tokio::time::Instant::now();
        // One key per call, each call 49 ms: the first ends at 49 ms, t0's
        // at 98 ms, t1's would at 147 ms; t1 and t2 give up at 100 ms, t2
        // while still queued.
        let (first, riders) = behind_a_slow_call(&store, &client, 49, 3).await;
        for _ in 0..2 {
            store.fail_next(Fault::Slow(Duration::from_millis(49)));
        }
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
        assert!(started.elapsed() <= 2 * TIMEOUT + Duration::from_millis(1));
        // Once t1's call ends, t2, which gave up while queued, is dropped.
        tokio::time::sleep(Duration::from_millis(60)).await;
        let sent: Vec<_> = store.batches().concat();
        assert_eq!(sent, ["rl2:{first}:r", "rl2:{t0}:r", "rl2:{t1}:r"]);
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
