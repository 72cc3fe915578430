//! The start steps of one gateway, in the order [`super::run`] takes
//! them: what every part shares, the rules, the region and its shares, the
//! Redis side (connector, membership, breaker), the limiter, the
//! rebalancer, the proxy workers and the admin server.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::{App, HttpServer, web};
use anyhow::Context as _;
use metrics_exporter_prometheus::PrometheusHandle;

use super::checks::regions;
use crate::admin::{self, AdminState};
use crate::breaker;
use crate::bucket::{
    CallLimits, Coalesced, HotKeys, Limiter, LimiterCore, LocalBuckets, RedisBucket, WarmWorkers,
};
use crate::clock::{SharedClock, SystemClock};
use crate::cluster::{LiveInstances, Membership};
use crate::config::{self, Config, RedisSettings, RedisTarget, RouteSpec};
use crate::db::RuleStore;
use crate::proxy::route::RouteTable;
use crate::proxy::{self, Forwarder, ProxyServer, ProxyState, Serving, Worker};
use crate::redis_client::{RedisConnector, Topology};
use crate::region::model::{RegionSpec, Regions};
use crate::region::rebalancer::Rebalancer;
use crate::region::{self, shares::SharesHandle};
use crate::rules::{self, RulesHandle};
use crate::telemetry::{self, Entry, Metrics, RequestCounters};
use crate::tls::{ListenerTls, UpstreamTls};

/// What every part shares.
pub(super) struct Base {
    /// Renders `/metrics`.
    pub prometheus: PrometheusHandle,
    /// Series outside any route.
    pub metrics: Metrics,
    /// The one clock.
    pub clock: SharedClock,
    /// Requests by route, tenant label and entry.
    pub requests: Arc<RequestCounters>,
}

/// Telemetry, the clock and the request counters; says which configured
/// bounds were adjusted.
pub(super) fn base(config: &Config) -> Base {
    for note in &config.notes {
        tracing::warn!(adjustment = %note, "A configured bound was adjusted.");
    }
    let prometheus = telemetry::install();
    let mut entries = Vec::new();
    entries.extend(config.rls.as_ref().map(|_| Entry::Rls));
    entries.extend(config.check.as_ref().map(|_| Entry::Check));
    let requests = Arc::new(RequestCounters::new(
        config.routes.iter().map(|r| r.id.as_str()),
        &entries,
        config.metrics.max_tenant_labels,
    ));
    Base {
        prometheus,
        metrics: Metrics::new(),
        clock: SystemClock::shared(),
        requests,
    }
}

/// The rules, loaded once and followed from then on.
///
/// # Errors
/// When the rules file is invalid or the database URL unusable.
pub(super) async fn rules(config: &Config, base: &Base) -> anyhow::Result<RulesHandle> {
    Ok(rules::handle::start(
        &config.rules,
        config.default_rule.into(),
        base.metrics.clone(),
        base.requests.clone(),
        base.clock.clone(),
    )
    .await?)
}

/// This region and every region, when one is configured.
pub(super) type Region = Option<(RegionSpec, Arc<Regions>)>;

/// This region (when one is configured) and the shares of the limits it
/// holds; without regions, every limit is held whole.
///
/// # Errors
/// When the region files are invalid or do not name this region.
pub(super) fn region(
    config: &Config,
    base: &Base,
    rules: &RulesHandle,
) -> anyhow::Result<(Region, SharesHandle)> {
    let region = regions(config).map_err(|p| anyhow::anyhow!(p.join("; ")))?;
    let shares = match &region {
        Some((this, all)) => region::shares::start(
            &this.id,
            all.clone(),
            rules.store().map(RuleStore::database),
            base.requests.clone(),
            base.metrics.clone(),
        ),
        None => SharesHandle::whole(),
    };
    Ok((region, shares))
}

/// The Redis side of a gateway.
pub(super) struct Shared {
    /// The Redis in use (a region brings its own).
    pub settings: RedisSettings,
    /// Connections to it; `None` in local-only mode.
    pub connector: Option<RedisConnector>,
    /// This instance's heartbeat, and the count of live instances.
    pub membership: Membership,
    /// How many instances share each limit.
    pub live: Arc<LiveInstances>,
    /// The primaries with their breakers; `None` without Redis.
    pub breaker: Option<Arc<Topology>>,
    /// Bound on control-plane calls (membership, probes), which may wait
    /// a little longer than request-path calls.
    pub control_timeout: Duration,
}

