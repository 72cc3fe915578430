//! The configuration file as written: serde structs with defaults.
//!
//! These structs mirror SPEC §11 key for key. They are deliberately loose
//! (signed integers, plain strings) so that [`super::settings`] can report a
//! readable message for every bad value instead of a serde type error. The
//! serialized [`RawConfig::default`] doubles as the schema used to find
//! unknown keys and wrong value types.

use serde::{Deserialize, Serialize};

/// The whole configuration file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawConfig {
    pub(crate) server: RawServer,
    pub(crate) instance: RawInstance,
    pub(crate) redis: RawRedis,
    pub(crate) rules: RawRules,
    pub(crate) default_rule: RawLimit,
    pub(crate) limits: RawLimits,
    pub(crate) admin: RawAdmin,
    pub(crate) breaker: RawBreaker,
    pub(crate) fallback: RawFallback,
    pub(crate) lease: RawLease,
    pub(crate) metrics: RawMetrics,
    pub(crate) regions: RawRegions,
    pub(crate) rebalancer: RawRebalancer,
    pub(crate) upstream: RawUpstream,
    pub(crate) client: RawClient,
    pub(crate) log: RawLog,
    pub(crate) rls: RawRls,
    pub(crate) check: RawCheck,
    pub(crate) routes: Vec<RawRoute>,
}

impl RawConfig {
    /// Makes every relative path (files, directories) relative to `base`,
    /// unless nothing is there while the path names something from the
    /// working directory (as every path did before); empty ones ("not
    /// set") stay empty.
    pub(crate) fn rebase_paths(&mut self, base: &std::path::Path) {
        let redis = &mut self.redis;
        for path in [
            &mut self.server.tls_cert_file,
            &mut self.server.tls_key_file,
            &mut redis.password_file,
            &mut redis.sentinel_password_file,
            &mut redis.ca_file,
            &mut redis.tls_cert_file,
            &mut redis.tls_key_file,
            &mut self.rules.file,
            &mut self.rules.snapshot_file,
            &mut self.regions.dir,
            &mut self.upstream.ca_file,
        ] {
            let given = std::path::Path::new(path.as_str());
            if path.is_empty() || given.is_absolute() {
                continue;
            }
            let rebased = base.join(given);
            if rebased.exists() || !given.exists() {
                *path = rebased.to_string_lossy().into_owned();
            }
        }
    }
}

/// `[server]`: listeners and workers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawServer {
    pub(crate) listen: String,
    pub(crate) admin_listen: String,
    pub(crate) workers: i64,
    pub(crate) shutdown_timeout_seconds: i64,
    pub(crate) h2c: bool,
    pub(crate) tls_cert_file: String,
    pub(crate) tls_key_file: String,
    pub(crate) tls_reload_seconds: i64,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:8080".into(),
            admin_listen: "127.0.0.1:9091".into(),
            workers: 2,
            shutdown_timeout_seconds: 10,
            h2c: false,
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
            tls_reload_seconds: 10,
        }
    }
}

/// `[instance]`: identity of this gateway.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawInstance {
    pub(crate) id: String,
    pub(crate) region: String,
    pub(crate) expected_count: i64,
    pub(crate) heartbeat_ms: i64,
}

impl Default for RawInstance {
    fn default() -> Self {
        Self {
            id: String::new(),
            region: String::new(),
            expected_count: 1,
            heartbeat_ms: 2000,
        }
    }
}

/// `[redis]`: where bucket state lives.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawRedis {
    pub(crate) url: String,
    pub(crate) cluster_nodes: Vec<String>,
    pub(crate) timeout_ms: i64,
    pub(crate) connect_timeout_ms: i64,
    pub(crate) max_keys_per_call: i64,
    pub(crate) max_calls_in_flight: i64,
    pub(crate) sentinel_nodes: Vec<String>,
    pub(crate) sentinel_master: String,
    pub(crate) username: String,
    pub(crate) password_file: String,
    pub(crate) sentinel_username: String,
    pub(crate) sentinel_password_file: String,
    pub(crate) ca_file: String,
    pub(crate) tls_cert_file: String,
    pub(crate) tls_key_file: String,
}

