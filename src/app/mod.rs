//! Composition root: builds every part, starts them in order, serves, and
//! shuts down gracefully.
//!
//! Owns startup order (telemetry → rules → regions and shares → Redis
//! client and its topology watcher → membership and breaker actors → limiter → rebalancer →
//! scheduled jobs → proxy and admin listeners) and shutdown order (stop
//! accepting, drain in-flight requests, stop jobs). [`run`] takes its
//! listeners and shutdown signal as arguments, so tests bind port 0 and stop
//! a gateway whenever they like.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use actix_web::{App, HttpServer, web};
use anyhow::Context as _;
use tokio_cron_scheduler::{Job, JobScheduler};

use crate::admin::{self, AdminState};
use crate::breaker;
use crate::bucket::{
    BucketClient, HotKeys, Limiter, LimiterCore, LocalBuckets, RedisBucket, WarmWorkers,
};
use crate::clock::{SharedClock, SystemClock};
use crate::cluster::{LiveInstances, Membership};
use crate::config::{self, Config, RedisTarget, RouteSpec, RuleSource};
use crate::proxy::forward::Forwarder;
use crate::proxy::route::RouteTable;
use crate::proxy::server::{ProxyServer, Serving};
use crate::proxy::{self, ProxyState, Worker};
use crate::redis_client::RedisConnector;
use crate::region;
use crate::region::shares::SharesHandle;
use crate::rules::{self, RulesHandle};
use crate::telemetry::{self, ClientNoise, Entry, Metrics, RequestCounters};
use crate::tls::{ListenerTls, UpstreamTls};

mod checks;
mod listeners;

pub use checks::check;
use checks::regions;
pub use listeners::Listeners;

/// Period of metric upkeep and local-bucket eviction.
const HOUSEKEEPING_PERIOD: Duration = Duration::from_secs(5);

/// Applies the SQL migrations to the database at `url`.
///
/// # Errors
/// When the database is unreachable or a migration fails.
pub async fn migrate(url: &str) -> Result<(), rules::RuleStoreError> {
    rules::RuleStore::connect_lazy(url)?.migrate().await
}

