//! Checked, typed settings built from the raw file.
//!
//! [`validate`] turns a [`RawConfig`] into a [`Config`], collecting a
//! [`Problem`] for every bad value rather than stopping at the first.

use std::collections::HashSet;
use std::net::{SocketAddr, ToSocketAddrs};
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use actix_web::http::{Method, Uri};

use super::Problem;
use super::raw::{RawConfig, RawLimit, RawRoute};
use super::redact_url;
use crate::key::{RouteId, validate_id};
use crate::path::normalize;

/// The validated gateway configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Listeners and worker threads.
    pub server: ServerSettings,
    /// This instance's identity.
    pub instance: InstanceSettings,
    /// Where bucket state lives.
    pub redis: RedisSettings,
    /// Where rules come from.
    pub rules: RulesSettings,
    /// The limit for (tenant, route) pairs without a rule.
    pub default_rule: LimitSettings,
    /// Shadow mode for the whole gateway: `[limits] shadow`; refusals of
    /// every rule are forwarded and counted, never answered with 429.
    pub shadow: bool,
    /// Admin API protection.
    pub admin: AdminSettings,
    /// When to stop calling a failing Redis.
    pub breaker: BreakerSettings,
    /// The local limiter.
    pub fallback: FallbackSettings,
    /// Batched token leases for hot keys.
    pub lease: LeaseSettings,
    /// Label cardinality.
    pub metrics: MetricsSettings,
    /// Where region files live (used when `instance.region` is set).
    pub regions_dir: PathBuf,
    /// Moving shares between regions with traffic.
    pub rebalancer: RebalancerSettings,
    /// Upstream connection behaviour.
    pub upstream: UpstreamSettings,
    /// Deadlines for the proxy's clients.
    pub client: ClientSettings,
    /// Log verbosity.
    pub log: LogSettings,
    /// The route table, in file order.
    pub routes: Vec<RouteSpec>,
}

impl Config {
    /// Why a rule for `route` would never apply here: `None` when the route
    /// table has that route, else a message listing the routes it has.
    pub fn unknown_route(&self, route: &str) -> Option<String> {
        if self.routes.iter().any(|r| r.id.as_str() == route) {
            return None;
        }
        let known: Vec<&str> = self.routes.iter().map(|r| r.id.as_str()).collect();
        Some(format!(
            "no route {route:?} in this gateway's configuration (routes: {})",
            known.join(", ")
        ))
    }
}

/// `[server]`.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    /// Proxy listener address.
    pub listen: SocketAddr,
    /// Admin listener address (`/live`, `/ready`, `/metrics`, `/admin/*`).
    pub admin_listen: SocketAddr,
    /// Proxy worker threads (≥ 1; a configured 0 became the core count).
    pub workers: usize,
    /// How long in-flight requests may run after a shutdown signal.
    pub shutdown_timeout: Duration,
}

/// `[instance]`.
#[derive(Debug, Clone)]
pub struct InstanceSettings {
    /// Unique instance id (default: `<hostname>-<pid>`).
    pub id: String,
    /// Region this instance serves, when regions are used.
    pub region: Option<String>,
    /// Gateway instances assumed live before the first membership reading;
    /// the local fallback divides every limit by the live count.
    pub expected_count: NonZeroU32,
    /// Period of the membership heartbeat; an instance silent for three
    /// periods no longer counts as live.
    pub heartbeat: Duration,
}

/// Which Redis deployment holds bucket state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// No Redis: every decision is local to this instance.
    LocalOnly,
    /// One Redis server.
    Single(String),
    /// A Redis Cluster, reached through these seed URLs.
    Cluster(Vec<String>),
}

/// `[redis]`.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// Where to connect.
    pub target: RedisTarget,
    /// Longest wait for one bucket call before the local fallback decides.
    pub timeout: Duration,
    /// Longest wait for a new connection.
    pub connect_timeout: Duration,
    /// Most decisions one coalesced script call carries.
    pub max_keys_per_call: usize,
}

