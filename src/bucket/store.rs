//! The seam under the limiter: the store of buckets shared by every gateway.
//!
//! Owns [`SharedStore`], what the [`super::Limiter`] needs of it: one atomic
//! take per call, bounded by the store's own timeout. [`RedisBucket`] is
//! the implementation in production; tests use an in-memory fake
//! (`store::fake`, test builds only) that follows the script's arithmetic
//! on an injected clock and can be slow, time out, drop a connection
//! mid-call or answer `NOSCRIPT`, so the limiter's order, single-flight
//! lease fetches and background top-ups are tested on tokio's paused time.

use std::time::Duration;

use super::decision::{Ask, BucketSpec, Grant};
use super::redis::RedisBucket;
use crate::redis_client::RedisCallError;

/// A store of token buckets shared by every gateway instance.
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
}

impl SharedStore for RedisBucket {
    fn timeout(&self) -> Duration {
        RedisBucket::timeout(self)
    }

    fn take(
        &self,
        key: &str,
        spec: &BucketSpec,
        ask: Ask,
    ) -> impl Future<Output = Result<Grant, RedisCallError>> {
        RedisBucket::take(self, key, spec, ask)
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! An in-memory [`SharedStore`] for tests.

    use std::collections::{HashMap, VecDeque};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use redis::{ErrorKind, RedisError, ServerErrorKind};

    use super::SharedStore;
    use crate::bucket::decision::{Ask, BucketSpec, Grant};
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
    }

    /// The state every clone shares.
    struct Inner {
        buckets: HashMap<String, TokenState>,
        faults: VecDeque<Fault>,
        calls: Vec<(String, Ask)>,
    }

    /// Buckets in memory, on `clock`; faults are queued per call.
    #[derive(Clone)]
    pub(crate) struct FakeStore {
        inner: Arc<Mutex<Inner>>,
        clock: SharedClock,
        timeout: Duration,
    }

    impl FakeStore {
        /// An empty store whose calls are bounded by `timeout`.
        pub(crate) fn new(clock: SharedClock, timeout: Duration) -> Self {
            Self {
                inner: Arc::new(Mutex::new(Inner {
                    buckets: HashMap::new(),
                    faults: VecDeque::new(),
                    calls: Vec::new(),
                })),
                clock,
                timeout,
            }
        }

        /// Queues `fault` for the next call without one.
        pub(crate) fn fail_next(&self, fault: Fault) {
            self.lock().faults.push_back(fault);
        }

        /// Every call so far: the key and what was asked.
        pub(crate) fn calls(&self) -> Vec<(String, Ask)> {
            self.lock().calls.clone()
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
            bucket.grant(spec, ask, now)
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
            let fault = {
                let mut inner = self.lock();
                inner.calls.push((key.to_owned(), ask));
                inner.faults.pop_front()
            };
            match fault {
                None => Ok(self.grant(key, spec, ask)),
                Some(Fault::Slow(delay)) if delay >= self.timeout => {
                    tokio::time::sleep(self.timeout).await;
                    Err(RedisCallError::Timeout)
                }
                Some(Fault::Slow(delay)) => {
                    tokio::time::sleep(delay).await;
                    Ok(self.grant(key, spec, ask))
                }
                Some(Fault::DroppedAfter) => {
                    self.grant(key, spec, ask);
                    Err(dropped())
                }
                Some(Fault::Dropped) => Err(dropped()),
                Some(Fault::NoScript) => Err(RedisCallError::Redis(RedisError::from((
                    ErrorKind::Server(ServerErrorKind::NoScript),
                    "NOSCRIPT No matching script",
                )))),
            }
        }
    }

    /// A connection that broke mid-call.
    fn dropped() -> RedisCallError {
        RedisCallError::Redis(RedisError::from((ErrorKind::Io, "connection dropped")))
    }
}
