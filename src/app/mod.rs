//! Composition root: builds every part, starts them in order, serves, and
//! shuts down gracefully.
//!
//! Owns startup order (telemetry → rules → regions and shares → Redis
//! client, membership, topology watcher and breaker → limiter →
//! rebalancer → scheduled jobs → proxy and admin listeners), which [`run`]
//! reads as a list of the steps in `start`, and shutdown order (stop
//! accepting, drain in-flight requests, stop jobs). [`run`] takes its
//! listeners and shutdown signal as arguments, so tests bind port 0 and stop
//! a gateway whenever they like.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio_cron_scheduler::{Job, JobScheduler};

use crate::bucket::LimiterCore;
use crate::config::Config;
use crate::region;
use crate::region::shares::SharesHandle;
use crate::rules::RulesHandle;
use crate::telemetry::{ClientNoise, Entry};

mod checks;
mod listeners;
mod start;

pub use checks::check;
pub use listeners::Listeners;

/// Period of metric upkeep and local-bucket eviction.
const HOUSEKEEPING_PERIOD: Duration = Duration::from_secs(5);

/// Applies the SQL migrations to the database at `url`.
///
/// # Errors
/// When the database is unreachable or a migration fails.
pub async fn migrate(url: &str) -> Result<(), crate::db::DbError> {
    crate::db::Database::connect_lazy(url)?.migrate().await
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
    let base = start::base(&config);
    let rules = start::rules(&config, &base).await?;
    let (region, shares) = start::region(&config, &base, &rules)?;
    let shared = start::redis(&config, &base, &region)?;
    let limiter = start::limiter(&config, &base, &shared);
    let rebalancer = start::rebalancer(&config, &base, &region, &shares);
    let mut scheduler = schedule(&config, &base, (&rules, &shares, &limiter), rebalancer).await?;
    let addresses = Addresses::of(&listeners)?;
    let mut sockets = vec![(listeners.proxy, Entry::Proxy)];
    sockets.extend(listeners.rls.map(|l| (l, Entry::Rls)));
    sockets.extend(listeners.check.map(|l| (l, Entry::Check)));
    let parts = (&rules, &shares, &limiter);
    let (proxy, warm) = start::proxy(&config, &base, parts, &shared, sockets)?;
    let admin = start::admin(&config, &base, parts, warm, listeners.admin)?;
    let admin_handle = admin.handle();
    let admin_task = actix_web::rt::spawn(admin);
    addresses.announce(&config);
    actix_web::rt::spawn(checks::warn_unreachable_upstreams(
        config.routes.clone(),
        config.upstream.connect_timeout,
    ));

    shutdown.await;
    tracing::info!("Shutting down: draining in-flight requests.");
    proxy.stop().await;
    admin_handle.stop(true).await;
    let _ = admin_task.await;
    if let Err(e) = scheduler.shutdown().await {
        tracing::warn!(error = %e, "Scheduled jobs did not stop cleanly.");
    }
    shared.membership.leave().await;
    shares.shutdown().await;
    rules.shutdown().await;
    tracing::info!("Stopped.");
    Ok(())
}

/// Where a gateway serves, as its start-up line names it.
struct Addresses {
    proxy: SocketAddr,
    admin: SocketAddr,
    /// The rate limit service's, or "off".
    rls: String,
    /// The check listener's, or "off".
    check: String,
}

impl Addresses {
    /// The addresses `listeners` are bound to.
    fn of(listeners: &Listeners) -> std::io::Result<Self> {
        let shown = |addr: Option<SocketAddr>| addr.map_or("off".to_owned(), |a| a.to_string());
        Ok(Self {
            proxy: listeners.proxy_addr()?,
            admin: listeners.admin_addr()?,
            rls: shown(listeners.rls_addr()),
            check: shown(listeners.check_addr()),
        })
    }

    /// Says that the gateway is serving, and where.
    fn announce(&self, config: &Config) {
        tracing::info!(
            instance = %config.instance.id,
            proxy = %self.proxy,
            admin = %self.admin,
            rls = %self.rls,
            check = %self.check,
            routes = config.routes.len(),
            "tollgate is serving."
        );
    }
}

/// Starts the periodic jobs: the full rule and share reload (safety net
/// behind file watching and `NOTIFY`), housekeeping (metric upkeep,
/// local-bucket eviction, the client-noise summary), and the rebalancer's
/// rounds.
async fn schedule(
    config: &Config,
    base: &start::Base,
    parts: (&RulesHandle, &SharesHandle, &Arc<LimiterCore>),
    rebalancer: Option<actix::Addr<region::rebalancer::Rebalancer>>,
) -> anyhow::Result<JobScheduler> {
    let (rules, shares, limiter) = parts;
    let (prometheus, clock) = (&base.prometheus, &base.clock);
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