/// Where rules are loaded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleSource {
    /// A TOML rules file, reloaded when it changes.
    File(PathBuf),
    /// The `rate_limit_rule` table of a PostgreSQL database, followed with
    /// `LISTEN`.
    Database(String),
}

/// `[rules]`.
#[derive(Debug, Clone)]
pub struct RulesSettings {
    /// The rule source.
    pub source: RuleSource,
    /// Period of the full safety-net reload.
    pub refresh: Duration,
    /// How often the rules file is checked for changes.
    pub watch_interval: Duration,
    /// How long a changed rules file must hold still before it is read.
    pub settle: Duration,
    /// Where the last rules loaded from the database are saved, to serve
    /// from when the database is down at start; `None` disables it.
    pub snapshot_file: Option<PathBuf>,
    /// Whether `serve` applies the SQL migrations before loading rules.
    pub migrate_on_start: bool,
}

/// A capacity and refill pair, both > 0 and within `i32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitSettings {
    /// Burst size in tokens.
    pub capacity: NonZeroU32,
    /// Tokens per second.
    pub refill_per_second: NonZeroU32,
}

/// `[breaker]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerSettings {
    /// Consecutive failed calls that open the breaker.
    pub failure_threshold: u32,
    /// Failure ratio over the window (0 < r ≤ 1) that opens the breaker…
    pub failure_ratio: f64,
    /// …once the window holds at least this many calls.
    pub min_calls: u32,
    /// Length of the failure-ratio window.
    pub window: Duration,
    /// Time open before a probe is sent (half-open).
    pub cooldown: Duration,
}

/// `[fallback]`.
#[derive(Debug, Clone, Copy)]
pub struct FallbackSettings {
    /// Most buckets the local limiter tracks before it evicts.
    pub max_keys: usize,
}

/// `[lease]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseSettings {
    /// Whether hot keys may lease tokens in batches at all.
    pub enabled: bool,
    /// How long leased tokens may be spent before they expire.
    pub window: Duration,
    /// Most tokens one lease takes.
    pub max_batch: u32,
    /// Local rate (tokens/s) from which a key leases.
    pub min_rate_per_second: f64,
}

/// `[metrics]`.
#[derive(Debug, Clone, Copy)]
pub struct MetricsSettings {
    /// Most tenants with their own `tenant` label (tenants with an explicit
    /// rule, in sorted order); the rest are `tenant="_other"`.
    pub max_tenant_labels: usize,
}

/// `[rebalancer]`.
#[derive(Debug, Clone, PartialEq)]
pub struct RebalancerSettings {
    /// Whether this instance takes part (one leader acts at a time).
    pub enabled: bool,
    /// Prometheus server whose HTTP API gives per-region demand.
    pub prometheus_url: String,
    /// Time between rounds.
    pub interval: Duration,
    /// Rate window of the demand query.
    pub window: Duration,
    /// Fraction of the way to the demand-proportional target moved per
    /// round (0 < s ≤ 1).
    pub smoothing: f64,
    /// Largest change of any region's share in one round (0 < m ≤ 1).
    pub max_step: f64,
    /// Smallest share any region keeps (0 ≤ f; regions × f ≤ 1).
    pub floor: f64,
}

/// `[admin]`.
#[derive(Debug, Clone)]
pub struct AdminSettings {
    /// Bearer token for admin writes (and reads); `None` disables writes.
    pub token: Option<String>,
    /// Bearer token for admin reads only.
    pub read_token: Option<String>,
}

