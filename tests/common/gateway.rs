//! Gateways under test in this process: their config, one on free ports
//! in its own thread, and what their admin listeners say (`/ready`,
//! `/metrics`, the admin API, the limit a tenant gets).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use tollgate::app::{self, Listeners};
use tollgate::config;

use super::{client, eventually_timed, header, http_status, raw_http, wait_until};

/// Builds gateway configs for tests; both listeners bind port 0.
#[derive(Clone)]
pub struct GatewayConfig {
    pub redis_url: String,
    /// `redis.cluster_nodes`; non-empty switches to Redis Cluster.
    pub cluster_nodes: Vec<String>,
    /// `redis.timeout_ms`.
    pub redis_timeout_ms: u64,
    /// More `[redis]` keys, one per line.
    pub redis_extra: String,
    pub rules_file: PathBuf,
    /// `rules.database_url`; empty = file mode.
    pub database_url: String,
    /// More `[rules]` keys, one per line.
    pub rules_extra: String,
    /// `admin.token`.
    pub admin_token: String,
    /// `admin.read_token`.
    pub admin_read_token: String,
    /// More `[upstream]` keys, one per line.
    pub upstream_extra: String,
    /// More sections (e.g. `[default_rule]`).
    pub extra: String,
    pub routes: String,
    /// `server.workers`.
    pub workers: u32,
    /// `upstream.timeout_ms`.
    pub upstream_timeout_ms: u64,
}

impl GatewayConfig {
    /// One catch-all route `api` to `upstream`, default rule 2 tokens at 1/s.
    pub fn new(redis_url: &str, rules_file: PathBuf, upstream: &str) -> Self {
        Self {
            redis_url: redis_url.to_owned(),
            cluster_nodes: Vec::new(),
            redis_timeout_ms: 1000,
            redis_extra: String::new(),
            rules_file,
            database_url: String::new(),
            rules_extra: String::new(),
            admin_token: String::new(),
            admin_read_token: String::new(),
            upstream_extra: String::new(),
            extra: "[default_rule]\ncapacity = 2\nrefill_per_second = 1\n".to_owned(),
            routes: format!(
                "[[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"{upstream}\"\n"
            ),
            workers: 2,
            upstream_timeout_ms: 1000,
        }
    }

    pub fn toml(&self) -> String {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nworkers = {}\n\
             shutdown_timeout_seconds = 1\n\
             [redis]\nurl = \"{}\"\ncluster_nodes = {:?}\ntimeout_ms = {}\n{}\n\
             [rules]\nfile = \"{}\"\ndatabase_url = \"{}\"\n{}\n\
             [admin]\ntoken = \"{}\"\nread_token = \"{}\"\n\
             [upstream]\nconnect_timeout_ms = 500\ntimeout_ms = {}\n{}\n\
             {}\n{}",
            self.workers,
            self.redis_url,
            self.cluster_nodes,
            self.redis_timeout_ms,
            self.redis_extra,
            self.rules_file.display(),
            self.database_url,
            self.rules_extra,
            self.admin_token,
            self.admin_read_token,
            self.upstream_timeout_ms,
            self.upstream_extra,
            self.extra,
            self.routes
        )
    }
}

/// A gateway running in its own thread and actix System; stopped on drop.
pub struct Gateway {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    /// Envoy's rate limit service, when `[rls] listen` is set.
    pub rls: Option<SocketAddr>,
    /// The HTTP check, when `[check] listen` is set.
    pub check: Option<SocketAddr>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Gateway {
    pub fn start(config: &GatewayConfig) -> Self {
        Self::start_toml(&config.toml())
    }

    pub fn start_toml(toml: &str) -> Self {
        // Gateways in one test process would share the default
        // <hostname>-<pid> id; give each its own, as separate hosts have.
        static N: AtomicU32 = AtomicU32::new(0);
        let id = format!(
            "test-gw-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let env = BTreeMap::from([("TOLLGATE__INSTANCE__ID".to_owned(), id)]);
        let config = config::load(toml, &env)
            .unwrap_or_else(|e| panic!("test config is invalid: {e}\n{toml}"));
        app::check(&config).unwrap_or_else(|p| panic!("test rules are invalid: {p:?}"));
        let listeners = Listeners::bind(&config).expect("ports for the gateway");
        let addr = listeners.proxy_addr().unwrap();
        let admin = listeners.admin_addr().unwrap();
        let (rls, check) = (listeners.rls_addr(), listeners.check_addr());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                app::run(config, listeners, async {
                    let _ = stopped.await;
                })
                .await
                .expect("gateway runs");
            });
        });
        let gateway = Self {
            addr,
            admin,
            rls,
            check,
            stop: Some(stop),
            thread: Some(thread),
        };
        // The sockets accept at once; /ready answers 200 only once startup
        // (migrations, first rule load) is done, the servers run and every
        // worker's Redis connection is warm (or Redis is known down).
        assert!(
            wait_until(Duration::from_secs(15), || http_status(admin, "/ready")
                == Some(200)),
            "the gateway was not ready within 15 s"
        );
        gateway
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Sends the shutdown signal without waiting for the gateway to stop
    /// (dropping it waits).
    pub fn begin_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The `X-RateLimit-Limit` a tenant gets on `path`.
