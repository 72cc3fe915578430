//! Checked, typed settings: what the rest of the gateway reads.
//!
//! Owns the [`Config`] types, one struct per section; they are only built
//! by [`super::validate`] from the raw file, so every value in them has
//! been checked.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use hyper::Method;

use crate::key::RouteId;

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
    /// How long a concurrency slot stays held unless its gateway renews
    /// it (`[limits] slot_lease_ms`): a killed gateway's slots come back
    /// within this time.
    pub slot_lease: Duration,
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
    /// Envoy's rate limit service, when served.
    pub rls: Option<RlsSettings>,
    /// The HTTP check endpoint, when served.
    pub check: Option<CheckSettings>,
    /// The route table, in file order.
    pub routes: Vec<RouteSpec>,
    /// What validation accepted but changed, for `check-config` to print
    /// and `serve` to log (a bound clamped to the upstream pool).
    pub notes: Vec<String>,
}

/// `[rls]`: how Envoy's descriptors become decisions.
#[derive(Debug, Clone)]
pub struct RlsSettings {
    /// The gRPC listener (HTTP/2).
    pub listen: SocketAddr,
    /// The descriptor entry whose value is the tenant.
    pub tenant_key: String,
    /// The descriptor entry whose value is the route id.
    pub route_key: String,
    /// The descriptor entry that, set to `true`, marks a charge: usage
    /// reported after the fact, taken whatever the limits hold.
    pub charge_key: String,
    /// The descriptor entry whose value names the request (Envoy's
    /// `x-request-id`): its concurrency slots are held for it.
    pub request_id_key: String,
    /// The descriptor entry that, set to `true`, marks a release: the
    /// named request's concurrency slots given back.
    pub release_key: String,
    /// The one domain served, when set; requests for another are refused.
    pub domain: Option<String>,
}

/// `[check]`: the HTTP check endpoint.
#[derive(Debug, Clone, Copy)]
pub struct CheckSettings {
    /// Its listener.
    pub listen: SocketAddr,
    /// The status of a refusal on `GET /v1/auth` (403 for nginx's
    /// `auth_request`, 429 for Traefik's `forwardAuth`).
    pub refused_status: u16,
}

/// Why a rule for `route` would never apply on a gateway with `routes`:
/// `None` when it has that route, else a message listing the ones it has.
pub fn unknown_route(routes: &[RouteId], route: &str) -> Option<String> {
    if routes.iter().any(|r| r.as_str() == route) {
        return None;
    }
    let known: Vec<&str> = routes.iter().map(RouteId::as_str).collect();
    Some(format!(
        "no route {route:?} in this gateway's configuration (routes: {})",
        known.join(", ")
    ))
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
    /// Whether the proxy listener also speaks cleartext HTTP/2 to clients
    /// that start with its preface (prior knowledge).
    pub h2c: bool,
    /// TLS on the proxy listener, when configured.
    pub tls: Option<ListenerTlsFiles>,
}

/// The proxy listener's certificate: PEM files, read again every `reload`.
#[derive(Debug, Clone)]
pub struct ListenerTlsFiles {
    /// The certificate chain, leaf first.
    pub cert: PathBuf,
    /// The leaf's private key.
    pub key: PathBuf,
    /// How often the files are read again; a changed, loadable pair serves
    /// new connections.
    pub reload: Duration,
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

/// Which Redis deployment holds bucket state. Every URL is `redis://` or
/// `rediss://` (TLS); the URLs of one list agree on which.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// No Redis: every decision is local to this instance.
    LocalOnly,
    /// One Redis server.
    Single(String),
    /// A Redis Cluster, reached through these seed URLs.
    Cluster(Vec<String>),
    /// A primary found through Redis Sentinel, and followed across its
    /// failovers.
    Sentinel {
        /// The sentinels' URLs (the primary is reached with their scheme).
        nodes: Vec<String>,
        /// The name the sentinels monitor the primary under.
        master: String,
    },
}

impl RedisTarget {
    /// Every URL the target names.
    pub fn urls(&self) -> &[String] {
        match self {
            Self::LocalOnly => &[],
            Self::Single(url) => std::slice::from_ref(url),
            Self::Cluster(nodes) | Self::Sentinel { nodes, .. } => nodes,
        }
    }

    /// Whether the Redis servers are reached over TLS.
    pub fn is_tls(&self) -> bool {
        self.urls().iter().any(|u| u.starts_with("rediss://"))
    }
}

/// Who tollgate is to a Redis server (or to Sentinel): an ACL user and
/// the file its password is read from. Unset parts come from the URL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisCredentials {
    /// The ACL user name.
    pub username: Option<String>,
    /// The file holding the password (its first line).
    pub password_file: Option<PathBuf>,
}