/// `[upstream]`.
#[derive(Debug, Clone)]
pub struct UpstreamSettings {
    /// Longest wait to open a connection to an upstream (→ 502 when refused,
    /// 504 when it times out).
    pub connect_timeout: Duration,
    /// Longest wait for a free connection plus the upstream's response
    /// head (→ 504).
    pub timeout: Duration,
    /// Upstream connections one proxy worker uses at once (kept alive and
    /// reused; further requests wait for one).
    pub max_connections_per_worker: usize,
    /// Upstream exchanges one tenant may have in flight on one worker;
    /// further requests are refused with 429 before any token is taken.
    pub max_connections_per_tenant: u32,
    /// Upstream exchanges all tenants without a rule for the route may
    /// have in flight together on one worker (so fresh keys cannot take
    /// every connection).
    pub max_connections_without_rule: u32,
    /// Longest time a kept upstream connection may stay idle and still be
    /// used; shorter than the upstreams' own keep-alive timeouts.
    pub idle_timeout: Duration,
}

/// `[client]`: how long the proxy waits for its clients.
#[derive(Debug, Clone, Copy)]
pub struct ClientSettings {
    /// Longest wait for a request's head (line and headers).
    pub header_timeout: Duration,
    /// Request bodies: the pace a client must keep while uploading.
    pub read: Pace,
    /// Responses: the pace a client must keep while downloading.
    pub write: Pace,
}

/// A progress-based deadline's settings: a transfer that waits on its
/// client longer than `timeout` without progress, or moves less than
/// `min_bytes_per_second` on average, is cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    /// Longest wait for the client without progress, and the most credit
    /// fast progress can build up.
    pub timeout: Duration,
    /// Average rate below which the client loses credit; 0 = no minimum.
    pub min_bytes_per_second: u64,
}

/// `[log]`.
#[derive(Debug, Clone)]
pub struct LogSettings {
    /// A `tracing` filter such as `info` or `tollgate=debug,warn`.
    pub level: String,
}

/// One validated `[[routes]]` entry.
#[derive(Debug, Clone)]
pub struct RouteSpec {
    /// Route id, part of bucket keys and metric labels.
    pub id: RouteId,
    /// Accepted methods; empty accepts any method.
    pub methods: Vec<Method>,
    /// Path prefix, matched on whole segments (`/orders` matches `/orders`
    /// and `/orders/7`, not `/orders7`).
    pub path_prefix: String,
    /// Upstream origin, `http://host:port`, without a trailing slash.
    pub upstream_origin: String,
    /// Path prepended to forwarded paths (`""` or `/base`, no trailing slash).
    pub upstream_base_path: String,
    /// Tokens one request on this route takes.
    pub cost: NonZeroU32,
}

/// Collects problems while converting fields.
struct Check {
    problems: Vec<Problem>,
}

impl Check {
    fn bad(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem::new(key, message));
    }

    /// An integer in `min..=max`, or a problem.
    fn range(&mut self, key: &str, value: i64, min: i64, max: i64) -> Option<u64> {
        if (min..=max).contains(&value) {
            u64::try_from(value).ok()
        } else {
            self.bad(
                key,
                format!("must be between {min} and {max}, found {value}"),
            );
            None
        }
    }

    fn millis(&mut self, key: &str, value: i64, max: i64) -> Duration {
        Duration::from_millis(self.range(key, value, 1, max).unwrap_or(1))
    }

    fn seconds(&mut self, key: &str, value: i64, max: i64) -> Duration {
        Duration::from_secs(self.range(key, value, 1, max).unwrap_or(1))
    }

    fn positive_i32(&mut self, key: &str, value: i64) -> NonZeroU32 {
        let v = self.range(key, value, 1, i64::from(i32::MAX)).unwrap_or(1);
        // unwrap: `range` guarantees 1..=i32::MAX, or the fallback 1.
        NonZeroU32::new(u32::try_from(v).unwrap_or(1)).expect("checked non-zero")
    }

    /// A listen address: `ip:port`, or `host:port` with a host name
    /// resolved once, here (the first IPv4 address it has, else its first
    /// IPv6 one: `localhost:8080` listens on 127.0.0.1).
    fn socket(&mut self, key: &str, value: &str) -> SocketAddr {
        match listen_address(value) {
            Ok(addr) => addr,
            Err(message) => {
                self.bad(key, message);
                SocketAddr::from(([127, 0, 0, 1], 0))
            }
        }
    }

    fn limit(&mut self, section: &str, raw: &RawLimit) -> LimitSettings {
        LimitSettings {
            capacity: self.positive_i32(&format!("{section}.capacity"), raw.capacity),
            refill_per_second: self.positive_i32(
                &format!("{section}.refill_per_second"),
                raw.refill_per_second,
            ),
        }
    }
}

