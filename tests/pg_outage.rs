//! PostgreSQL outages: the gateway keeps serving with the rules it has,
//! starts from its saved snapshot, and resynchronises when the database
//! returns. Each test runs its own throwaway cluster, stopped and started
//! for real.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{
    Gateway, GatewayConfig, PgCluster, RedisServer, TempDir, Upstream, assert_limit_becomes,
    eventually, get, limit_of, ready, wait_until,
};

/// A throwaway PostgreSQL cluster, a Redis and the mock upstream, for
/// gateways whose rules come from the cluster.
struct Outage {
    // Dropped in this order: the directory first, the cluster last.
    dir: TempDir,
    up: Upstream,
    redis: RedisServer,
    pg: PgCluster,
}

impl Outage {
    fn start(tag: &str) -> Self {
        let pg = PgCluster::start();
        let (redis, up, dir) = (RedisServer::start(), Upstream::start(), TempDir::new(tag));
        Self { dir, up, redis, pg }
    }

    /// A gateway on the cluster that saves its rules to `snapshot`.
    fn gateway(&self, snapshot: &std::path::Path) -> Gateway {
        let mut config = GatewayConfig::new(
            &self.redis.url(),
            snapshot.with_extension("unused"),
            &self.up.url(),
        );
        config.database_url = self.pg.url();
        config.rules_extra = format!(
            "snapshot_file = \"{}\"\nrefresh_seconds = 1",
            snapshot.display()
        );
        Gateway::start(&config)
    }
}

async fn rule_source(gw: &Gateway) -> String {
    ready(gw).await["rules"]["source"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

#[actix_web::test]
async fn postgres_stopped_and_restarted_keeps_traffic_flowing_and_resyncs() {
    let outage = Outage::start("outage");
    let (pg, gw) = (&outage.pg, outage.gateway(&outage.dir.0.join("snap.json")));
    pg.sql("INSERT INTO rate_limit_rule (tenant_id, route_id, capacity, refill_per_second) VALUES ('t', 'api', 50, 50)");
    assert_limit_becomes(&gw, "t", "50", Duration::from_secs(1)).await;

    pg.stop();
    // Keep serving until a periodic reload has failed (each attempt waits
    // up to the pool's 2 s acquire timeout).
    let failed_reload = eventually(Duration::from_secs(8), || async {
        let (status, _) = get(&gw.url("/x"), Some("t")).await;
        assert_eq!(
            status, 200,
            "requests keep being served while PostgreSQL is down"
        );
        // This gateway's own count: the metric is shared by every gateway
        // of the test process.
        ready(&gw).await["rules"]["failed_reloads"].as_u64() >= Some(1)
    })
    .await;
    assert!(
        failed_reload,
        "no failed reload was counted while PostgreSQL was down"
    );
    assert_eq!(
        limit_of(&gw, "t").await.as_deref(),
        Some("50"),
        "the last rules stay in force"
    );

    pg.resume();
    // A change made the moment the database is back, possibly before the
    // gateway listens again: the resync on reconnect must pick it up.
    pg.sql("UPDATE rate_limit_rule SET capacity = 60 WHERE tenant_id = 't'");
    assert_limit_becomes(&gw, "t", "60", Duration::from_secs(10)).await;
    pg.sql("UPDATE rate_limit_rule SET capacity = 61 WHERE tenant_id = 't'");
    // Changes propagate within 1 s again.
    assert_limit_becomes(&gw, "t", "61", Duration::from_secs(1)).await;
}

#[actix_web::test]
async fn a_gateway_started_while_postgres_is_down_serves_its_saved_snapshot() {
    let outage = Outage::start("snapshot");
    let pg = &outage.pg;
    let snapshot = outage.dir.0.join("state/snap.json");
    {
        let first = outage.gateway(&snapshot);
        pg.sql("INSERT INTO rate_limit_rule (tenant_id, route_id, capacity, refill_per_second) VALUES ('saved', 'api', 33, 1)");
        assert_limit_becomes(&first, "saved", "33", Duration::from_secs(1)).await;
        assert!(
            wait_until(Duration::from_secs(5), || std::fs::read_to_string(
                &snapshot
            )
            .is_ok_and(|s| s.contains("saved"))),
            "the snapshot on disk holds the rule"
        );
    }

    pg.stop();
    let second = outage.gateway(&snapshot);
    assert_eq!(limit_of(&second, "saved").await.as_deref(), Some("33"));
    assert_eq!(rule_source(&second).await, "snapshot");
    assert_eq!(get(&second.url("/x"), Some("saved")).await.0, 200);

    let without = outage.gateway(&outage.dir.0.join("missing.json"));
    assert_eq!(
        limit_of(&without, "saved").await.as_deref(),
        Some("2"),
        "default rule"
    );
    assert_eq!(rule_source(&without).await, "default");

    pg.resume();
    assert_limit_becomes(&without, "saved", "33", Duration::from_secs(10)).await;
    assert_eq!(rule_source(&without).await, "database");
}