/// Runs one gateway until `shutdown` resolves, then drains and stops.
///
/// Must run inside an actix `System` (actors need its arbiter).
///
/// # Errors
/// When the rules cannot be loaded or a listener cannot be served.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    for note in &config.notes {
        tracing::warn!(adjustment = %note, "A configured bound was adjusted.");
    }
    let prometheus = telemetry::install();
    let metrics = Metrics::new();
    let clock = SystemClock::shared();

    let mut entries = Vec::new();
    entries.extend(config.rls.as_ref().map(|_| Entry::Rls));
    entries.extend(config.check.as_ref().map(|_| Entry::Check));
    let requests = Arc::new(RequestCounters::new(
        config.routes.iter().map(|r| r.id.as_str()),
        &entries,
        config.metrics.max_tenant_labels,
    ));
    let rules = rules::cache::start(
        &config.rules,
        config.default_rule.into(),
        metrics.clone(),
        requests.clone(),
        clock.clone(),
    )
    .await?;

    let region = regions(&config).map_err(|p| anyhow::anyhow!(p.join("; ")))?;
    // A region brings its own Redis.
    let redis_settings = match &region {
        Some((this, _)) => this.redis_settings(&config.redis),
        None => config.redis.clone(),
    };
    let shares = match &region {
        Some((this, all)) => region::shares::start(
            &this.id,
            all.clone(),
            rules.store(),
            requests.clone(),
            metrics.clone(),
        ),
        None => SharesHandle::whole(),
    };
    let redis = RedisConnector::new(&redis_settings).context("cannot set up the Redis client")?;
    match &redis_settings.target {
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
    // Control-plane calls (membership, probes) may wait a little longer
    // than request-path calls.
    let control_timeout = config.redis.timeout.max(config.redis.connect_timeout);
    let live = Arc::new(LiveInstances::new(config.instance.expected_count));
    let membership = Membership::start(
        redis.as_ref().map(RedisConnector::connect),
        live.clone(),
        &config.instance.id,
        config.instance.region.as_deref(),
        config.instance.heartbeat,
        control_timeout,
        metrics.clone(),
    );
    if let Some(connector) = &redis {
        connector
            .watch(clock.clone())
            .context("cannot follow the Redis deployment")?;
    }
    let breaker = redis.as_ref().map(|connector| {
        breaker::prober::start(
            connector.topology().clone(),
            config.breaker,
            connector.connect(),
            config.instance.id.clone(),
            control_timeout,
            clock.clone(),
            metrics.clone(),
        );
        connector.topology().clone()
    });
    let limiter = Arc::new(LimiterCore::new(
        LocalBuckets::new(config.fallback.max_keys, clock.clone()),
        HotKeys::new(
            config.lease,
            config.fallback.max_keys,
            clock.clone(),
            metrics.clone(),
        ),
        live,
        breaker.clone(),
        clock.clone(),
        metrics.clone(),
    ));

    // The rebalancer writes shares: it needs regions and a database.
    let rebalancer = match (&region, shares.store(), &config.rules.source) {
        (Some((_, all)), Some(store), RuleSource::Database(url)) if config.rebalancer.enabled => {
            Some(region::rebalancer::start(
                config.rebalancer.clone(),
                all.clone(),
                store.clone(),
                url.clone(),
                config.instance.id.clone(),
                requests.clone(),
                metrics.clone(),
            ))
        }
        _ => None,
    };
    let mut scheduler = schedule(
        &config,
        &rules,
        &shares,
        &limiter,
        &prometheus,
        rebalancer,
        &clock,
    )
    .await?;

    let proxy_addr = listeners.proxy_addr()?;
    let admin_addr = listeners.admin_addr()?;
    let shown =
        |addr: Option<std::net::SocketAddr>| addr.map_or("off".to_owned(), |a| a.to_string());
    let (rls_addr, check_addr) = (shown(listeners.rls_addr()), shown(listeners.check_addr()));
    let proxy_state = Arc::new(ProxyState {
        routes: RouteTable::new(&config.routes),
        rules: rules.clone(),
        shares: shares.clone(),
        metrics: metrics.clone(),
        requests,
        clock: clock.clone(),
        shadow: config.shadow,
        access: config
            .log
            .access_sample_percent
            .map(proxy::access::AccessLog::new),
        rls: config.rls.clone(),
        check: config.check,
    });
    let upstream = config.upstream.clone();
    let client = config.client;
    let routes = config.routes.clone();
    let request_timeout = redis_settings.timeout;
    let max_keys_per_call = redis_settings.max_keys_per_call;
    let cluster = matches!(redis_settings.target, RedisTarget::Cluster(_));
    let warm = redis
        .as_ref()
        .map(|_| Arc::new(WarmWorkers::new(config.server.workers)));
    let warm_workers = warm.clone();
    let core = limiter.clone();
    let listener_tls = match &config.server.tls {
        Some(files) => {
            let tls = Arc::new(
                ListenerTls::load(&files.cert, &files.key)
                    .context("cannot load the listener's certificate")?,
            );
            tls.clone().watch(files.reload);
            Some(tls)
        }
        None => None,
    };
    let upstream_tls = if routes.iter().any(RouteSpec::is_tls) {
        Some(
            UpstreamTls::new(upstream.ca_file.as_deref())
                .context("cannot load the CA certificates for https:// upstreams")?,
        )
    } else {
        None
    };
    let serving = Serving {
        workers: config.server.workers,
        header_timeout: config.client.header_timeout,
        grace: config.server.shutdown_timeout,
        h2c: config.server.h2c,
        tls: listener_tls,
    };
    let mut listening = vec![(listeners.proxy, Entry::Proxy)];
    listening.extend(listeners.rls.map(|l| (l, Entry::Rls)));
    listening.extend(listeners.check.map(|l| (l, Entry::Check)));
    let proxy = ProxyServer::start(listening, serving, move || {
        // Per worker: its own upstream pool and Redis connection, warmed
        // (connected, script loaded) before the gateway says it is ready.
        // Its bucket client (an actor on this worker) coalesces the
        // worker's decisions into shared script calls.
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
            BucketClient::start(bucket, metrics.clone(), cluster, max_keys_per_call)
        });
        Worker {
            state: proxy_state.clone(),
            limiter: Limiter::new(store, core.clone()),
            forwarder: Forwarder::new(
                &upstream,
                upstream_tls.clone(),
                client,
                &routes,
                &clock,
                metrics.clone(),
            ),
        }
    })
    .context("cannot start the proxy workers")?;

    let admin_state = web::Data::new(AdminState {
        prometheus,
        rules: rules.clone(),
        limiter,
        instance_id: config.instance.id.clone(),
        region: config.instance.region.clone(),
        shares: shares.clone(),
        token: config.admin.token.clone(),
        read_token: config.admin.read_token.clone(),
        routes: config.rules.routes.clone(),
        warm,
    });
    let admin = HttpServer::new(move || {
        App::new()
            .app_data(admin_state.clone())
            .configure(admin::configure)
    })
    .workers(1)
    .shutdown_timeout(1)
    .disable_signals()
    .listen(listeners.admin)?
    .run();

    let admin_handle = admin.handle();
    let admin_task = actix_web::rt::spawn(admin);
    tracing::info!(
        instance = %config.instance.id,
        proxy = %proxy_addr,
        admin = %admin_addr,
        rls = %rls_addr,
        check = %check_addr,
        routes = config.routes.len(),
        "tollgate is serving."
    );

    shutdown.await;
    tracing::info!("Shutting down: draining in-flight requests.");
    proxy.stop().await;
    admin_handle.stop(true).await;
    let _ = admin_task.await;
    if let Err(e) = scheduler.shutdown().await {
        tracing::warn!(error = %e, "Scheduled jobs did not stop cleanly.");
    }
    membership.leave().await;
    shares.shutdown().await;
    rules.shutdown().await;
    tracing::info!("Stopped.");
    Ok(())
}

