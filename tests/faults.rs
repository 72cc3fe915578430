//! Redis failures with real processes: a server paused with SIGSTOP, killed
//! and restarted empty, and a Redis Cluster losing a master. In every case
//! clients get only 200/429, the fallback enforces about 1/N of the limit
//! per instance, the breaker opens and closes, and limits are Redis-backed
//! again after recovery.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{
    Fleet, Gateway, GatewayConfig, RedisCluster, RedisServer, Stack, TempDir, assert_limit_becomes,
    client, eventually, get, get_as, limit_of, ready,
};
use tollgate::clock::{Clock, SystemClock};

/// Limit of every tenant: 20 tokens, refilled slowly so counts are exact.
const CAPACITY: u32 = 20;

/// Fast failure detection: Redis calls bounded at 100 ms, a breaker that
/// opens after 3 failures for 3 s, and heartbeats every 200 ms.
fn fast_detection(_: usize, config: &mut GatewayConfig, _: &TempDir) {
    config.redis_timeout_ms = 100;
    config.extra = format!(
        "[default_rule]\ncapacity = {CAPACITY}\nrefill_per_second = 1\n\
         [breaker]\nfailure_threshold = 3\ncooldown_ms = 3000\n\
         [instance]\nheartbeat_ms = 200\n"
    );
}

/// Waits until `field` of `/ready` equals `value` on every gateway, all
/// within `within`.
async fn all_ready(gateways: &[Gateway], field: &str, value: serde_json::Value, within: Duration) {
    let clock = SystemClock::new();
    for (i, gw) in gateways.iter().enumerate() {
        let left = within.saturating_sub(Duration::from_millis(clock.now_ms()));
        let became = eventually(left, || async {
            // Traffic feeds the breaker too (besides its own probes).
            get(&gw.url("/probe"), Some("prober")).await;
            ready(gw).await[field] == value
        })
        .await;
        assert!(
            became,
            "gateway {i}: /ready {field} never became {value}: {}",
            ready(gw).await
        );
    }
}

/// Sends `n` requests for `tenant`; every answer must be 200 or 429.
/// Returns how many were admitted.
async fn burst(gw: &Gateway, tenant: &str, n: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..n {
        let (status, _) = get(&gw.url("/burst"), Some(tenant)).await;
        assert!(
            status == 200 || status == 429,
            "status {status} during a Redis fault"
        );
        admitted += usize::from(status == 200);
    }
    admitted
}

/// Healthy start: both instances see each other and limits are shared.
async fn healthy(gateways: &[Gateway]) {
    all_ready(gateways, "live_instances", 2.into(), Duration::from_secs(5)).await;
    all_ready(gateways, "breaker", "closed".into(), Duration::from_secs(5)).await;
    let shared = burst(&gateways[0], "before", 15).await + burst(&gateways[1], "before", 15).await;
    assert_eq!(
        shared, CAPACITY as usize,
        "one shared bucket across both gateways"
    );
}

/// During the fault: the breaker opens (every primary's, on a Cluster
/// that refuses every slot once one is lost), each instance holds 1/N,
/// and no request waits on Redis any more.
async fn degraded(gateways: &[Gateway], tenant: &str) {
    all_ready(gateways, "redis", "down".into(), Duration::from_secs(5)).await;
    for gw in gateways {
        assert_eq!(ready(gw).await["breaker"], "open");
        assert_eq!(
            limit_of(gw, tenant).await.as_deref(),
            Some("10"),
            "1/N of 20 with N = 2"
        );
    }
    // limit_of took one token on each gateway; 9 are left on each.
    for gw in gateways {
        let admitted = burst(gw, tenant, 15).await;
        assert!(
            (9..=10).contains(&admitted),
            "local share admitted {admitted}"
        );
    }
    // The cool-down (3 s) outlasts this phase: the breaker of the gateway
    // that opened last is still open, and its own failure count must not
    // move.
    let gw = &gateways[1];
    let failures = ready(gw).await["redis_failures"].as_u64().unwrap();
    burst(gw, "open-breaker", 10).await;
    let after = ready(gw).await;
    assert_eq!(after["breaker"], "open", "{after}");
    assert_eq!(
        after["redis_failures"].as_u64().unwrap(),
        failures,
        "no request calls Redis while the breaker is open"
    );
}

/// After recovery: the breaker closes and limits are shared again.
async fn recovered(gateways: &[Gateway]) {
    all_ready(
        gateways,
        "breaker",
        "closed".into(),
        Duration::from_secs(10),
    )
    .await;
    for gw in gateways {
        // Limits are Redis-backed again.
        assert_limit_becomes(gw, "after", "20", Duration::from_secs(2)).await;
    }
    let shared = burst(&gateways[0], "after-shared", 15).await
        + burst(&gateways[1], "after-shared", 15).await;
    assert_eq!(shared, CAPACITY as usize);
}

#[actix_web::test]
async fn a_paused_redis_opens_the_breaker_and_its_return_closes_it() {
    let fleet = Fleet::on(RedisServer::start(), "faults", 2, "", fast_detection);
    healthy(&fleet.gateways).await;

    fleet.redis.pause();
    degraded(&fleet.gateways, "paused").await;
    fleet.redis.resume();

    recovered(&fleet.gateways).await;
}

