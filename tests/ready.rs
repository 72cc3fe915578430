//! `/ready` tells the truth without traffic, and ready means ready: Redis
//! is marked down within a couple of seconds of becoming unreachable (at
//! start too) and up again when it answers, with no request sent; once a
//! gateway says ready, its first decisions are shared ones.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{
    Gateway, GatewayConfig, RedisCluster, Stack, TempDir, Upstream, eventually, get, ready,
    refused_port,
};

/// `/ready`'s `redis` field becomes `state` within `within`, with no
/// traffic at all.
async fn redis_becomes(gw: &Gateway, state: &str, within: Duration) -> bool {
    eventually(within, || async { ready(gw).await["redis"] == state }).await
}

#[actix_web::test]
async fn redis_is_marked_down_and_up_again_without_traffic() {
    let mut s = Stack::start("ready-probe", "", |c, _| {
        c.extra.push_str("[breaker]\ncooldown_ms = 500\n");
    });
    assert_eq!(ready(&s.gw).await["redis"], "up");
    s.redis.kill();
    assert!(
        redis_becomes(&s.gw, "down", Duration::from_secs(3)).await,
        "/ready still says {} with Redis gone",
        ready(&s.gw).await
    );
    assert_eq!(ready(&s.gw).await["status"], "ready", "it serves locally");
    s.redis.restart();
    assert!(
        redis_becomes(&s.gw, "up", Duration::from_secs(3)).await,
        "/ready still says {} with Redis back",
        ready(&s.gw).await
    );
}

#[actix_web::test]
async fn a_gateway_started_without_redis_is_ready_with_redis_down() {
    let up = Upstream::start();
    let dir = TempDir::new("ready-no-redis");
    let nothing = format!("redis://127.0.0.1:{}", refused_port());
    // Gateway::start waits for /ready to answer 200.
    let gw = Gateway::start(&GatewayConfig::new(
        &nothing,
        dir.file("rules.toml", ""),
        &up.url(),
    ));
    let answer = ready(&gw).await;
    assert_eq!(answer["redis"], "down", "{answer}");
    assert_eq!(answer["redis_workers_warm"], 0, "{answer}");
    assert_eq!(
        get(&gw.url("/x"), Some("t")).await.0,
        200,
        "decided locally"
    );
}

/// The first requests after start are decided by Redis: no failed call,
/// and their bucket exists in Redis.
async fn first_decisions_are_shared(gw: &Gateway, bucket_exists: impl Fn() -> bool) {
    let answer = ready(gw).await;
    assert_eq!(answer["status"], "ready");
    assert_eq!(answer["redis_workers_warm"], 2, "{answer}");
    for _ in 0..3 {
        assert_eq!(get(&gw.url("/first"), Some("first-tenant")).await.0, 200);
    }
    let answer = ready(gw).await;
    assert_eq!(answer["redis_failures"], 0, "{answer}");
    assert!(bucket_exists(), "the decisions did not reach Redis");
}

#[actix_web::test]
async fn after_ready_the_first_decisions_on_one_server_are_shared() {
    let s = Stack::start("ready-single", "", |config, _| {
        config.redis_timeout_ms = 5;
        config.extra = "[default_rule]\ncapacity = 10\nrefill_per_second = 1\n".into();
    });
    first_decisions_are_shared(&s.gw, || {
        s.redis.cmd(&["EXISTS", "rl2:{first-tenant}:api"]).trim() == ":1"
    })
    .await;
}

#[actix_web::test]
async fn after_ready_the_first_decisions_on_a_fresh_cluster_are_shared() {
    let cluster = RedisCluster::start();
    let up = Upstream::start();
    let dir = TempDir::new("ready-cluster");
    let mut config = GatewayConfig::new("", dir.file("rules.toml", ""), &up.url());
    config.cluster_nodes = cluster.seeds();
    config.redis_timeout_ms = 5;
    config.extra = "[default_rule]\ncapacity = 10\nrefill_per_second = 1\n".into();
    let gw = Gateway::start(&config);
    first_decisions_are_shared(&gw, || cluster.exists("rl2:{first-tenant}:api")).await;
}
