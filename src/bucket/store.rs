//! The seam under the limiter: the store of buckets shared by every gateway.
//!
//! Owns [`SharedStore`], what the [`super::Limiter`] needs of it: one atomic
//! take per decision, bounded by the store's own timeout, each call's
//! outcome reported to the breaker by the store; and [`BatchStore`], what
//! the coalescer needs below it: several takes in one call, each call's
//! outcome reported to the breaker of the primary it went to. In production
//! the limiter's store is [`super::Coalesced`] (this worker's decision
//! queue) over [`RedisBucket`]; tests use an in-memory fake
//! (`store::fake`, test builds only) that follows the script's arithmetic
//! on an injected clock and can be slow, time out, drop a connection
//! mid-call or answer `NOSCRIPT`, so the limiter's order, single-flight
//! lease fetches and background top-ups are tested on tokio's paused time.

use std::time::Duration;

use super::decision::{Ask, BucketSpec, Grant, GroupGrant, GroupLimit};
use super::redis::RedisBucket;
use crate::redis_client::RedisCallError;

/// A store of token buckets shared by every gateway instance. It reports
/// the outcome of each call it makes to the breaker (a call may carry
/// several decisions).
pub trait SharedStore: Clone + 'static {
    /// The bound on one call.
    fn timeout(&self) -> Duration;

    /// Refills `key`'s bucket and takes tokens atomically, as `ask` says.
    ///
    /// # Errors
    /// [`RedisCallError`] when the store could not decide (timeout,
    /// connection or server failure); the caller then decides locally.
    fn take(
        &self,
        key: &str,
        spec: &BucketSpec,
        ask: Ask,
    ) -> impl Future<Output = Result<Grant, RedisCallError>>;

    /// Takes the same count from every limit of `group` (one request's
    /// limits, all keys of one tenant), as `ask` says, or nothing from any,
    /// atomically; the decisions come in the same order and agree on
    /// `allowed`.
    ///
    /// # Errors
    /// As [`SharedStore::take`].
    fn take_group(
        &self,
        group: &[(String, GroupLimit)],
        ask: Ask,
    ) -> impl Future<Output = Result<GroupGrant, RedisCallError>>;
}

/// One decision of a batched call.
#[derive(Debug, Clone, Copy)]
pub enum Item<'a> {
    /// One bucket, tokens taken as the `Ask` says.
    One(&'a str, BucketSpec, Ask),
    /// Every limit of one request: the same count from each, as the `Ask`
    /// says, or nothing from any.
    Group(&'a [(String, GroupLimit)], Ask),
}

impl<'a> Item<'a> {
    /// Its keys, in the order the store is asked them.
    pub fn keys(&self) -> impl Iterator<Item = &'a str> {
        let (one, group) = match *self {
            Self::One(key, ..) => (Some(key), &[][..]),
            Self::Group(group, _) => (None, group),
        };
        one.into_iter()
            .chain(group.iter().map(|(key, _)| key.as_str()))
    }

    /// How many keys it puts in a call.
    pub fn key_count(&self) -> usize {
        match self {
            Self::One(..) => 1,
            Self::Group(group, _) => group.len(),
        }
    }

    /// The key that places it on a Cluster (a group's keys share a slot).
    pub fn first_key(&self) -> &'a str {
        self.keys().next().unwrap_or("")
    }
}

/// What a batched call answered for one [`Item`].
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// For [`Item::One`].
    One(Grant),
    /// For [`Item::Group`].
    Group(GroupGrant),
    /// The store could not decide this item (its key holds a value the
    /// store did not write); the call's other items were decided.
    Refused,
}

impl Answer {
    /// The grant of an [`Item::One`].
    ///
    /// # Errors
    /// [`RedisCallError::Refused`] for a refused item,
    /// [`RedisCallError::BadReply`] for a group's answer.
    pub fn one(self) -> Result<Grant, RedisCallError> {
        match self {
            Self::One(grant) => Ok(grant),
            Self::Refused => Err(RedisCallError::Refused),
            Self::Group(_) => Err(RedisCallError::BadReply),
        }
    }

    /// The grant of an [`Item::Group`].
    ///
    /// # Errors
    /// As [`Answer::one`], for a single bucket's answer.
    pub fn group(self) -> Result<GroupGrant, RedisCallError> {
        match self {
            Self::Group(grant) => Ok(grant),
            Self::Refused => Err(RedisCallError::Refused),
            Self::One(_) => Err(RedisCallError::BadReply),
        }
    }
}

/// What the coalescer needs below it: several decisions in one atomic call.
pub trait BatchStore: Clone + Unpin + 'static {
    /// The bound on one call.
    fn timeout(&self) -> Duration;

    /// Decides every item of `batch` in one atomic call, with one reading
    /// of the store's clock; the answers come in the same order. On a
    /// Redis Cluster every key must be in one slot.
    ///
    /// # Errors
    /// [`RedisCallError`] when the call failed; no answer is known then.
    fn take_batch(
        &self,
        batch: &[Item<'_>],
    ) -> impl Future<Output = Result<Vec<Answer>, RedisCallError>>;
}

