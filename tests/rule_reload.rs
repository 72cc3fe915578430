//! A changed rules file takes effect without a restart; an invalid one is
//! refused and the previous rules stay.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{
    Gateway, GatewayConfig, RedisServer, TempDir, Upstream, client, header, metric, ready,
};

fn rules(capacity: u32) -> String {
    format!(
        "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\ncapacity = {capacity}\nrefill_per_second = 1\n"
    )
}

async fn limit_header(gw: &Gateway) -> Option<String> {
    let res = client()
        .get(gw.url("/r"))
        .insert_header(("x-api-key", "acme"))
        .send()
        .await
        .unwrap();
    header(&res, "x-ratelimit-limit")
}

#[actix_web::test]
async fn a_changed_rules_file_applies_within_two_seconds_and_a_broken_one_is_refused() {
    let redis = RedisServer::start();
    let up = Upstream::start();
    let dir = TempDir::new("reload");
    let path = dir.file("rules.toml", &rules(5));
    // Default watch interval (1 s): the 2 s promise must hold with defaults.
    let gw = Gateway::start(&GatewayConfig::new(&redis.url(), path.clone(), &up.url()));
    assert_eq!(limit_header(&gw).await.as_deref(), Some("5"));

    std::fs::write(&path, rules(12)).unwrap();
    let clock = tollgate::clock::SystemClock::new();
    let started = tollgate::clock::Clock::now_ms(&clock);
    let mut applied = false;
    while tollgate::clock::Clock::now_ms(&clock) - started < 2_000 {
        if limit_header(&gw).await.as_deref() == Some("12") {
            applied = true;
            break;
        }
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(applied, "the new capacity was not in force within 2 s");
    assert_eq!(ready(&gw).await["rules"]["count"], 1);

    std::fs::write(
        &path,
        "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\ncapacity = -3\nrefill_per_second = 1\n",
    )
    .unwrap();
    actix_web::rt::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(
        limit_header(&gw).await.as_deref(),
        Some("12"),
        "a broken file must not apply"
    );
    let failures = metric(&gw, "tollgate_rule_reloads_total{result=\"error\"}").await;
    assert!(failures >= 1.0, "reload failures are counted");
}