pub async fn limit_of(gw: &Gateway, tenant: &str) -> Option<String> {
    let res = client()
        .get(gw.url("/limit"))
        .insert_header(("x-api-key", tenant))
        .send()
        .await
        .expect("gateway answers");
    header(&res, "x-ratelimit-limit")
}

/// Polls until `tenant`'s limit on `gw` is `expected`; returns the wait in
/// ms, or `None` after `within`.
pub async fn wait_for_limit(
    gw: &Gateway,
    tenant: &str,
    expected: &str,
    within: Duration,
) -> Option<u64> {
    eventually_timed(within, || async {
        limit_of(gw, tenant).await.as_deref() == Some(expected)
    })
    .await
    .map(|waited| waited.as_millis() as u64)
}

/// Fails unless `tenant`'s limit on `gw` becomes `expected` within
/// `within`.
pub async fn assert_limit_becomes(gw: &Gateway, tenant: &str, expected: &str, within: Duration) {
    if wait_for_limit(gw, tenant, expected, within).await.is_none() {
        panic!(
            "{tenant}'s limit on {} did not become {expected} within {within:?}: it is {:?}",
            gw.addr,
            limit_of(gw, tenant).await
        );
    }
}

/// Sends an admin request; returns status and JSON body (`Null` when empty).
pub async fn admin(
    gw: &Gateway,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    let method = actix_web::http::Method::from_bytes(method.as_bytes()).unwrap();
    let mut req = client().request(method, gw.admin_url(path));
    if let Some(token) = token {
        req = req.insert_header(("authorization", format!("Bearer {token}")));
    }
    let mut res = match body {
        Some(b) => {
            req.insert_header(("content-type", "application/json"))
                .send_body(b.to_owned())
                .await
        }
        None => req.send().await,
    }
    .expect("admin listener answers");
    let bytes = res.body().await.unwrap();
    let json = if bytes.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap_or_else(|_| {
            serde_json::Value::String(String::from_utf8_lossy(&bytes).into_owned())
        })
    };
    (res.status().as_u16(), json)
}

/// `field` of each object in the JSON array `list` (e.g. the rules an
/// admin listing holds).
pub fn each<'a>(list: &'a serde_json::Value, field: &str) -> Vec<&'a serde_json::Value> {
    let list = list
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {list}"));
    list.iter().map(|item| &item[field]).collect()
}

/// `GET /ready` as JSON.
pub async fn ready(gw: &Gateway) -> serde_json::Value {
    admin(gw, "GET", "/ready", None, None).await.1
}

/// The value of one series in `/metrics`, e.g.
/// `tollgate_rule_reloads_total{result="error"}`; `None` when it is not
/// exported (a misspelt name is never 0).
pub async fn metric(gw: &Gateway, series: &str) -> Option<f64> {
    let (_, text) = admin(gw, "GET", "/metrics", None, None).await;
    series_value(text.as_str().unwrap_or_default(), series)
}

/// The value of `series` in a `/metrics` text; `None` when the text does not hold it.
pub fn series_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// The gateway's `/metrics` text (a blocking read).
pub fn metrics_text(gw: &Gateway) -> String {
    raw_http(gw.admin, "GET /metrics HTTP/1.1\r\nHost: admin\r\n").body
}
