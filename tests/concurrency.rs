//! Concurrency limits (`[[rule.limit]] concurrent = N`) through the proxy,
//! against a real Redis and upstream: at most N requests of a tenant in
//! flight across every gateway, each slot held until its answer has been
//! read to the end, `429` with `Retry-After` while they are all held, and
//! the slots of a gateway killed mid-request back within the lease; and
//! the check listener's slots, held for a named request until released,
//! or for one lease.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{Fleet, GatewayProcess, RawResponse, RedisServer, Stack, TempDir, Upstream};
use common::{GatewayConfig, eventually, eventually_timed, metric, wait_until};
use common::{raw_http, raw_http_with_body};
use redis::AsyncCommands;

/// Three of acme's requests at once, and plenty of tokens.
const RULES: &str = "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\n\
                     capacity = 1000\nrefill_per_second = 1000\n\
                     [[rule.limit]]\nconcurrent = 3\n";

/// The key holding acme's slots on route api.
const SLOTS_KEY: &str = "rl2:{acme}:api#1c";

/// `GET /slow?ms=<ms>` as acme through `addr`.
fn slow(addr: SocketAddr, ms: u64) -> RawResponse {
    raw_http(
        addr,
        &format!("GET /slow?ms={ms} HTTP/1.1\r\nHost: api\r\nX-Api-Key: acme\r\n"),
    )
}

#[actix_web::test]
async fn at_most_n_requests_are_in_flight_across_gateways_until_their_answers_end() {
    let fleet = Fleet::start("concurrent", 2, RULES, |_, c, _| {
        c.upstream_timeout_ms = 5_000;
    });
    let addrs: Vec<SocketAddr> = fleet.gateways.iter().map(|g| g.addr).collect();
    // Eight at once, four through each gateway, each taking 1.5 s.
    let calls: Vec<_> = (0..8)
        .map(|i| {
            let addr = addrs[i % 2];
            std::thread::spawn(move || slow(addr, 1_500))
        })
        .collect();
    let answers: Vec<RawResponse> = calls.into_iter().map(|c| c.join().unwrap()).collect();
    let admitted = answers.iter().filter(|r| r.status == 200).count();
    assert_eq!(admitted, 3, "{answers:?}");
    for refused in answers.iter().filter(|r| r.status != 200) {
        assert_eq!(refused.status, 429, "{refused:?}");
        assert_eq!(refused.header("retry-after"), Some("1"));
    }
    assert_eq!(fleet.up.most_slow_at_once(), 3);
    // Every slot comes back with its answer (given back just after its
    // last byte has gone): three more pass at once.
    let redis = fleet.redis.conn().await;
    released(&redis).await;
    let calls: Vec<_> = (0..3)
        .map(|i| {
            let addr = addrs[i % 2];
            std::thread::spawn(move || slow(addr, 300))
        })
        .collect();
    for call in calls {
        assert_eq!(call.join().unwrap().status, 200);
    }
    released(&redis).await;
    // The gauge is this process's, which other tests share for a moment.
    let gw = &fleet.gateways[0];
    assert!(
        eventually(Duration::from_secs(2), || async {
            metric(gw, "tollgate_slots_held").await == Some(0.0)
        })
        .await,
        "tollgate_slots_held never came back to 0"
    );
}

/// Waits (up to 2 s) until acme holds no slot.
async fn released(redis: &redis::aio::MultiplexedConnection) {
    assert!(
        eventually(Duration::from_secs(2), || async { held(redis).await == 0 }).await,
        "acme's slots were not given back"
    );
}

/// How many slots acme holds.
async fn held(redis: &redis::aio::MultiplexedConnection) -> u64 {
    redis.clone().zcard(SLOTS_KEY).await.unwrap()
}

/// A gateway process on `redis` and `up`, acme's slots leased for 1 s.
fn process(name: &str, dir: &TempDir, redis: &RedisServer, up: &Upstream) -> GatewayProcess {
    let mut config = GatewayConfig::new(&redis.url(), dir.0.join("rules.toml"), &up.url());
    config.extra.push_str("[limits]\nslot_lease_ms = 1000\n");
    config.upstream_timeout_ms = 60_000;
    GatewayProcess::start(name, dir, &config.toml())
}