/// Resolves a listen address (see `Check::socket`); the message says
/// what is wrong.
fn listen_address(value: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = value.parse() {
        return Ok(addr);
    }
    let expected = || format!("expected ip:port or host:port, found {value:?}");
    let (host, port) = value.rsplit_once(':').ok_or_else(expected)?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(expected());
    }
    let found: Vec<SocketAddr> = value
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve host {host:?}: {e}"))?
        .collect();
    found
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| found.first())
        .copied()
        .ok_or_else(|| format!("host {host:?} resolves to no address"))
}

/// Validates every value of `raw`.
///
/// # Errors
/// Every [`Problem`] found, in file order.
pub(crate) fn validate(raw: RawConfig) -> Result<Config, Vec<Problem>> {
    let mut c = Check {
        problems: Vec::new(),
    };

    let listen = c.socket("server.listen", &raw.server.listen);
    let admin_listen = c.socket("server.admin_listen", &raw.server.admin_listen);
    if listen == admin_listen && listen.port() != 0 {
        c.bad("server.admin_listen", "must differ from server.listen");
    }
    let workers = match c.range("server.workers", raw.server.workers, 0, 1024) {
        Some(0) => std::thread::available_parallelism().map_or(1, usize::from),
        Some(n) => usize::try_from(n).unwrap_or(1),
        None => 1,
    };
    let server = ServerSettings {
        listen,
        admin_listen,
        workers,
        shutdown_timeout: c.seconds(
            "server.shutdown_timeout_seconds",
            raw.server.shutdown_timeout_seconds,
            3600,
        ),
    };

    let instance = InstanceSettings {
        id: instance_id(&mut c, &raw.instance.id),
        region: optional_id(&mut c, "instance.region", &raw.instance.region),
        expected_count: c.positive_i32("instance.expected_count", raw.instance.expected_count),
        heartbeat: c.millis("instance.heartbeat_ms", raw.instance.heartbeat_ms, 60_000),
    };

    let redis = RedisSettings {
        target: redis_target(&mut c, &raw.redis.url, &raw.redis.cluster_nodes),
        timeout: c.millis("redis.timeout_ms", raw.redis.timeout_ms, 60_000),
        connect_timeout: c.millis(
            "redis.connect_timeout_ms",
            raw.redis.connect_timeout_ms,
            60_000,
        ),
        max_keys_per_call: c
            .range(
                "redis.max_keys_per_call",
                raw.redis.max_keys_per_call,
                1,
                1024,
            )
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(1),
    };

    let source = if raw.rules.database_url.is_empty() {
        if raw.rules.file.trim().is_empty() {
            c.bad(
                "rules.file",
                "must name a rules file when rules.database_url is empty",
            );
        }
        RuleSource::File(PathBuf::from(&raw.rules.file))
    } else {
        if let Err(message) = database_url(&raw.rules.database_url) {
            c.bad("rules.database_url", message);
        }
        RuleSource::Database(raw.rules.database_url.clone())
    };
    let rules = RulesSettings {
        source,
        refresh: c.seconds("rules.refresh_seconds", raw.rules.refresh_seconds, 86_400),
        watch_interval: c.millis(
            "rules.watch_interval_ms",
            raw.rules.watch_interval_ms,
            60_000,
        ),
        settle: Duration::from_millis(
            c.range("rules.settle_ms", raw.rules.settle_ms, 0, 60_000)
                .unwrap_or(0),
        ),
        snapshot_file: Some(PathBuf::from(&raw.rules.snapshot_file))
            .filter(|p| !p.as_os_str().is_empty()),
        migrate_on_start: raw.rules.migrate_on_start,
    };

    let default_rule = c.limit("default_rule", &raw.default_rule);

    let b = &raw.breaker;
    let breaker = BreakerSettings {
        failure_threshold: c
            .range(
                "breaker.failure_threshold",
                b.failure_threshold,
                1,
                1_000_000,
            )
            .map_or(1, |n| u32::try_from(n).unwrap_or(1)),
        failure_ratio: c
            .range(
                "breaker.failure_ratio_percent",
                b.failure_ratio_percent,
                1,
                100,
            )
            .map_or(1.0, |p| p as f64 / 100.0),
        min_calls: c
            .range("breaker.min_calls", b.min_calls, 1, 1_000_000)
            .map_or(1, |n| u32::try_from(n).unwrap_or(1)),
        window: c.millis("breaker.window_ms", b.window_ms, 3_600_000),
        cooldown: c.millis("breaker.cooldown_ms", b.cooldown_ms, 3_600_000),
    };
    let fallback = FallbackSettings {
        max_keys: c
            .range("fallback.max_keys", raw.fallback.max_keys, 16, 100_000_000)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(16),
    };

    let lease = LeaseSettings {
        enabled: raw.lease.enabled,
        window: c.millis("lease.window_ms", raw.lease.window_ms, 60_000),
        max_batch: c
            .range("lease.max_batch", raw.lease.max_batch, 1, 100_000)
            .map_or(1, |n| u32::try_from(n).unwrap_or(1)),
        min_rate_per_second: c
            .range(
                "lease.min_rate_per_second",
                raw.lease.min_rate_per_second,
                1,
                10_000_000,
            )
            .map_or(1.0, |n| n as f64),
    };

    let metrics = MetricsSettings {
        max_tenant_labels: c
            .range(
                "metrics.max_tenant_labels",
                raw.metrics.max_tenant_labels,
                0,
                100_000,
            )
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(0),
    };

    let r = &raw.rebalancer;
    let percent = |c: &mut Check, key: &str, v: i64, min: i64| {
        c.range(key, v, min, 100).map_or(0.0, |p| p as f64 / 100.0)
    };
    if r.enabled
        && !(r.prometheus_url.starts_with("http://") || r.prometheus_url.starts_with("https://"))
    {
        c.bad(
            "rebalancer.prometheus_url",
            format!(
                "expected http://host:port, found {:?}",
                redact_url(&r.prometheus_url)
            ),
        );
    }
    if r.enabled && raw.rules.database_url.is_empty() {
        c.bad(
            "rebalancer.enabled",
            "the rebalancer writes shares to PostgreSQL: set rules.database_url",
        );
    }
    let rebalancer = RebalancerSettings {
        enabled: r.enabled,
        prometheus_url: r.prometheus_url.trim_end_matches('/').to_owned(),
        interval: c.seconds("rebalancer.interval_seconds", r.interval_seconds, 86_400),
        window: c.seconds("rebalancer.window_seconds", r.window_seconds, 86_400),
        smoothing: percent(
            &mut c,
            "rebalancer.smoothing_percent",
            r.smoothing_percent,
            1,
        ),
        max_step: percent(&mut c, "rebalancer.max_step_percent", r.max_step_percent, 1),
        floor: percent(&mut c, "rebalancer.floor_percent", r.floor_percent, 0),
    };

    let admin = AdminSettings {
        token: Some(raw.admin.token).filter(|t| !t.is_empty()),
        read_token: Some(raw.admin.read_token).filter(|t| !t.is_empty()),
    };

    let upstream = UpstreamSettings {
        connect_timeout: c.millis(
            "upstream.connect_timeout_ms",
            raw.upstream.connect_timeout_ms,
            600_000,
        ),
        timeout: c.millis("upstream.timeout_ms", raw.upstream.timeout_ms, 3_600_000),
        max_connections_per_worker: c
            .range(
                "upstream.max_connections_per_worker",
                raw.upstream.max_connections_per_worker,
                1,
                100_000,
            )
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(1),
        max_connections_per_tenant: c
            .range(
                "upstream.max_connections_per_tenant",
                raw.upstream.max_connections_per_tenant,
                1,
                100_000,
            )
            .map_or(1, |n| u32::try_from(n).unwrap_or(1)),
        max_connections_without_rule: c
            .range(
                "upstream.max_connections_without_rule",
                raw.upstream.max_connections_without_rule,
                1,
                100_000,
            )
            .map_or(1, |n| u32::try_from(n).unwrap_or(1)),
        idle_timeout: c.millis(
            "upstream.idle_timeout_ms",
            raw.upstream.idle_timeout_ms,
            3_600_000,
        ),
    };

    let cl = &raw.client;
    let min_bytes_per_second = c
        .range(
            "client.min_bytes_per_second",
            cl.min_bytes_per_second,
            0,
            1 << 40,
        )
        .unwrap_or(0);
    let client = ClientSettings {
        header_timeout: c.millis("client.header_timeout_ms", cl.header_timeout_ms, 3_600_000),
        read: Pace {
            timeout: c.millis("client.read_timeout_ms", cl.read_timeout_ms, 3_600_000),
            min_bytes_per_second,
        },
        write: Pace {
            timeout: c.millis("client.write_timeout_ms", cl.write_timeout_ms, 3_600_000),
            min_bytes_per_second,
        },
    };

    if let Err(e) = tracing_subscriber::EnvFilter::try_new(&raw.log.level) {
        c.bad("log.level", format!("not a valid tracing filter: {e}"));
    }
    let log = LogSettings {
        level: raw.log.level,
    };

    if raw.routes.is_empty() {
        c.bad("routes", "at least one [[routes]] entry is required");
    }
    let mut seen = HashSet::new();
    let routes = raw
        .routes
        .iter()
        .enumerate()
        .filter_map(|(i, r)| route(&mut c, i, r, &mut seen))
        .collect();

    if c.problems.is_empty() {
        Ok(Config {
            server,
            instance,
            redis,
            rules,
            default_rule,
            shadow: raw.limits.shadow,
            admin,
            breaker,
            fallback,
            lease,
            metrics,
            regions_dir: PathBuf::from(&raw.regions.dir),
            rebalancer,
            upstream,
            client,
            log,
            routes,
        })
    } else {
        Err(c.problems)
    }
}

