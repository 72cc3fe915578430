//! Races between callers: 1,000 parallel requests at one bucket never admit
//! more than capacity + refill × elapsed.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::num::NonZeroU32;

use common::{Gateway, RedisServer, Stack, client};
use futures_util::future::join_all;
use tollgate::bucket::{Ask, BucketSpec, RedisBucket};
use tollgate::clock::{Clock, SharedClock, SystemClock};
use tollgate::config::{RedisSettings, RedisTarget};
use tollgate::key::{BucketKey, RouteId, TenantId};
use tollgate::redis_client::RedisConnector;
use tollgate::telemetry::{self, Metrics};

fn bound(capacity: u32, refill_per_second: f64, elapsed_ms: u64) -> f64 {
    f64::from(capacity) + refill_per_second * elapsed_ms as f64 / 1000.0
}

#[actix_web::test]
async fn parallel_script_calls_from_separate_connections_never_overspend() {
    telemetry::install();
    let redis = RedisServer::start();
    let clock: SharedClock = SystemClock::shared();
    let settings = RedisSettings {
        target: RedisTarget::Single(redis.url()),
        timeout: std::time::Duration::from_secs(5),
        connect_timeout: std::time::Duration::from_secs(1),
        max_keys_per_call: 16,
        max_calls_in_flight: 1,
        credentials: Default::default(),
        sentinel_credentials: Default::default(),
        tls: Default::default(),
    };
    // Four clients, each with its own connection, like four gateways.
    let connector = RedisConnector::new(&settings).unwrap().unwrap();
    let clients: Vec<RedisBucket> = (0..4)
        .map(|_| {
            RedisBucket::new(
                connector.connect(),
                settings.timeout,
                Metrics::new(),
                clock.clone(),
            )
        })
        .collect();
    let key = BucketKey::new(
        &TenantId::parse("racer").unwrap(),
        &RouteId::parse("r").unwrap(),
    );
    let spec = BucketSpec::of(NonZeroU32::new(100).unwrap(), NonZeroU32::new(5).unwrap());

    let started = clock.now_ms();
    let calls = (0..1000).map(|i| clients[i % 4].take(key.as_str(), &spec, Ask::single(1)));
    let results = join_all(calls).await;
    let elapsed = clock.now_ms() - started;

    let admitted = results
        .iter()
        .filter(|r| r.as_ref().unwrap().decision.allowed)
        .count();
    assert!(admitted >= 100, "the full burst is available: {admitted}");
    assert!(
        admitted as f64 <= bound(100, 5.0, elapsed),
        "admitted {admitted} in {elapsed} ms, bound {}",
        bound(100, 5.0, elapsed)
    );
}

#[actix_web::test]
async fn parallel_requests_through_two_gateways_stay_within_the_limit() {
    let s = Stack::start("races", "", |c, _| {
        c.extra = "[default_rule]\ncapacity = 50\nrefill_per_second = 10\n".into();
    });
    let gateways = [&s.gw, &Gateway::start(&s.config)];
    let clock = SystemClock::new();
    let c = client();

    let started = clock.now_ms();
    // Each future drops its response at once, handing the connection back
    // to the client's pool for the requests still queued.
    let requests = (0..1000).map(|i| {
        let req = c
            .get(gateways[i % 2].url("/race"))
            .insert_header(("x-api-key", "hot-tenant"));
        async move { req.send().await.map(|r| r.status().as_u16()) }
    });
    let statuses: Vec<u16> = join_all(requests)
        .await
        .into_iter()
        .map(|r| r.expect("gateway answers"))
        .collect();
    let elapsed = clock.now_ms() - started;

    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    assert!(admitted >= 50, "the full burst is available: {admitted}");
    assert!(
        admitted as f64 <= bound(50, 10.0, elapsed),
        "admitted {admitted} in {elapsed} ms, bound {}",
        bound(50, 10.0, elapsed)
    );
}