/// Starts the periodic jobs: the full rule and share reload (safety net
/// behind file watching and `NOTIFY`), housekeeping (metric upkeep,
/// local-bucket eviction, the client-noise summary), and the rebalancer's
/// rounds.
async fn schedule(
    config: &Config,
    rules: &RulesHandle,
    shares: &SharesHandle,
    limiter: &Arc<LimiterCore>,
    prometheus: &metrics_exporter_prometheus::PrometheusHandle,
    rebalancer: Option<actix::Addr<region::rebalancer::Rebalancer>>,
    clock: &SharedClock,
) -> anyhow::Result<JobScheduler> {
    let scheduler = JobScheduler::new().await?;

    if let Some(rebalancer) = rebalancer {
        tracing::info!(
            every_seconds = config.rebalancer.interval.as_secs(),
            prometheus = %config.rebalancer.prometheus_url,
            "Region rebalancing is on."
        );
        scheduler
            .add(Job::new_repeated_async(
                config.rebalancer.interval,
                move |_, _| {
                    let rebalancer = rebalancer.clone();
                    Box::pin(async move {
                        let round = rebalancer.send(region::rebalancer::Round);
                        if tokio::time::timeout(Duration::from_secs(5), round)
                            .await
                            .is_err()
                        {
                            tracing::warn!("The rebalancer did not take the round in time.");
                        }
                    })
                },
            )?)
            .await?;
    }

    let (rules, shares) = (rules.clone(), shares.clone());
    scheduler
        .add(Job::new_repeated_async(config.rules.refresh, move |_, _| {
            let (rules, shares) = (rules.clone(), shares.clone());
            Box::pin(async move {
                match rules.reload().await {
                    Ok(n) => tracing::debug!(rules = n, "Periodic rule reload done."),
                    Err(e) => tracing::error!(error = %e, "Periodic rule reload failed; the previous rules stay in force."),
                }
                shares.reload().await;
            })
        })?)
        .await?;

    let (limiter, prometheus, clock) = (limiter.clone(), prometheus.clone(), clock.clone());
    let noise = Arc::new(Mutex::new(ClientNoise::new()));
    scheduler
        .add(Job::new_repeated_async(
            HOUSEKEEPING_PERIOD,
            move |_, _| {
                let (limiter, prometheus, noise, clock) = (
                    limiter.clone(),
                    prometheus.clone(),
                    noise.clone(),
                    clock.clone(),
                );
                Box::pin(async move {
                    prometheus.run_upkeep();
                    limiter.sweep_local();
                    noise
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .report(clock.now_ms());
                })
            },
        )?)
        .await?;

    scheduler.start().await?;
    Ok(scheduler)
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        ) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "Cannot watch SIGTERM; only Ctrl-C stops the gateway.");
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
