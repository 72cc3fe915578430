//! Hot keys with several gateway instances: leases cut Redis calls and keep
//! the limit, a spamming tenant costs one Redis call per retry interval,
//! exact mode never over-admits, and sharded rules spread over sub-buckets.
//! Tolerances are wide enough for a busy 2-core machine; the figures
//! themselves come from `scripts/accuracy`.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{Fleet, client, get_as};
use futures_util::future::join_all;
use tollgate::clock::{Clock, SystemClock};

/// `n` gateways sharing one Redis, with `rules` and no heartbeat noise in
/// Redis's call counts during a test.
fn fleet(n: usize, rules: &str) -> Fleet {
    Fleet::start("hot", n, rules, |_, config, _| {
        config.extra.push_str("[instance]\nheartbeat_ms = 60000\n");
    })
}

fn rule(tenant: &str, capacity: u32, refill: u32, extra: &str) -> String {
    format!(
        "[[rule]]\ntenant = \"{tenant}\"\nroute = \"api\"\ncapacity = {capacity}\nrefill_per_second = {refill}\n{extra}\n"
    )
}

/// What a load run saw.
struct Load {
    sent: u64,
    admitted: u64,
    elapsed_ms: u64,
}

/// `workers` concurrent loops per gateway, each sending requests for
/// `tenant` back to back for `duration`. Only 200/429 may come back.
async fn hammer(fleet: &Fleet, tenant: &str, workers: usize, duration: Duration) -> Load {
    let clock = SystemClock::new();
    let start = clock.now_ms();
    let deadline = start + duration.as_millis() as u64;
    let loops = fleet.gateways.iter().flat_map(|gw| {
        (0..workers).map(move |_| {
            let clock = SystemClock::new();
            let c = client();
            let url = gw.url("/hot");
            async move {
                let (mut sent, mut admitted) = (0u64, 0u64);
                while clock.now_ms() < deadline {
                    let status = common::status_as(&c, &url, tenant).await.unwrap();
                    assert!(status == 200 || status == 429, "status {status}");
                    sent += 1;
                    admitted += u64::from(status == 200);
                }
                (sent, admitted)
            }
        })
    });
    let results = join_all(loops).await;
    Load {
        sent: results.iter().map(|r| r.0).sum(),
        admitted: results.iter().map(|r| r.1).sum(),
        elapsed_ms: clock.now_ms() - start,
    }
}

/// Asserts `low × ideal ≤ admitted ≤ ideal + slack`.
fn assert_admitted(load: &Load, ideal: f64, low: f64, slack: f64) {
    let admitted = load.admitted as f64;
    assert!(
        admitted <= ideal + slack && admitted >= low * ideal,
        "admitted {admitted} vs ideal {ideal:.1} ({} sent in {} ms)",
        load.sent,
        load.elapsed_ms
    );
}

/// capacity + refill × elapsed.
fn ideal(capacity: u32, refill: u32, elapsed_ms: u64) -> f64 {
    f64::from(capacity) + f64::from(refill) * elapsed_ms as f64 / 1000.0
}

#[actix_web::test]
async fn leases_cut_redis_calls_and_keep_the_limit() {
    let fleet = fleet(2, &rule("hot", 20, 100, ""));
    let calls_before = fleet.redis.command_calls("evalsha");
    let load = hammer(&fleet, "hot", 6, Duration::from_secs(4)).await;
    let calls = fleet.redis.command_calls("evalsha") - calls_before;

    let ideal = ideal(20, 100, load.elapsed_ms);
    assert!(
        load.sent as f64 > 2.0 * ideal,
        "the load must exceed the limit: {} sent, ideal {ideal:.0}",
        load.sent
    );
    // Over-admission is bounded by instances × batch (2 × 10 here).
    assert_admitted(&load, ideal, 0.8, 2.0 * 10.0 + 5.0);
    let per_request = calls as f64 / load.sent as f64;
    assert!(
        per_request <= 0.2,
        "{calls} Redis calls for {} requests ({per_request:.3} per request)",
        load.sent
    );
}

