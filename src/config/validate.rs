//! Validation: the raw file turned into a [`Config`].
//!
//! Owns [`validate`], which checks every value of a [`RawConfig`] and
//! collects a [`Problem`] for each bad one rather than stopping at the
//! first, and the per-key conversions it uses ([`Check`]). Routes are
//! checked in [`super::routes`], the proxy's listener, upstream and client
//! settings in [`super::proxying`].

use std::collections::HashSet;
use std::net::{SocketAddr, ToSocketAddrs};
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use super::Problem;
use super::raw::{RawConfig, RawLimit};
use super::redact_url;
use super::routes::route;
use super::settings::{
    AdminSettings, BreakerSettings, Config, FallbackSettings, InstanceSettings, LeaseSettings,
    LimitSettings, LogFormat, LogSettings, MetricsSettings, RebalancerSettings, RouteSpec,
    RuleSource, RulesSettings,
};
use super::{entries, proxying};
use crate::key::validate_id;

/// Collects problems while converting fields.
pub(super) struct Check {
    /// Every problem found so far, in order.
    pub(super) problems: Vec<Problem>,
    /// What was accepted but changed or is worth telling (a bound clamped).
    pub(super) notes: Vec<String>,
}

impl Check {
    /// Records that `key` is bad, and why.
    pub(super) fn bad(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem::new(key, message));
    }

    /// An integer in `min..=max`, or a problem.
    pub(super) fn range(&mut self, key: &str, value: i64, min: i64, max: i64) -> Option<u64> {
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

    pub(super) fn millis(&mut self, key: &str, value: i64, max: i64) -> Duration {
        Duration::from_millis(self.range(key, value, 1, max).unwrap_or(1))
    }

    pub(super) fn seconds(&mut self, key: &str, value: i64, max: i64) -> Duration {
        Duration::from_secs(self.range(key, value, 1, max).unwrap_or(1))
    }

    /// An integer in `1..=i32::MAX`, or a problem (and 1).
    pub(super) fn positive_i32(&mut self, key: &str, value: i64) -> NonZeroU32 {
        let v = self.range(key, value, 1, i64::from(i32::MAX)).unwrap_or(1);
        // unwrap: `range` guarantees 1..=i32::MAX, or the fallback 1.
        NonZeroU32::new(u32::try_from(v).unwrap_or(1)).expect("checked non-zero")
    }

    /// A listen address: `ip:port`, or `host:port` with a host name
    /// resolved once, here (the first IPv4 address it has, else its first
    /// IPv6 one: `localhost:8080` listens on 127.0.0.1).
    pub(super) fn socket(&mut self, key: &str, value: &str) -> SocketAddr {
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
        notes: Vec::new(),
    };

    let server = proxying::server(&mut c, &raw.server);
    let rls = entries::rls(&mut c, &raw.rls, &server);
    let check = entries::check(&mut c, &raw.check, &server);
    if let (Some(r), Some(k)) = (&rls, &check)
        && r.listen == k.listen
        && r.listen.port() != 0
    {
        c.bad("check.listen", "must differ from rls.listen");
    }

    let instance = InstanceSettings {
        id: instance_id(&mut c, &raw.instance.id),
        region: optional_id(&mut c, "instance.region", &raw.instance.region),
        expected_count: c.positive_i32("instance.expected_count", raw.instance.expected_count),
        heartbeat: c.millis("instance.heartbeat_ms", raw.instance.heartbeat_ms, 60_000),
    };

    let redis = super::bucket_store::redis(&mut c, &raw.redis);

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
        routes: Vec::new(),
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
    if r.enabled && !r.prometheus_url.starts_with("http://") {
        c.bad(
            "rebalancer.prometheus_url",
            format!(
                "expected http://host:port[/prefix] (https is not supported yet), found {:?}",
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

    let client = proxying::client(&mut c, &raw.client);

    if let Err(e) = tracing_subscriber::EnvFilter::try_new(&raw.log.level) {
        c.bad("log.level", format!("not a valid tracing filter: {e}"));
    }
    let format = match raw.log.format.as_str() {
        "text" => LogFormat::Text,
        "json" => LogFormat::Json,
        other => {
            c.bad(
                "log.format",
                format!("must be \"text\" or \"json\", found {other:?}"),
            );
            LogFormat::Text
        }
    };
    let sample = raw.log.access_sample_percent;
    if !(1..=100).contains(&sample) {
        c.bad(
            "log.access_sample_percent",
            format!("must be between 1 and 100, found {sample}"),
        );
    }
    let log = LogSettings {
        level: raw.log.level,
        format,
        access_sample_percent: raw
            .log
            .access
            .then(|| u8::try_from(sample.clamp(1, 100)).unwrap_or(100)),
    };

    if raw.routes.is_empty() {
        c.bad("routes", "at least one [[routes]] entry is required");
    }
    let mut seen = HashSet::new();
    let routes: Vec<RouteSpec> = raw
        .routes
        .iter()
        .enumerate()
        .filter_map(|(i, r)| route(&mut c, i, r, &mut seen))
        .collect();
    let mut rules = rules;
    rules.routes = routes.iter().map(|r| r.id.clone()).collect();
    let upstream = proxying::upstream(&mut c, &raw.upstream, &routes);
    // Renewed every third of it: shorter would be a call per request.
    let slot_lease = Duration::from_millis(
        c.range(
            "limits.slot_lease_ms",
            raw.limits.slot_lease_ms,
            300,
            3_600_000,
        )
        .unwrap_or(10_000),
    );

    if c.problems.is_empty() {
        Ok(Config {
            server,
            instance,
            redis,
            rules,
            default_rule,
            shadow: raw.limits.shadow,
            slot_lease,
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
            rls,
            check,
            routes,
            notes: c.notes,
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