impl Default for RawRedis {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".into(),
            cluster_nodes: Vec::new(),
            timeout_ms: 5,
            connect_timeout_ms: 200,
            max_keys_per_call: 32,
            max_calls_in_flight: 1,
            sentinel_nodes: Vec::new(),
            sentinel_master: String::new(),
            username: String::new(),
            password_file: String::new(),
            sentinel_username: String::new(),
            sentinel_password_file: String::new(),
            ca_file: String::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
        }
    }
}

/// `[rules]`: where per-tenant rules come from.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawRules {
    pub(crate) database_url: String,
    pub(crate) file: String,
    pub(crate) refresh_seconds: i64,
    pub(crate) watch_interval_ms: i64,
    pub(crate) settle_ms: i64,
    pub(crate) snapshot_file: String,
    pub(crate) migrate_on_start: bool,
}

impl Default for RawRules {
    fn default() -> Self {
        Self {
            database_url: String::new(),
            file: "config/rules.toml".into(),
            refresh_seconds: 30,
            watch_interval_ms: 1000,
            settle_ms: 300,
            snapshot_file: "tollgate-rules-snapshot.json".into(),
            migrate_on_start: true,
        }
    }
}

/// `[default_rule]`: the limit for pairs without a rule.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawLimit {
    pub(crate) capacity: i64,
    pub(crate) refill_per_second: i64,
}

impl Default for RawLimit {
    fn default() -> Self {
        Self {
            capacity: 20,
            refill_per_second: 10,
        }
    }
}

/// `[limits]`: how every rule is applied.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawLimits {
    pub(crate) shadow: bool,
    pub(crate) slot_lease_ms: i64,
}

impl Default for RawLimits {
    fn default() -> Self {
        Self {
            shadow: false,
            slot_lease_ms: 10_000,
        }
    }
}

/// `[admin]`: admin API protection.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawAdmin {
    pub(crate) token: String,
    pub(crate) read_token: String,
}

/// `[breaker]`: when to stop calling a failing Redis.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawBreaker {
    pub(crate) failure_threshold: i64,
    pub(crate) failure_ratio_percent: i64,
    pub(crate) min_calls: i64,
    pub(crate) window_ms: i64,
    pub(crate) cooldown_ms: i64,
}

impl Default for RawBreaker {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            failure_ratio_percent: 50,
            min_calls: 20,
            window_ms: 10_000,
            cooldown_ms: 1000,
        }
    }
}

/// `[fallback]`: the local limiter used without Redis.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawFallback {
    pub(crate) max_keys: i64,
}

impl Default for RawFallback {
    fn default() -> Self {
        Self { max_keys: 100_000 }
    }
}

/// `[lease]`: batched token leases for hot keys.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawLease {
    pub(crate) enabled: bool,
    pub(crate) window_ms: i64,
    pub(crate) max_batch: i64,
    pub(crate) min_rate_per_second: i64,
}

impl Default for RawLease {
    fn default() -> Self {
        Self {
            enabled: true,
            window_ms: 100,
            max_batch: 50,
            min_rate_per_second: 100,
        }
    }
}

/// `[metrics]`: label cardinality.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawMetrics {
    pub(crate) max_tenant_labels: i64,
}

impl Default for RawMetrics {
    fn default() -> Self {
        Self {
            max_tenant_labels: 100,
        }
    }
}

/// `[regions]`: where region files live.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawRegions {
    pub(crate) dir: String,
}

impl Default for RawRegions {
    fn default() -> Self {
        Self {
            dir: "regions".into(),
        }
    }
}

/// `[rebalancer]`: moving shares between regions with traffic.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawRebalancer {
    pub(crate) enabled: bool,
    pub(crate) prometheus_url: String,
    pub(crate) interval_seconds: i64,
    pub(crate) window_seconds: i64,
    pub(crate) smoothing_percent: i64,
    pub(crate) max_step_percent: i64,
    pub(crate) floor_percent: i64,
}