/// Connects to the configured Redis (or says that limits are local
/// only), joins the membership, follows the deployment's layout and
/// starts the breaker's prober.
///
/// # Errors
/// When the Redis client cannot be set up.
pub(super) fn redis(config: &Config, base: &Base, region: &Region) -> anyhow::Result<Shared> {
    let settings = match region {
        Some((this, _)) => this.redis_settings(&config.redis),
        None => config.redis.clone(),
    };
    let connector = RedisConnector::new(&settings).context("cannot set up the Redis client")?;
    describe(&settings.target, config);
    let control_timeout = config.redis.timeout.max(config.redis.connect_timeout);
    let live = Arc::new(LiveInstances::new(config.instance.expected_count));
    let membership = Membership::start(
        connector.as_ref().map(RedisConnector::connect),
        live.clone(),
        &config.instance.id,
        config.instance.region.as_deref(),
        config.instance.heartbeat,
        control_timeout,
        base.metrics.clone(),
    );
    if let Some(connector) = &connector {
        connector
            .watch(base.clock.clone())
            .context("cannot follow the Redis deployment")?;
    }
    let breaker = connector.as_ref().map(|connector| {
        breaker::prober::start(
            connector.topology().clone(),
            config.breaker,
            connector.connect(),
            config.instance.id.clone(),
            control_timeout,
            base.clock.clone(),
            base.metrics.clone(),
        );
        connector.topology().clone()
    });
    Ok(Shared {
        settings,
        connector,
        membership,
        live,
        breaker,
        control_timeout,
    })
}

/// Logs where buckets live.
fn describe(target: &RedisTarget, config: &Config) {
    match target {
        RedisTarget::LocalOnly => tracing::warn!(
            instances = config.instance.expected_count.get(),
            "No Redis configured: every limit is enforced by this instance alone, at 1/N."
        ),
        RedisTarget::Single(url) => {
            tracing::info!(url = %config::redact_url(url), "Buckets live in Redis.")
        }
        RedisTarget::Cluster(nodes) => {
            tracing::info!(seeds = nodes.len(), "Buckets live in a Redis Cluster.")
        }
        RedisTarget::Sentinel { nodes, master } => tracing::info!(
            sentinels = nodes.len(),
            master = %master,
            "Buckets live in the Redis primary that Sentinel names."
        ),
    }
}

/// The limiter's state shared by every worker.
pub(super) fn limiter(config: &Config, base: &Base, shared: &Shared) -> Arc<LimiterCore> {
    Arc::new(
        LimiterCore::new(
            LocalBuckets::new(config.fallback.max_keys, base.clock.clone()),
            HotKeys::new(
                config.lease,
                config.fallback.max_keys,
                base.clock.clone(),
                base.metrics.clone(),
            ),
            shared.live.clone(),
            shared.breaker.clone(),
            base.clock.clone(),
            base.metrics.clone(),
        )
        .with_slot_lease(config.slot_lease),
    )
}

/// The rebalancer, when it is on and has regions and a database to write
/// shares to.
pub(super) fn rebalancer(
    config: &Config,
    base: &Base,
    region: &Region,
    shares: &SharesHandle,
) -> Option<actix::Addr<Rebalancer>> {
    match (region, shares.store()) {
        (Some((_, all)), Some(store)) if config.rebalancer.enabled => {
            Some(region::rebalancer::start(
                config.rebalancer.clone(),
                all.clone(),
                store.clone(),
                config.instance.id.clone(),
                base.requests.clone(),
                base.metrics.clone(),
            ))
        }
        _ => None,
    }
}

/// The listening sockets the proxy workers serve, each with its entry.
pub(super) type Sockets = Vec<(TcpListener, Entry)>;