impl BatchStore for RedisBucket {
    fn timeout(&self) -> Duration {
        RedisBucket::timeout(self)
    }

    fn take_batch(
        &self,
        batch: &[Item<'_>],
    ) -> impl Future<Output = Result<Vec<Answer>, RedisCallError>> {
        RedisBucket::take_batch(self, batch)
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! An in-memory [`SharedStore`] for tests.

    use std::collections::{HashMap, VecDeque};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use redis::{ErrorKind, RedisError, ServerErrorKind};

    use super::{Answer, BatchStore, Item, SharedStore};
    use crate::breaker::BreakerGate;
    use crate::bucket::decision::{Ask, BucketSpec, Grant, GroupGrant, GroupLimit};
    use crate::bucket::local::LocalBuckets;
    use crate::bucket::tokens::TokenState;
    use crate::clock::SharedClock;
    use crate::redis_client::RedisCallError;

    /// What the next call runs into.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Fault {
        /// It answers after this long (a timeout when that is the
        /// store's timeout or more).
        Slow(Duration),
        /// The connection drops after the script ran: the tokens are
        /// taken, the caller gets an error.
        DroppedAfter,
        /// The connection drops before the script runs.
        Dropped,
        /// The server does not know the script.
        NoScript,
        /// The script fails for what this call carries (nothing taken).
        ScriptError,
    }

    /// The state every clone shares.
    struct Inner {
        buckets: HashMap<String, TokenState>,
        faults: VecDeque<Fault>,
        /// Every call: its keys with what was asked of each.
        batches: Vec<Vec<(String, Ask)>>,
        /// Keys holding a value the script did not write: refused.
        poisoned: std::collections::HashSet<String>,
    }

    /// Buckets in memory, on `clock`; faults are queued per call; each
    /// call's outcome goes to `gate`, as the real store's does.
    #[derive(Clone)]
    pub(crate) struct FakeStore {
        inner: Arc<Mutex<Inner>>,
        /// Group decisions' limits.
        groups: Arc<LocalBuckets>,
        clock: SharedClock,
        timeout: Duration,
        gate: Arc<BreakerGate>,
    }

    impl FakeStore {
        /// An empty store whose calls are bounded by `timeout`.
        pub(crate) fn new(clock: SharedClock, timeout: Duration, gate: Arc<BreakerGate>) -> Self {
            Self {
                groups: Arc::new(LocalBuckets::new(1024, clock.clone())),
                inner: Arc::new(Mutex::new(Inner {
                    buckets: HashMap::new(),
                    faults: VecDeque::new(),
                    batches: Vec::new(),
                    poisoned: Default::default(),
                })),
                clock,
                timeout,
                gate,
            }
        }

        /// Queues `fault` for the next call without one.
        pub(crate) fn fail_next(&self, fault: Fault) {
            self.lock().faults.push_back(fault);
        }

        /// Makes `key` hold a value the script did not write, so every
        /// decision on it is refused.
        pub(crate) fn poison(&self, key: &str) {
            self.lock().poisoned.insert(key.to_owned());
        }

        /// Every key asked for so far, with what was asked, in order.
        pub(crate) fn calls(&self) -> Vec<(String, Ask)> {
            self.lock().batches.iter().flatten().cloned().collect()
        }

        /// How many keys each call carried, in order.
        pub(crate) fn batch_sizes(&self) -> Vec<usize> {
            self.lock().batches.iter().map(Vec::len).collect()
        }

        /// The keys of each call, in order.
        pub(crate) fn batches(&self) -> Vec<Vec<String>> {
            self.lock()
                .batches
                .iter()
                .map(|b| b.iter().map(|(k, _)| k.clone()).collect())
                .collect()
        }

        /// Tokens `key`'s bucket holds now, when it exists.
        pub(crate) fn tokens(&self, key: &str, spec: &BucketSpec) -> Option<f64> {
            let now = self.clock.now_ms();
            self.lock().buckets.get(key).map(|b| b.available(spec, now))
        }

        fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
            self.inner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }

        fn grant(&self, key: &str, spec: &BucketSpec, ask: Ask) -> Grant {
            let now = self.clock.now_ms();
            let mut inner = self.lock();
            let bucket = inner
                .buckets
                .entry(key.to_owned())
                .or_insert_with(|| TokenState::full(spec, now));
            match ask.charged() {
                Some(amount) => Grant {
                    granted: ask.want,
                    decision: bucket.charge(spec, amount, now),
                    block_ms: 0,
                },
                None => bucket.grant(spec, ask, now),
            }
        }

        /// A charge of `ask` to every limit of `group`: a bucket in the map
        /// single takes use (in Redis one key, whichever path wrote it), a
        /// quota with the group arithmetic.
        fn charge(&self, group: &[(String, GroupLimit)], ask: Ask) -> GroupGrant {
            let decisions = group
                .iter()
                .map(|(key, limit)| match limit {
                    GroupLimit::Bucket(spec) => self.grant(key, spec, ask).decision,
                    GroupLimit::Quota { .. } | GroupLimit::Slots { .. } => {
                        let amount = ask.charged().unwrap_or(0);
                        self.groups.charge_group(&[(key.clone(), *limit)], amount)[0]
                    }
                })
                .collect();
            GroupGrant {
                granted: ask.want,
                decisions,
                block_ms: 0,
            }
        }
    }