impl Default for RawRebalancer {
    fn default() -> Self {
        Self {
            enabled: false,
            prometheus_url: "http://127.0.0.1:9090".into(),
            interval_seconds: 300,
            window_seconds: 300,
            smoothing_percent: 50,
            max_step_percent: 20,
            floor_percent: 5,
        }
    }
}

/// `[upstream]`: how the proxy talks to upstreams.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawUpstream {
    pub(crate) connect_timeout_ms: i64,
    pub(crate) timeout_ms: i64,
    pub(crate) max_connections_per_worker: i64,
    pub(crate) max_connections_per_tenant: i64,
    pub(crate) max_connections_without_rule: i64,
    pub(crate) idle_timeout_ms: i64,
    pub(crate) ca_file: String,
}

impl Default for RawUpstream {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 1000,
            timeout_ms: 30_000,
            max_connections_per_worker: 256,
            max_connections_per_tenant: 64,
            max_connections_without_rule: 128,
            idle_timeout_ms: 4000,
            ca_file: String::new(),
        }
    }
}

/// `[client]`: deadlines for clients of the proxy listener.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawClient {
    pub(crate) header_timeout_ms: i64,
    pub(crate) read_timeout_ms: i64,
    pub(crate) write_timeout_ms: i64,
    pub(crate) min_bytes_per_second: i64,
    pub(crate) h2_idle_timeout_ms: i64,
    pub(crate) h2_max_concurrent_streams: i64,
    pub(crate) body_buffer_bytes_per_connection: i64,
    pub(crate) body_buffer_bytes: i64,
}

impl Default for RawClient {
    fn default() -> Self {
        Self {
            header_timeout_ms: 5000,
            read_timeout_ms: 10_000,
            write_timeout_ms: 10_000,
            min_bytes_per_second: 1024,
            h2_idle_timeout_ms: 300_000,
            h2_max_concurrent_streams: 100,
            body_buffer_bytes_per_connection: 1 << 20,
            body_buffer_bytes: 64 << 20,
        }
    }
}

/// `[log]`: log verbosity, format and the access log.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawLog {
    pub(crate) level: String,
    pub(crate) format: String,
    pub(crate) access: bool,
    pub(crate) access_sample_percent: i64,
}

impl Default for RawLog {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: "text".into(),
            access: false,
            access_sample_percent: 100,
        }
    }
}

/// `[rls]`: Envoy's rate limit service.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawRls {
    pub(crate) listen: String,
    pub(crate) tenant_key: String,
    pub(crate) route_key: String,
    pub(crate) charge_key: String,
    pub(crate) request_id_key: String,
    pub(crate) release_key: String,
    pub(crate) domain: String,
}

impl Default for RawRls {
    fn default() -> Self {
        Self {
            listen: String::new(),
            tenant_key: "api_key".into(),
            route_key: "route".into(),
            charge_key: "charge".into(),
            request_id_key: "request_id".into(),
            release_key: "release".into(),
            domain: String::new(),
        }
    }
}

/// `[check]`: the HTTP check endpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawCheck {
    pub(crate) listen: String,
    pub(crate) refused_status: i64,
}

impl Default for RawCheck {
    fn default() -> Self {
        Self {
            listen: String::new(),
            refused_status: 403,
        }
    }
}

/// One `[[routes]]` entry.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawRoute {
    pub(crate) id: String,
    pub(crate) methods: Vec<String>,
    pub(crate) path_prefix: String,
    pub(crate) upstream: String,
    pub(crate) cost: i64,
    pub(crate) usage_header: String,
    /// 0: the route's cost.
    pub(crate) reserve: i64,
    pub(crate) reserve_header: String,
    /// 0: the reserve.
    pub(crate) max_reserve: i64,
}

impl Default for RawRoute {
    fn default() -> Self {
        Self {
            id: String::new(),
            methods: Vec::new(),
            path_prefix: String::new(),
            upstream: String::new(),
            cost: 1,
            usage_header: String::new(),
            reserve: 0,
            reserve_header: String::new(),
            max_reserve: 0,
        }
    }
}
