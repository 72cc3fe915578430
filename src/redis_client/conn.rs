//! A gateway's calls to Redis: bounded, routed, retried where that is safe.
//!
//! Owns [`RedisConn`]: per primary of the current layout, the shared
//! connection and the lines (`line`) that carry its calls; which primary a
//! call goes to ([`Route`]); the timeout around every call; one more
//! attempt on a connection found dropped, and on the primary a `MOVED`
//! reply names; `NOSCRIPT` answered by loading the script; and each
//! call's outcome reported to its primary's breaker gate.
//!
//! Invariant: a call is never made again after its timeout expired.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, ErrorKind, FromRedisValue, RedisResult, Script, ServerErrorKind};

use super::{Layout, LuaScript, NodeAddr, RedisCallError, Reply, ScriptCall, Shared, line};

/// Which primary a call goes to.
#[derive(Debug, Clone, Copy)]
pub enum Route<'a> {
    /// The one serving this key.
    Key(&'a str),
    /// The one at this address.
    Node(&'a NodeAddr),
}

/// How one primary is reached: the shared (multiplexed) connection, and
/// the lines that carry script calls one at a time.
#[derive(Clone)]
struct Node {
    /// Every kind of call; script calls when no line is idle.
    shared: ConnectionManager,
    /// Script calls.
    lines: Arc<line::Lines>,
}

/// One connection per primary of one layout.
#[derive(Default)]
struct Conns {
    /// The layout they were made for.
    generation: u64,
    /// In the layout's shard order.
    by_shard: Vec<(NodeAddr, Node)>,
}

/// Connections (shared by clones) to every primary, usable for bounded
/// calls.
#[derive(Clone)]
pub struct RedisConn {
    /// The gateway's topology and endpoints.
    shared: Arc<Shared>,
    /// The connections for the current layout.
    conns: Arc<ArcSwap<Conns>>,
    /// Held while the connections are rebuilt for a new layout.
    rebuild: Arc<Mutex<()>>,
    /// Whether outcomes go to the primaries' breakers.
    reports: bool,
}

/// An `EVALSHA` of `script` with its `keys` keys still to be written, and
/// room for them and `args` arguments more (about 16 bytes each: a key
/// `rl:{tenant}:route` or a number); [`RedisConn::invoke`] sends it.
pub fn evalsha(script: &Script, keys: usize, args: usize) -> Cmd {
    let mut eval = Cmd::with_capacity(3 + keys + args, 64 + 16 * (keys + args));
    eval.arg("EVALSHA").arg(script.get_hash()).arg(keys);
    eval
}

impl RedisConn {
    /// Connections over `shared`, reporting outcomes to the breakers when
    /// `reports`; none is opened before its first call.
    pub(super) fn new(shared: Arc<Shared>, reports: bool) -> Self {
        Self {
            shared,
            conns: Arc::new(ArcSwap::from_pointee(Conns::default())),
            rebuild: Arc::new(Mutex::new(())),
            reports,
        }
    }

    /// Runs `eval`, an `EVALSHA` of `script`, on `route`'s primary,
    /// bounded by `timeout`; a `NOSCRIPT` reply loads `script` there and
    /// repeats the call once.
    ///
    /// # Errors
    /// [`RedisCallError`] on timeout, connection or server failure.
    pub async fn invoke<T: FromRedisValue>(
        &self,
        route: Route<'_>,
        script: &Script,
        eval: &Cmd,
        timeout: Duration,
    ) -> Result<T, RedisCallError> {
        self.call(route, timeout, |node| evaluate(node.shared, script, eval))
            .await
    }

    /// Runs one command on `route`'s primary, bounded by `timeout`.
    ///
    /// # Errors
    /// [`RedisCallError`] on timeout, connection or server failure.
    pub async fn query<T: FromRedisValue>(
        &self,
        route: Route<'_>,
        cmd: &Cmd,
        timeout: Duration,
    ) -> Result<T, RedisCallError> {
        self.call(route, timeout, |node| async move {
            let mut shared = node.shared;
            cmd.query_async(&mut shared).await
        })
        .await
    }

    /// Calls `script` with `call`'s keys and arguments on `route`'s
    /// primary, bounded by `timeout`, and reads the reply with `read`: on
    /// one of this connection's own lines to that primary when one is
    /// idle, else on the shared connection. A `NOSCRIPT` reply loads the
    /// script there and repeats the call once.
    ///
    /// # Errors
    /// [`RedisCallError`] on timeout, connection or server failure;
    /// [`RedisCallError::BadReply`] when `read` finds nothing in the reply.
    pub async fn script_call<T>(
        &self,
        route: Route<'_>,
        script: &LuaScript,
        call: &ScriptCall,
        timeout: Duration,
        read: impl Fn(Reply<'_>) -> Option<T>,
    ) -> Result<T, RedisCallError> {
        let read = &read;
        self.call(route, timeout, |node| async move {
            if let Some(result) = node.lines.call(script, call, read).await {
                return result;
            }
            let eval = call.to_cmd(script);
            let value: redis::Value = evaluate(node.shared, script.script(), &eval).await?;
            Ok(read(Reply::of_value(&value)))
        })
        .await?
        .ok_or(RedisCallError::BadReply)
    }

    /// How many of this connection's own lines are open to `addr`.
    pub fn lines_open(&self, addr: &NodeAddr) -> usize {
        self.conns
            .load()
            .by_shard
            .iter()
            .find(|(a, _)| a == addr)
            .map_or(0, |(_, node)| node.lines.open())
    }

    /// Runs `cmd` on every primary of the current layout, each bounded by
    /// `timeout`.
    ///
    /// # Errors
    /// The first failure; [`RedisCallError::NotConnected`] when no primary
    /// is known yet.
    pub async fn query_each(&self, cmd: &Cmd, timeout: Duration) -> Result<(), RedisCallError> {
        let layout = self.shared.topology.layout();
        if layout.shards.is_empty() {
            return Err(RedisCallError::NotConnected);
        }
        for shard in &layout.shards {
            self.query::<redis::Value>(Route::Node(&shard.addr), cmd, timeout)
                .await?;
        }
        Ok(())
    }

    /// Makes `call` on `route`'s primary, again once when it found the
    /// connection dropped, within `timeout`; reports the outcome.
    async fn call<T, F: Future<Output = RedisResult<T>>>(
        &self,
        route: Route<'_>,
        timeout: Duration,
        call: impl Fn(Node) -> F,
    ) -> Result<T, RedisCallError> {
        let topology = &self.shared.topology;
        let layout = topology.layout();
        let index = match route {
            Route::Key(key) => layout.shard_of(key.as_bytes()),
            Route::Node(addr) => layout.shard_at(addr),
        };
        let Some(index) = index else {
            topology.suspect();
            return Err(RedisCallError::NotConnected);
        };
        // A MOVED reply names the primary that serves the key's slot now:
        // one more attempt there when the layout knows it (the script
        // never ran on the first). A call meant for one node (a probe) is
        // never sent to another.
        let tried = std::cell::Cell::new(index);
        let attempts = async {
            let conn = self.connection(&layout, index);
            let first = again_if_dropped(|| call(conn.clone())).await;
            match moved_to(&first, &layout, index) {
                Some(other) if matches!(route, Route::Key(_)) => {
                    tried.set(other);
                    let conn = self.connection(&layout, other);
                    again_if_dropped(|| call(conn.clone())).await
                }
                _ => first,
            }
        };
        let result = match tokio::time::timeout(timeout, attempts).await {
            Ok(result) => result.map_err(RedisCallError::Redis),
            Err(_) => Err(RedisCallError::Timeout),
        };
        // Reported to the primary that was asked last.
        let index = tried.get();
        if let Err(e) = &result
            && e.suggests_new_layout()
        {
            topology.suspect();
        }
        if self.reports {
            let gate = &layout.shards[index].gate;
            match &result {
                Ok(_) => gate.success(),
                // Redis answered: it is not failing.
                Err(e) if e.is_redirection() || e.is_refusal() => {}
                Err(_) => gate.failure(),
            }
        }
        result
    }

    /// The connection to shard `index` of `layout`, rebuilding this
    /// connection set when the layout is newer than it (connections to
    /// primaries still in the layout are kept). A call that read an older
    /// layout than the set's finds its primary by address.
    fn connection(&self, layout: &Layout, index: usize) -> Node {
        let addr = &layout.shards[index].addr;
        let by_addr = |conns: &Conns| {
            conns
                .by_shard
                .iter()
                .find(|(a, _)| a == addr)
                .map(|(_, conn)| conn.clone())
        };
        let current = self.conns.load();
        if current.generation == layout.generation
            && let Some((_, conn)) = current.by_shard.get(index)
        {
            return conn.clone();
        }
        if current.generation > layout.generation
            && let Some(conn) = by_addr(&current)
        {
            return conn;
        }
        drop(current);
        let _held = self.rebuild.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.conns.load_full();
        if current.generation < layout.generation {
            let by_shard = layout
                .shards
                .iter()
                .map(|shard| {
                    let conn = current
                        .by_shard
                        .iter()
                        .find(|(a, _)| a == &shard.addr)
                        .map_or_else(|| self.open(&shard.addr), |(_, conn)| conn.clone());
                    (shard.addr.clone(), conn)
                })
                .collect();
            self.conns.store(Arc::new(Conns {
                generation: layout.generation,
                by_shard,
            }));
        }
        by_addr(&self.conns.load()).unwrap_or_else(|| self.open(addr))
    }

    /// A connection to `addr`, opened on first use and reopened in the
    /// background after failures, and its lines (none open yet).
    fn open(&self, addr: &NodeAddr) -> Node {
        let shared = &self.shared;
        Node {
            shared: self.open_shared(addr),
            lines: line::Lines::new(
                shared
                    .endpoints
                    .line(addr, shared.db, shared.connect_timeout),
            ),
        }
    }

    /// The shared connection to `addr`.
    fn open_shared(&self, addr: &NodeAddr) -> ConnectionManager {
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(200))
            .set_connection_timeout(Some(self.shared.connect_timeout))
            // Every call is bounded by its caller's timeout already; a
            // second timer per call would cost another timer
            // registration, often a wake-up of the worker's event loop
            // with it.
            .set_response_timeout(None);
        // unwrap: building a client depends on the TLS material alone, not
        // on the address, and `Endpoints::load` built one with it; a lazy
        // manager only fails for push/resubscribe settings, never set here.
        self.shared
            .endpoints
            .data_client(addr, self.shared.db)
            .and_then(|client| client.get_connection_manager_lazy(config))
            .expect("a client for a checked endpoint")
    }
}

/// Runs `eval`, an `EVALSHA` of `script`, on `shared`; a `NOSCRIPT` reply
/// loads `script` there and runs it once more.
async fn evaluate<T: FromRedisValue>(
    mut shared: ConnectionManager,
    script: &Script,
    eval: &Cmd,
) -> RedisResult<T> {
    match eval.query_async(&mut shared).await {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script.load_async(&mut shared).await?;
            eval.query_async(&mut shared).await
        }
        result => result,
    }
}