/// A tenant at many times its limit (5 burst, 1/s: too slow a refill to
/// lease) through `instances` gateways costs about one Redis call per 1 s
/// retry interval per instance, and its cached rejections still carry the
/// headers.
#[actix_web::test]
async fn a_spamming_tenant_costs_one_redis_call_per_retry_interval_per_instance() {
    let instances = 2;
    let fleet = fleet(instances, &rule("spam", 5, 1, ""));
    // Drain the burst first: concurrent requests may all reach Redis
    // before the first rejection is known.
    hammer(&fleet, "spam", 4, Duration::from_millis(300)).await;
    let calls_before = fleet.redis.command_calls("evalsha");
    let load = hammer(&fleet, "spam", 4, Duration::from_millis(2_500)).await;
    let calls = fleet.redis.command_calls("evalsha") - calls_before;
    let allowed_calls = (load.elapsed_ms.div_ceil(1000) + 1) * instances as u64;
    assert!(
        load.sent >= 100,
        "the tenant spammed: {} requests",
        load.sent
    );
    assert!(
        calls <= allowed_calls,
        "{calls} Redis calls for {} requests in {} ms through {instances} gateways",
        load.sent,
        load.elapsed_ms
    );
    for gw in &fleet.gateways {
        let res = get_as(&client(), &gw.url("/hot"), "spam").await;
        assert_eq!(res.status(), 429);
        let retry: u64 = common::header(&res, "retry-after")
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(retry, 1, "cached rejections still say when to retry");
        assert_eq!(
            common::header(&res, "x-ratelimit-remaining").as_deref(),
            Some("0")
        );
    }
}

#[actix_web::test]
async fn exact_mode_never_over_admits() {
    let fleet = fleet(2, &rule("exact", 20, 100, "exact = true"));
    let load = hammer(&fleet, "exact", 6, Duration::from_secs(3)).await;
    let ideal = ideal(20, 100, load.elapsed_ms);
    assert!(
        load.sent as f64 > 2.0 * ideal,
        "{} sent, ideal {ideal:.0}",
        load.sent
    );
    assert_admitted(&load, ideal, 0.9, 1.0);
}

#[actix_web::test]
async fn sharded_rules_spread_over_untagged_sub_buckets() {
    let fleet = fleet(2, &rule("wide", 40, 1, "shards = 4\nexact = true"));
    let load = hammer(&fleet, "wide", 4, Duration::from_millis(1_500)).await;
    let ideal = ideal(40, 1, load.elapsed_ms);
    assert_admitted(&load, ideal, 0.75, 1.0);
    for i in 0..4 {
        assert_eq!(
            fleet
                .redis
                .cmd(&["EXISTS", &format!("rl2:wide:api:{i}")])
                .trim(),
            ":1",
            "sub-bucket {i} was used"
        );
    }
    assert_eq!(fleet.redis.cmd(&["EXISTS", "rl2:{wide}:api"]).trim(), ":0");
    let res = get_as(&client(), &fleet.gateways[0].url("/hot"), "wide").await;
    assert_eq!(
        common::header(&res, "x-ratelimit-limit").as_deref(),
        Some("40"),
        "the whole limit"
    );
}

/// A sharded rule refuses a request only when no sub-bucket can take it,
/// and reports an estimate of the whole limit's remaining tokens.
#[actix_web::test]
async fn a_sharded_rule_refuses_only_when_every_sub_bucket_is_empty() {
    let fleet = fleet(1, &rule("split", 16, 1, "shards = 4\nexact = true"));
    let gw = &fleet.gateways[0];
    let mut seen = Vec::new();
    for _ in 0..16 {
        let (status, remaining) = common::get(&gw.url("/s"), Some("split")).await;
        seen.push((status, remaining.unwrap().parse::<u32>().unwrap()));
    }
    // 4 sub-buckets of 4: 16 admissions whichever sub-bucket each starts at.
    assert!(seen.iter().all(|(status, _)| *status == 200), "{seen:?}");
    // The remaining count estimates the whole: the sub-bucket's × 4.
    assert_eq!(seen[0].1, 12, "{seen:?}");
    assert!(seen.iter().all(|(_, left)| left % 4 == 0), "{seen:?}");
    // Now every sub-bucket is empty (refill is 1/s over all four): refused,
    // with the soonest sub-bucket's wait.
    let res = get_as(&client(), &gw.url("/s"), "split").await;
    if res.status() == 429 {
        assert_eq!(
            common::header(&res, "x-ratelimit-remaining").as_deref(),
            Some("0")
        );
        let wait: u32 = common::header(&res, "retry-after")
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=4).contains(&wait), "Retry-After {wait}");
    } else {
        // A sub-bucket refilled a token while the 16 went through.
        assert_eq!(res.status(), 200);
    }
    for i in 0..4 {
        let key = format!("rl2:split:api:{i}");
        assert_eq!(fleet.redis.cmd(&["EXISTS", &key]).trim(), ":1", "{key}");
    }
}