    impl SharedStore for FakeStore {
        fn timeout(&self) -> Duration {
            self.timeout
        }

        async fn take(
            &self,
            key: &str,
            spec: &BucketSpec,
            ask: Ask,
        ) -> Result<Grant, RedisCallError> {
            self.reported(Item::One(key, *spec, ask)).await?.one()
        }

        async fn take_group(
            &self,
            group: &[(String, GroupLimit)],
            ask: Ask,
        ) -> Result<GroupGrant, RedisCallError> {
            self.reported(Item::Group(group, ask)).await?.group()
        }
    }

    impl BatchStore for FakeStore {
        fn timeout(&self) -> Duration {
            self.timeout
        }

        async fn take_batch(&self, batch: &[Item<'_>]) -> Result<Vec<Answer>, RedisCallError> {
            let result = self.call(batch).await;
            self.tell_gate(&result);
            result
        }
    }

    impl FakeStore {
        /// One call of `item` alone, its outcome told to the breaker.
        async fn reported(&self, item: Item<'_>) -> Result<Answer, RedisCallError> {
            let result = self.call(&[item]).await;
            self.tell_gate(&result);
            result.and_then(|mut answers| answers.pop().ok_or(RedisCallError::BadReply))
        }

        /// Tells the breaker how a call went, as the real store does: a
        /// refusal is not a failure of the store.
        fn tell_gate<T>(&self, result: &Result<T, RedisCallError>) {
            match result {
                Ok(_) => self.gate.success(),
                Err(e) if e.is_refusal() => {}
                Err(_) => self.gate.failure(),
            }
        }

        /// What the script answers for `item`: refused when one of its
        /// keys is poisoned.
        fn answer(&self, item: &Item<'_>) -> Answer {
            let poisoned = |key: &str| self.lock().poisoned.contains(key);
            let refused = match *item {
                Item::One(key, ..) => poisoned(key),
                Item::Group(group, _) => group.iter().any(|(key, _)| poisoned(key)),
            };
            if refused {
                return Answer::Refused;
            }
            match *item {
                Item::One(key, spec, ask) => Answer::One(self.grant(key, &spec, ask)),
                // The script's group arithmetic is the local limiter's.
                Item::Group(group, ask) if ask.charged().is_some() => {
                    Answer::Group(self.charge(group, ask))
                }
                Item::Group(group, ask) => Answer::Group(self.groups.take_group(group, ask)),
            }
        }
    }

    impl FakeStore {
        /// One call for `batch`, with the next fault.
        async fn call(&self, batch: &[Item<'_>]) -> Result<Vec<Answer>, RedisCallError> {
            let fault = {
                let mut inner = self.lock();
                let keys = batch.iter().flat_map(|item| match *item {
                    Item::One(key, _, ask) => vec![(key.to_owned(), ask)],
                    Item::Group(group, ask) => {
                        group.iter().map(|(key, _)| (key.clone(), ask)).collect()
                    }
                });
                inner.batches.push(keys.collect());
                inner.faults.pop_front()
            };
            let grant_all = || batch.iter().map(|item| self.answer(item)).collect();
            match fault {
                None => Ok(grant_all()),
                Some(Fault::Slow(delay)) if delay >= self.timeout => {
                    tokio::time::sleep(self.timeout).await;
                    Err(RedisCallError::Timeout)
                }
                Some(Fault::Slow(delay)) => {
                    tokio::time::sleep(delay).await;
                    Ok(grant_all())
                }
                Some(Fault::DroppedAfter) => {
                    let _: Vec<Answer> = grant_all();
                    Err(dropped())
                }
                Some(Fault::Dropped) => Err(dropped()),
                Some(Fault::NoScript) => Err(RedisCallError::Redis(RedisError::from((
                    ErrorKind::Server(ServerErrorKind::NoScript),
                    "NOSCRIPT No matching script",
                )))),
                Some(Fault::ScriptError) => Err(RedisCallError::Redis(RedisError::from((
                    ErrorKind::Server(ServerErrorKind::ResponseError),
                    "ERR Error running script",
                )))),
            }
        }
    }

    /// A connection that broke mid-call.
    fn dropped() -> RedisCallError {
        RedisCallError::Redis(RedisError::from((ErrorKind::Io, "connection dropped")))
    }
}