/// The proxy workers over `sockets`: per worker, its own upstream pool and
/// Redis connection, warmed (connected, script loaded) before the gateway
/// says it is ready, and its bucket client (a queue on that worker),
/// which coalesces the worker's decisions into shared script calls.
///
/// # Errors
/// When TLS material cannot be loaded or the workers cannot start.
pub(super) fn proxy(
    config: &Config,
    base: &Base,
    parts: (&RulesHandle, &SharesHandle, &Arc<LimiterCore>),
    shared: &Shared,
    sockets: Sockets,
) -> anyhow::Result<(ProxyServer, Option<Arc<WarmWorkers>>)> {
    let (rules, shares, limiter) = parts;
    let state = Arc::new(ProxyState {
        routes: RouteTable::new(&config.routes),
        rules: rules.clone(),
        shares: shares.clone(),
        metrics: base.metrics.clone(),
        requests: base.requests.clone(),
        clock: base.clock.clone(),
        shadow: config.shadow,
        access: config
            .log
            .access_sample_percent
            .map(proxy::access::AccessLog::new),
        rls: config.rls.clone(),
        check: config.check,
    });
    let serving = Serving {
        workers: config.server.workers,
        client: config.client,
        grace: config.server.shutdown_timeout,
        h2c: config.server.h2c,
        tls: listener_tls(config)?,
    };
    let upstream_tls = if config.routes.iter().any(RouteSpec::is_tls) {
        Some(
            UpstreamTls::new(config.upstream.ca_file.as_deref())
                .context("cannot load the CA certificates for https:// upstreams")?,
        )
    } else {
        None
    };
    let warm = shared
        .connector
        .as_ref()
        .map(|_| Arc::new(WarmWorkers::new(config.server.workers)));
    let (upstream, client, routes) = (
        config.upstream.clone(),
        config.client,
        config.routes.clone(),
    );
    let request_timeout = shared.settings.timeout;
    let limits = CallLimits {
        max_keys: shared.settings.max_keys_per_call,
        max_in_flight: shared.settings.max_calls_in_flight,
    };
    let cluster = matches!(shared.settings.target, RedisTarget::Cluster(_));
    let (redis, control_timeout) = (shared.connector.clone(), shared.control_timeout);
    let (metrics, clock, core, warm_workers) = (
        base.metrics.clone(),
        base.clock.clone(),
        limiter.clone(),
        warm.clone(),
    );
    let proxy = ProxyServer::start(sockets, serving, move || {
        let store = redis.as_ref().map(|r| {
            let bucket = RedisBucket::new(
                r.connect_reporting(),
                request_timeout,
                metrics.clone(),
                clock.clone(),
            );
            if let Some(warm) = &warm_workers {
                let (bucket, warm) = (bucket.clone(), warm.clone());
                actix_web::rt::spawn(async move { bucket.warm_up(control_timeout, &warm).await });
            }
            Coalesced::start(bucket, metrics.clone(), cluster, limits)
        });
        Worker::new(
            state.clone(),
            Limiter::new(store, core.clone()),
            Forwarder::new(
                &upstream,
                upstream_tls.clone(),
                client,
                &routes,
                &clock,
                metrics.clone(),
            ),
            &upstream,
        )
    })
    .context("cannot start the proxy workers")?;
    Ok((proxy, warm))
}

/// The listener's certificate, reloaded as configured; `None` without TLS.
fn listener_tls(config: &Config) -> anyhow::Result<Option<Arc<ListenerTls>>> {
    let Some(files) = &config.server.tls else {
        return Ok(None);
    };
    let tls = Arc::new(
        ListenerTls::load(&files.cert, &files.key)
            .context("cannot load the listener's certificate")?,
    );
    tls.clone().watch(files.reload);
    Ok(Some(tls))
}

/// The admin server on `socket`: one worker, its own signals off (the
/// gateway's shutdown stops it).
///
/// # Errors
/// When the socket cannot be served.
pub(super) fn admin(
    config: &Config,
    base: &Base,
    parts: (&RulesHandle, &SharesHandle, &Arc<LimiterCore>),
    warm: Option<Arc<WarmWorkers>>,
    socket: TcpListener,
) -> anyhow::Result<actix_web::dev::Server> {
    let (rules, shares, limiter) = parts;
    let state = web::Data::new(AdminState {
        prometheus: base.prometheus.clone(),
        rules: rules.clone(),
        limiter: limiter.clone(),
        instance_id: config.instance.id.clone(),
        region: config.instance.region.clone(),
        shares: shares.clone(),
        token: config.admin.token.clone(),
        read_token: config.admin.read_token.clone(),
        routes: config.rules.routes.clone(),
        warm,
    });
    Ok(HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .configure(admin::configure)
    })
    .workers(1)
    .shutdown_timeout(1)
    .disable_signals()
    .listen(socket)?
    .run())
}