/// The configured instance id, or `<hostname>-<pid>`.
fn instance_id(c: &mut Check, raw: &str) -> String {
    if raw.is_empty() {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| validate_id(h).is_ok())
            .unwrap_or_else(|| "tollgate".to_owned());
        return format!("{host}-{}", std::process::id());
    }
    optional_id(c, "instance.id", raw).unwrap_or_default()
}

/// An id in the key charset, or `None` when empty.
fn optional_id(c: &mut Check, key: &str, raw: &str) -> Option<String> {
    if raw.is_empty() {
        return None;
    }
    match validate_id(raw) {
        Ok(()) => Some(raw.to_owned()),
        Err(e) => {
            c.bad(key, format!("{raw:?} {e}"));
            None
        }
    }
}

/// Resolves `redis.url` and `redis.cluster_nodes` into one target.
fn redis_target(c: &mut Check, url: &str, nodes: &[String]) -> RedisTarget {
    if !nodes.is_empty() {
        let urls = nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let url = if node.contains("://") {
                    node.clone()
                } else {
                    format!("redis://{node}")
                };
                if redis::Client::open(url.as_str()).is_err() || !url.starts_with("redis://") {
                    c.bad(
                        format!("redis.cluster_nodes[{i}]"),
                        format!("expected host:port, found {:?}", redact_url(node)),
                    );
                }
                url
            })
            .collect();
        return RedisTarget::Cluster(urls);
    }
    if url.is_empty() {
        return RedisTarget::LocalOnly;
    }
    if !url.starts_with("redis://") {
        c.bad(
            "redis.url",
            format!(
                "expected redis://host:port[/db], found {:?}",
                redact_url(url)
            ),
        );
    } else if let Err(e) = redis::Client::open(url) {
        c.bad("redis.url", format!("not a usable Redis URL: {e}"));
    }
    RedisTarget::Single(url.to_owned())
}