/// TLS material for `rediss://` connections.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTlsFiles {
    /// PEM certificates trusted for Redis instead of the system's roots.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate and its private key, for mutual TLS.
    pub client: Option<(PathBuf, PathBuf)>,
}

impl RedisTlsFiles {
    /// Whether any file is set.
    pub fn is_set(&self) -> bool {
        self.ca_file.is_some() || self.client.is_some()
    }
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
    /// Most coalesced script calls one worker has in flight at once (per
    /// Cluster slot).
    pub max_calls_in_flight: usize,
    /// Credentials for the Redis servers.
    pub credentials: RedisCredentials,
    /// Credentials for the sentinels.
    pub sentinel_credentials: RedisCredentials,
    /// TLS material for `rediss://` targets.
    pub tls: RedisTlsFiles,
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
    /// The configured route ids: a rules file naming another route is
    /// refused, as a rule for it would never apply.
    pub routes: Vec<RouteId>,
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
    /// Upstream exchanges one tenant may have in flight on one worker
    /// (at most half the pool); further requests are refused with 429
    /// before any token is taken.
    pub max_connections_per_tenant: u32,
    /// Upstream exchanges all tenants without a rule for the route may
    /// have in flight together on one worker (at most half the pool, so
    /// fresh keys cannot take every connection from tenants with rules).
    pub max_connections_without_rule: u32,
    /// Longest time a kept upstream connection may stay idle and still be
    /// used; shorter than the upstreams' own keep-alive timeouts.
    pub idle_timeout: Duration,
    /// The CA certificates trusted for `https://` upstreams instead of the
    /// system's, when set.
    pub ca_file: Option<PathBuf>,
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
    /// Longest time an HTTP/2 connection may go without starting a
    /// request (its first included) before it is ended with `GOAWAY`;
    /// longer than `header_timeout`.
    pub h2_idle_timeout: Duration,
    /// Most streams one HTTP/2 connection may have open at once.
    pub h2_max_concurrent_streams: u32,
    /// Most bytes of request bodies read whole (a check, a gRPC message)
    /// that one connection's requests may hold at once.
    pub body_buffer_bytes_per_connection: u32,
    /// The same, all connections of the process together.
    pub body_buffer_bytes: u64,
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
    /// How each line is written.
    pub format: LogFormat,
    /// Access log: one line per proxied request, for this share of them
    /// (1..=100 percent); `None` when off.
    pub access_sample_percent: Option<u8>,
}

/// `log.format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (colour only on a terminal).
    Text,
    /// One JSON object per line.
    Json,
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
    /// Upstream origin, `http://host[:port]` or `https://host[:port]`,
    /// without a trailing slash.
    pub upstream_origin: String,
    /// Path prepended to forwarded paths (`""` or `/base`, no trailing slash).
    pub upstream_base_path: String,
    /// Tokens one request on this route takes.
    pub cost: NonZeroU32,
    /// When its answers report what they cost: how that is settled.
    pub usage: Option<UsageSpec>,
}

/// A route whose answers report what they really cost
/// (`routes[].usage_header`): a reservation is taken up front and the
/// difference settled when the answer's usage is known.
#[derive(Debug, Clone)]
pub struct UsageSpec {
    /// The response header, or trailer, whose whole-number value is the
    /// request's real cost.
    pub header: hyper::header::HeaderName,
    /// Tokens reserved up front (`routes[].reserve`, default the cost).
    pub reserve: NonZeroU32,
    /// The request header that sets the reservation, when configured.
    pub reserve_header: Option<hyper::header::HeaderName>,
    /// The most a reservation header may ask (`routes[].max_reserve`,
    /// default the reserve).
    pub max_reserve: NonZeroU32,
}

impl RouteSpec {
    /// Whether the upstream is reached over TLS (`https://`).
    pub fn is_tls(&self) -> bool {
        self.upstream_origin.starts_with("https://")
    }

    /// The upstream's authority, and the port it is reached on (the
    /// scheme's, 80 or 443, when the origin names none).
    ///
    /// # Panics
    /// Never for a checked route: validation accepts only
    /// `http[s]://host[:port]` origins.
    pub fn upstream_authority(&self) -> (hyper::http::uri::Authority, u16) {
        let (authority, default_port) = match self.upstream_origin.split_once("://") {
            Some(("https", authority)) => (authority, 443),
            Some((_, authority)) => (authority, 80),
            None => (self.upstream_origin.as_str(), 80),
        };
        // expect: validation accepts only `http[s]://host[:port]` origins.
        let authority: hyper::http::uri::Authority =
            authority.parse().expect("a validated upstream origin");
        let port = authority.port_u16().unwrap_or(default_port);
        (authority, port)
    }
}