#[actix_web::test]
async fn a_killed_redis_restarted_empty_serves_full_buckets_again() {
    let mut fleet = Fleet::on(RedisServer::start(), "faults", 2, "", fast_detection);
    healthy(&fleet.gateways).await;
    assert_eq!(
        get(&fleet.gateways[0].url("/x"), Some("before")).await.0,
        429,
        "bucket empty"
    );

    fleet.redis.kill();
    degraded(&fleet.gateways, "killed").await;
    fleet.redis.restart();

    recovered(&fleet.gateways).await;
    // The restarted server lost every bucket and every script: the emptied
    // bucket comes back full, and the script is reloaded on NOSCRIPT. (The
    // over-limit cache honours the last rejection's retry delay, at most 1 s
    // at 1 token/s, so wait that out first.)
    // Rejections from the cache take no token, so the first admission
    // shows the full bucket minus its own token.
    let gw = &fleet.gateways[0];
    let first_admission = std::cell::RefCell::new(None);
    let admitted = eventually(Duration::from_secs(3), || async {
        let (status, remaining) = get(&gw.url("/x"), Some("before")).await;
        *first_admission.borrow_mut() = Some(remaining);
        status == 200
    })
    .await;
    assert!(admitted, "the emptied bucket never admitted again");
    assert_eq!(
        first_admission.into_inner().flatten().as_deref(),
        Some("19")
    );
    assert!(fleet.redis.command_calls("script|load") >= 1);
}

/// Without replicas, a Cluster that loses a primary refuses every slot
/// (`CLUSTERDOWN`, as `cluster-require-full-coverage` defaults to yes):
/// every primary's breaker opens, and each closes again once the Cluster
/// serves.
#[actix_web::test]
async fn a_cluster_losing_a_master_falls_back_and_recovers() {
    let mut fleet = Fleet::on(RedisCluster::start(), "faults", 2, "", fast_detection);
    healthy(&fleet.gateways).await;

    fleet.redis.nodes[1].kill();
    degraded(&fleet.gateways, "cluster-down").await;
    fleet.redis.nodes[1].restart();
    fleet.redis.wait_healthy();

    recovered(&fleet.gateways).await;
    let c = client();
    let res = get_as(&c, &fleet.gateways[0].url("/x"), "tagged").await;
    assert_eq!(res.status(), 200);
    let owner = fleet
        .redis
        .nodes
        .iter()
        .filter(|n| n.cmd(&["EXISTS", "rl2:{tagged}:api"]).trim() == ":1")
        .count();
    assert_eq!(
        owner, 1,
        "the bucket lives on exactly one master, under its hash tag"
    );
}

/// A tenant whose bucket key Redis cannot use (here it holds a hash, as a
/// share below the floor once made the expiry overflow) must not send
/// the other decisions that shared its calls to the fallback, nor count
/// against Redis's health.
#[actix_web::test]
async fn a_key_redis_refuses_fails_alone_and_the_breaker_stays_closed() {
    let s = Stack::start("refused-key", "", |config, _| {
        // One worker: every decision goes through one bucket client, so
        // concurrent decisions share its calls.
        config.workers = 1;
        config.extra = format!(
            "[default_rule]\ncapacity = {CAPACITY}\nrefill_per_second = 1\n\
             [breaker]\nfailure_threshold = 3\ncooldown_ms = 3000\n"
        );
    });
    let (redis, gw) = (&s.redis, &s.gw);
    redis.cmd(&["HSET", "rl2:{poison}:api", "tokens", "1"]);
    let refused_series = "tollgate_redis_errors_total{kind=\"refused\"}";
    let refused_before = common::metric(gw, refused_series).await.unwrap();

    // Rounds of one request from each of 35 tenants and five from the
    // poisoned one, all at once.
    for round in 0..3 {
        let requests = (0..40).map(|i| {
            let tenant = if i % 8 == 0 {
                "poison".to_owned()
            } else {
                format!("t{i}")
            };
            let url = gw.url("/x");
            async move { (get(&url, Some(&tenant)).await.0, tenant) }
        });
        for (status, tenant) in futures_util::future::join_all(requests).await {
            assert_eq!(status, 200, "{tenant}, round {round}");
        }
    }
    // Every other tenant's bucket is in Redis, charged three tokens.
    for i in (0..40).filter(|i| i % 8 != 0) {
        let key = format!("rl2:{{t{i}}}:api");
        assert!(
            redis.cmd(&["EXISTS", &key]).contains(":1"),
            "{key} was decided without Redis"
        );
        let (_, remaining) = get(&gw.url("/x"), Some(&format!("t{i}"))).await;
        let remaining: u32 = remaining.unwrap().parse().unwrap();
        assert!(
            (16..=18).contains(&remaining),
            "t{i}: {remaining} left of 20 after 4 requests"
        );
    }
    assert!(redis.cmd(&["TYPE", "rl2:{poison}:api"]).contains("hash"));
    let after = ready(gw).await;
    assert_eq!(after["breaker"], "closed", "{after}");
    assert_eq!(after["redis"], "up", "{after}");
    let refused = common::metric(gw, refused_series).await.unwrap();
    assert!(
        refused - refused_before >= 3.0,
        "refused decisions are counted: {refused} - {refused_before}"
    );
}
