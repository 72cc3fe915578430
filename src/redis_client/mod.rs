//! Connections to Redis (one server, a primary followed through Sentinel,
//! or a Redis Cluster) and bounded calls.
//!
//! Owns how tollgate reaches Redis. [`RedisConnector`] reads the target,
//! TLS material and credentials once (`node`) and holds the
//! [`Topology`]: which primary serves each key, each with its own
//! breaker gate, kept current by a watcher actor for a Cluster or
//! Sentinel (`watch`, `discover`). [`RedisConnector::connect`] hands
//! out a [`RedisConn`] (`conn`): per primary, one lazily opened,
//! self-reconnecting shared connection, and lines of tollgate's own that
//! carry script calls one at a time (`line`), all driven by the calling
//! thread's runtime (each proxy worker gets its own, so a reply wakes the
//! worker that asked).
//!
//! A call goes to the primary serving its key (on a Cluster, the owner of
//! its slot, from tollgate's own slot table: a node that fails holds up
//! only the calls for its own slots). Every call is bounded by a timeout
//! and abandoned, never replayed, when it expires. Scripts are sent by SHA
//! (`EVALSHA`); a `NOSCRIPT` reply (a restarted or newly promoted server)
//! loads the script and repeats the call once; a call that finds its
//! connection dropped (not timed out) is made once more on the reconnected
//! one, within the same timeout. A call answered `MOVED` is made once
//! more on the primary named, when the layout knows it. A lost
//! connection, `MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`, `READONLY` or
//! `LOADING` marks the layout suspect, so it is looked up again within
//! a tick of the watcher (100 ms); a call that still fails is decided
//! locally.
//!
//! Invariants: nothing here waits for Redis to come up; calls fail fast
//! with [`RedisCallError::NotConnected`] until the key's primary is known.

mod conn;
mod discover;
mod error;
mod line;
mod node;
mod script_call;
pub mod topology;
mod watch;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

pub use conn::{RedisConn, Route, evalsha};
pub use error::RedisCallError;
pub use node::{NodeAddr, SetupError};
pub use script_call::{LuaScript, Reply, ScriptCall};
pub use topology::{Health, Layout, Mode, Topology};

use crate::clock::SharedClock;
use crate::config::{RedisSettings, RedisTarget};
use node::Endpoints;

/// What every connection of one gateway shares.
struct Shared {
    /// Which primary serves which key.
    topology: Arc<Topology>,
    /// How servers are reached.
    endpoints: Endpoints,
    /// The database of a single server (0 otherwise).
    db: i64,
    /// Bound on one connection attempt.
    connect_timeout: Duration,
    /// What the watcher follows; `None` for a single server.
    watched: Mutex<Option<watch::Watched>>,
}

/// A parsed Redis target that hands out connections.
#[derive(Clone)]
pub struct RedisConnector {
    /// Shared by every connection handed out.
    shared: Arc<Shared>,
}

impl RedisConnector {
    /// Reads `settings` and the files they name; `None` in local-only
    /// mode. Connects to nothing.
    ///
    /// # Errors
    /// [`SetupError`] when a file cannot be read or used.
    pub fn new(settings: &RedisSettings) -> Result<Option<Self>, SetupError> {
        let Some((endpoints, infos)) = Endpoints::load(settings)? else {
            return Ok(None);
        };
        let addrs: Vec<NodeAddr> = infos.iter().filter_map(node::address).collect();
        let unix = || SetupError {
            key: "redis.url",
            message: "must name a TCP host and port".to_owned(),
        };
        if addrs.len() != infos.len() {
            return Err(unix());
        }
        let (topology, db, watched) = match &settings.target {
            RedisTarget::Single(_) => (
                Topology::single(addrs[0].clone()),
                infos[0].redis_settings().db(),
                None,
            ),
            RedisTarget::Cluster(_) => (
                Topology::new(Mode::Cluster),
                0,
                Some(watch::Watched::Cluster { seeds: addrs }),
            ),
            RedisTarget::Sentinel { master, .. } => (
                Topology::new(Mode::Sentinel),
                0,
                Some(watch::Watched::Sentinel {
                    sentinels: addrs,
                    master: master.clone(),
                }),
            ),
            RedisTarget::LocalOnly => return Ok(None),
        };
        Ok(Some(Self {
            shared: Arc::new(Shared {
                topology: Arc::new(topology),
                endpoints,
                db,
                connect_timeout: settings.connect_timeout,
                watched: Mutex::new(watched),
            }),
        }))
    }

    /// Which primary serves which key, with each one's breaker gate.
    pub fn topology(&self) -> &Arc<Topology> {
        &self.shared.topology
    }

    /// Starts following the deployment's layout (a Cluster's slot owners,
    /// Sentinel's primary) on the current arbiter; nothing for a single
    /// server, or when already started.
    ///
    /// # Errors
    /// When the Sentinel client cannot be built.
    pub fn watch(&self, clock: SharedClock) -> redis::RedisResult<()> {
        let watched = self
            .shared
            .watched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match watched {
            Some(watched) => watch::start(
                self.shared.topology.clone(),
                self.shared.endpoints.clone(),
                watched,
                self.shared.connect_timeout,
                clock,
            ),
            None => Ok(()),
        }
    }

    /// A connection driven by the runtime of the calling thread; its
    /// calls are not reported to the breakers (probes, heartbeats).
    pub fn connect(&self) -> RedisConn {
        self.connection(false)
    }

    /// As [`RedisConnector::connect`], but every call's outcome is
    /// reported to the breaker of the primary it went to (bucket calls).
    pub fn connect_reporting(&self) -> RedisConn {
        self.connection(true)
    }

    fn connection(&self, reports: bool) -> RedisConn {
        RedisConn::new(self.shared.clone(), reports)
    }
}
