//! PostgreSQL outages: the gateway keeps serving with the rules it has,
//! starts from its saved snapshot, and resynchronises when the database
//! returns. Each test runs its own throwaway cluster, stopped and started
//! for real.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{
    Gateway, GatewayConfig, PgCluster, RedisServer, TempDir, Upstream, get, limit_of, ready,
    wait_for_limit, wait_until,
};

fn config(
    redis: &RedisServer,
    up: &Upstream,
    db_url: &str,
    snapshot: &std::path::Path,
) -> GatewayConfig {
    let mut config = GatewayConfig::new(&redis.url(), snapshot.with_extension("unused"), &up.url());
    config.database_url = db_url.to_owned();
    config.rules_extra = format!(
        "snapshot_file = \"{}\"\nrefresh_seconds = 1",
        snapshot.display()
    );
    config
}

async fn rule_source(gw: &Gateway) -> String {
    ready(gw).await["rules"]["source"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

#[actix_web::test]
async fn postgres_stopped_and_restarted_keeps_traffic_flowing_and_resyncs() {
    let pg = PgCluster::start();
    let (redis, up, dir) = (
        RedisServer::start(),
        Upstream::start(),
        TempDir::new("outage"),
    );
    let gw = Gateway::start(&config(&redis, &up, &pg.url(), &dir.0.join("snap.json")));
    pg.sql("INSERT INTO rate_limit_rule (tenant_id, route_id, capacity, refill_per_second) VALUES ('t', 'api', 50, 50)");
    assert!(
        wait_for_limit(&gw, "t", "50", Duration::from_secs(1))
            .await
            .is_some()
    );

    pg.stop();
    // Keep serving until a periodic reload has failed (each attempt waits
    // up to the pool's 2 s acquire timeout).
    let clock = tollgate::clock::SystemClock::new();
    let start = tollgate::clock::Clock::now_ms(&clock);
    loop {
        let (status, _) = get(&gw.url("/x"), Some("t")).await;
        assert_eq!(
            status, 200,
            "requests keep being served while PostgreSQL is down"
        );
        // This gateway's own count: the metric is shared by every gateway
        // of the test process.
        if ready(&gw).await["rules"]["failed_reloads"].as_u64() >= Some(1) {
            break;
        }
        assert!(
            tollgate::clock::Clock::now_ms(&clock) - start < 8_000,
            "no failed reload was counted while PostgreSQL was down"
        );
        actix_web::rt::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        limit_of(&gw, "t").await.as_deref(),
        Some("50"),
        "the last rules stay in force"
    );

    pg.resume();
    // A change made the moment the database is back, possibly before the
    // gateway listens again: the resync on reconnect must pick it up.
    pg.sql("UPDATE rate_limit_rule SET capacity = 60 WHERE tenant_id = 't'");
    assert!(
        wait_for_limit(&gw, "t", "60", Duration::from_secs(10))
            .await
            .is_some(),
        "the new state was not picked up after PostgreSQL returned"
    );
    pg.sql("UPDATE rate_limit_rule SET capacity = 61 WHERE tenant_id = 't'");
    assert!(
        wait_for_limit(&gw, "t", "61", Duration::from_secs(1))
            .await
            .is_some(),
        "changes propagate within 1 s again"
    );
}

#[actix_web::test]
async fn a_gateway_started_while_postgres_is_down_serves_its_saved_snapshot() {
    let pg = PgCluster::start();
    let (redis, up, dir) = (
        RedisServer::start(),
        Upstream::start(),
        TempDir::new("snapshot"),
    );
    let snapshot = dir.0.join("state/snap.json");
    {
        let first = Gateway::start(&config(&redis, &up, &pg.url(), &snapshot));
        pg.sql("INSERT INTO rate_limit_rule (tenant_id, route_id, capacity, refill_per_second) VALUES ('saved', 'api', 33, 1)");
        assert!(
            wait_for_limit(&first, "saved", "33", Duration::from_secs(1))
                .await
                .is_some()
        );
        assert!(
            wait_until(Duration::from_secs(5), || std::fs::read_to_string(
                &snapshot
            )
            .is_ok_and(|s| s.contains("saved"))),
            "the snapshot on disk holds the rule"
        );
    }

    pg.stop();
    let second = Gateway::start(&config(&redis, &up, &pg.url(), &snapshot));
    assert_eq!(limit_of(&second, "saved").await.as_deref(), Some("33"));
    assert_eq!(rule_source(&second).await, "snapshot");
    assert_eq!(get(&second.url("/x"), Some("saved")).await.0, 200);

    let without = Gateway::start(&config(&redis, &up, &pg.url(), &dir.0.join("missing.json")));
    assert_eq!(
        limit_of(&without, "saved").await.as_deref(),
        Some("2"),
        "default rule"
    );
    assert_eq!(rule_source(&without).await, "default");

    pg.resume();
    assert!(
        wait_for_limit(&without, "saved", "33", Duration::from_secs(10))
            .await
            .is_some()
    );
    assert_eq!(rule_source(&without).await, "database");
}