#[actix_web::test]
async fn the_slots_of_a_killed_gateway_come_back_within_the_lease() {
    let redis = RedisServer::start();
    let up = Upstream::start();
    let dir = TempDir::new("concurrent-kill");
    dir.file(
        "rules.toml",
        &RULES.replace("concurrent = 3", "concurrent = 1"),
    );
    let mut doomed = process("doomed", &dir, &redis, &up);
    let survivor = process("survivor", &dir, &redis, &up);
    let at = |gw: &GatewayProcess| -> SocketAddr { ([127, 0, 0, 1], gw.proxy).into() };
    let doomed_addr = at(&doomed);
    let long = std::thread::spawn(move || {
        // Cut off when its gateway dies: no answer to check.
        std::panic::catch_unwind(|| slow(doomed_addr, 30_000)).ok()
    });
    let conn = redis.conn().await;
    assert!(
        eventually(Duration::from_secs(5), || async { held(&conn).await > 0 }).await,
        "the long request never took acme's one slot"
    );
    // Held past two leases: the doomed gateway renews it.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let refused = slow(at(&survivor), 10);
    assert_eq!(refused.status, 429, "{refused:?}");
    doomed.kill();
    let back = eventually_timed(Duration::from_secs(5), || async {
        slow(at(&survivor), 10).status == 200
    })
    .await
    .expect("the killed gateway's slot never came back");
    // Within the lease (1 s) after its last renewal, which came before
    // the kill (with room for a loaded machine's polling).
    assert!(back <= Duration::from_millis(1_800), "back after {back:?}");
    let _ = long.join();
}

/// `POST <path>` on the check listener with `body`.
fn post(check: SocketAddr, path: &str, body: &str) -> RawResponse {
    raw_http_with_body(
        check,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ),
        body,
    )
}

/// A check for acme on route api, naming request `id` when given.
fn check(addr: SocketAddr, id: Option<&str>) -> u16 {
    let named = id.map_or(String::new(), |id| format!(r#", "request_id": "{id}""#));
    post(
        addr,
        "/v1/check",
        &format!(r#"{{"tenant": "acme", "route": "api"{named}}}"#),
    )
    .status
}

#[test]
fn the_check_holds_a_slot_for_a_named_request_until_released_or_for_one_lease() {
    let rules = RULES.replace("concurrent = 3", "concurrent = 2");
    let s = Stack::start("concurrent-check", &rules, |c, _| {
        c.extra
            .push_str("[limits]\nslot_lease_ms = 600\n[check]\nlisten = \"127.0.0.1:0\"\n");
    });
    let addr = s.gw.check.unwrap();
    assert_eq!(check(addr, Some("r1")), 200);
    assert_eq!(check(addr, Some("r2")), 200);
    assert_eq!(check(addr, Some("r3")), 429);
    let release = |id: &str| {
        post(
            addr,
            "/v1/release",
            &format!(r#"{{"tenant": "acme", "route": "api", "request_id": "{id}"}}"#),
        )
    };
    let res = release("r1");
    assert_eq!(
        (res.status, res.json()["released"].as_bool()),
        (200, Some(true))
    );
    assert_eq!(check(addr, Some("r3")), 200);
    // A release must name its request and takes no cost.
    let res = post(addr, "/v1/release", r#"{"tenant": "acme", "route": "api"}"#);
    assert_eq!(res.status, 400, "{}", res.body);
    assert!(res.body.contains("request_id is required"), "{}", res.body);
    // Slots nobody releases end with their lease (600 ms): both come
    // back, and are taken again.
    assert_eq!(check(addr, None), 429);
    for _ in 0..2 {
        let back = wait_until(Duration::from_secs(3), || check(addr, None) == 200);
        assert!(back, "a slot held past its lease");
    }
    assert_eq!(check(addr, None), 429);
}