/// Checks a PostgreSQL URL's form (the server is not contacted).
///
/// # Errors
/// A message saying what is wrong.
pub fn database_url(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .ok_or_else(|| {
            format!(
                "expected postgres://user@host:port/database, found {:?}",
                redact_url(url)
            )
        })?;
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    if host.split(['/', '?']).next().unwrap_or("").is_empty() {
        return Err(format!("no host in {:?}", redact_url(url)));
    }
    Ok(())
}

/// Validates one route entry; `None` when it is unusable.
fn route(c: &mut Check, i: usize, r: &RawRoute, seen: &mut HashSet<String>) -> Option<RouteSpec> {
    let at = |key: &str| format!("routes[{i}].{key}");
    let before = c.problems.len();

    let id = match RouteId::parse(&r.id) {
        Ok(id) => Some(id),
        Err(e) => {
            c.bad(at("id"), format!("{:?} {e}", r.id));
            None
        }
    };
    if !r.id.is_empty() && !seen.insert(r.id.clone()) {
        c.bad(at("id"), format!("duplicate route id {:?}", r.id));
    }

    let methods = r
        .methods
        .iter()
        .filter_map(
            |m| match Method::from_bytes(m.to_ascii_uppercase().as_bytes()) {
                Ok(method) => Some(method),
                Err(_) => {
                    c.bad(at("methods"), format!("{m:?} is not an HTTP method"));
                    None
                }
            },
        )
        .collect();

    if !r.path_prefix.starts_with('/') {
        c.bad(
            at("path_prefix"),
            format!("must start with '/', found {:?}", r.path_prefix),
        );
    } else {
        match normalize(&r.path_prefix) {
            Ok(normal) if normal == r.path_prefix => {}
            Ok(normal) => c.bad(
                at("path_prefix"),
                format!(
                    "must be written as requests are matched: {:?}, not {:?}",
                    normal, r.path_prefix
                ),
            ),
            Err(e) => c.bad(
                at("path_prefix"),
                format!("{:?} is refused in requests ({e})", r.path_prefix),
            ),
        }
    }
    let path_prefix = match r.path_prefix.trim_end_matches('/') {
        "" => "/".to_owned(),
        p => p.to_owned(),
    };

    let (upstream_origin, upstream_base_path) = upstream(c, &at("upstream"), &r.upstream);
    let cost = c.positive_i32(&at("cost"), r.cost);

    if c.problems.len() != before {
        return None;
    }
    Some(RouteSpec {
        id: id?,
        methods,
        path_prefix,
        upstream_origin,
        upstream_base_path,
        cost,
    })
}

/// Splits an upstream URL into origin and base path.
fn upstream(c: &mut Check, key: &str, raw: &str) -> (String, String) {
    let parsed = raw.parse::<Uri>().ok().filter(|u| {
        u.scheme_str() == Some("http") && u.authority().is_some() && u.query().is_none()
    });
    match parsed {
        Some(uri) => {
            let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
            let base = uri.path().trim_end_matches('/').to_owned();
            (format!("http://{authority}"), base)
        }
        None => {
            let tls = if raw.starts_with("https://") {
                " (https:// upstreams are not supported yet)"
            } else {
                ""
            };
            c.bad(
                key,
                format!("expected http://host:port[/base-path], found {raw:?}{tls}"),
            );
            (String::new(), String::new())
        }
    }
}