/// Makes `call`, and once more when the first attempt found the connection
/// dropped: the connection manager reconnects on that error, so the first
/// call after an outage (or a server restart) reaches the new connection
/// instead of failing. A timed-out attempt is never repeated. A connection
/// that drops after the call was written may have run it: the repeat then
/// charges that call's tokens twice (fewer admissions, never more). The
/// caller's timeout bounds both attempts.
async fn again_if_dropped<T, F: Future<Output = RedisResult<T>>>(
    call: impl Fn() -> F,
) -> RedisResult<T> {
    match call().await {
        Err(e) if e.is_connection_dropped() && !e.is_timeout() => call().await,
        other => other,
    }
}

/// The shard of `layout`, other than `asked` (the one that replied), that
/// a `MOVED` reply in `result` names; an empty host is `asked`'s host.
fn moved_to<T>(result: &RedisResult<T>, layout: &Layout, asked: usize) -> Option<usize> {
    let Err(e) = result else {
        return None;
    };
    if e.kind() != ErrorKind::Server(ServerErrorKind::Moved) {
        return None;
    }
    let (addr, _slot) = e.redirect_node()?;
    let (host, port) = addr.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let host = if host.is_empty() {
        &*layout.shards[asked].addr.host
    } else {
        host
    };
    layout
        .shard_at(&NodeAddr::new(host, port))
        .filter(|&other| other != asked)
}
