//! HTTP/2 clients as hostile as they come, on real sockets, from a client
//! written on the Python `h2` library (`tests/fixtures/h2_client.py`):
//! idle connections end with `GOAWAY` after their own timeout, floods of
//! unfinished bodies on the RLS and check listeners hold no more than the
//! body budgets while other clients are served, resets and failed accepts
//! are summarised in the log rather than written one by one, and a
//! malformed header field ends its connection (the HTTP/2 library's
//! limit, documented).

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::time::Duration;

use common::peers::h2_client;
use common::{GatewayProcess, TempDir, Upstream, eventually, raw_http_with_body, wait_until};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate::clock::{Clock, SystemClock};

/// The RLS method's path.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// A local-only gateway process serving h2c, RLS and the check, with
/// `client` as its `[client]` section; returned after the mock upstream it
/// is in front of and the directory it runs in.
fn gateway(name: &str, client: &str) -> (Upstream, TempDir, GatewayProcess) {
    gateway_under(name, &format!("[client]\n{client}"), &[])
}

/// As [`gateway`] with `sections` instead of `[client]`, run by the
/// command `under`.
fn gateway_under(
    name: &str,
    sections: &str,
    under: &[&str],
) -> (Upstream, TempDir, GatewayProcess) {
    let (up, dir) = (Upstream::start(), TempDir::new(&format!("h2-{name}")));
    let rules = dir.file(&format!("{name}.rules.toml"), "rule = []\n");
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:{{proxy}}\"\nadmin_listen = \"127.0.0.1:{{admin}}\"\n\
         workers = 1\nh2c = true\n[redis]\nurl = \"\"\n[rules]\nfile = \"{}\"\n\
         [rls]\nlisten = \"127.0.0.1:0\"\n[check]\nlisten = \"127.0.0.1:0\"\n\
         {sections}\n\
         [[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"{}\"\n",
        rules.display(),
        up.url()
    );
    let gw = GatewayProcess::start_under(name, &dir, &toml, under);
    (up, dir, gw)
}

/// Seconds since `clock`'s start, as a float.
fn seconds(clock: &SystemClock, started: u64) -> f64 {
    (clock.now_ms() - started) as f64 / 1000.0
}

#[test]
fn an_idle_http2_connection_ends_with_goaway_after_its_own_timeout() {
    let (_up, _dir, gw) = gateway(
        "idle",
        "header_timeout_ms = 1000\nh2_idle_timeout_ms = 3000",
    );
    for port in [gw.proxy, gw.rls.unwrap(), gw.check.unwrap()] {
        // A pooled connection that has said nothing but the preface (and
        // pings) lives past the header deadline, to its own timeout.
        let seen = h2_client("idle", port, &["8", "0.5"]);
        let after = seen["ended_after"].as_f64().unwrap();
        assert!((2.9..4.5).contains(&after), "port {port}: {seen}");
        assert_eq!(
            seen["goaway"], 0,
            "GOAWAY(NO_ERROR), not a bare close: {seen}"
        );
        assert_eq!(seen["last_stream_id"], 0, "{seen}");
    }
    // After a request, the timeout runs from that request; GOAWAY names it.
    let seen = h2_client("idle", gw.proxy, &["8", "0", "/slow?ms=0"]);
    assert_eq!(seen["status"], 200, "{seen}");
    assert_eq!(
        (seen["goaway"].clone(), seen["last_stream_id"].clone()),
        (0.into(), 1.into()),
        "{seen}"
    );
    // A connection that never sends the preface is closed at the header
    // deadline.
    let clock = SystemClock::new();
    let started = clock.now_ms();
    let mut silent = TcpStream::connect(("127.0.0.1", gw.proxy)).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(silent.read(&mut [0u8; 16]).unwrap(), 0, "closed");
    let after = seconds(&clock, started);
    assert!((0.9..2.0).contains(&after), "closed after {after} s");
}

#[test]
fn a_malformed_header_field_ends_its_connection_as_the_http2_library_does() {
    let (_up, _dir, gw) = gateway("malformed", "");
    // Stream 1 is in flight when streams 3 and 5 send an upper-case name
    // and a carriage return: h2 0.4 answers GOAWAY(PROTOCOL_ERROR) for the
    // connection (docs/http.md: Supported, and not yet). Should the library
    // learn to reset such a stream alone, this test says so.
    let seen = h2_client("malformed", gw.proxy, &["/slow?ms=300"]);
    assert_eq!(seen["goaway"], 1, "{seen}");
    assert!(seen["status"].is_null(), "{seen}");
    // The next connection is served as ever.
    let seen = h2_client("idle", gw.proxy, &["0.5", "0", "/slow?ms=0"]);
    assert_eq!(seen["status"], 200, "{seen}");
}

#[actix_web::test]
async fn unfinished_bodies_hold_no_more_than_the_budgets_and_others_are_served() {
    // Budgets far below the defaults, so the bound is plain to see.
    let (_up, dir, gw) = gateway(
        "flood",
        "body_buffer_bytes_per_connection = 131072\nbody_buffer_bytes = 4194304",
    );
    let rls_port = gw.rls.unwrap();
    let before = gw.rss_bytes();
    let open_fds = || gw.metric("tollgate_process_open_fds").unwrap();
    let fds_before = open_fds();
    // 40 connections × 100 streams, each sending 60 KiB of a gRPC message
    // and never its end: 240 MiB if all were taken.
    let sent_once = dir.0.join("flood-sent");
    let flag = sent_once.to_str().unwrap().to_owned();
    let flood = std::thread::spawn(move || {
        h2_client(
            "hold",
            rls_port,
            &["40", "100", "61440", "4", SHOULD_RATE_LIMIT, &flag],
        )
    });
    // The flood is on once the gateway holds its 40 connections and each
    // has sent its first round of bodies (or the client gave up: said
    // below).
    let started = wait_until(Duration::from_secs(10), || {
        flood.is_finished() || (sent_once.exists() && open_fds() >= fds_before + 40.0)
    });
    if !started || flood.is_finished() {
        let files = open_fds();
        let client = flood.is_finished().then(|| flood.join());
        panic!(
            "the flood did not start: {files} files open, {fds_before} before; the client: {client:?}"
        );
    }
    // Meanwhile an RLS call and a check from other connections are
    // answered at once.
    let clock = SystemClock::new();
    let started = clock.now_ms();
    let mut rls = RateLimitServiceClient::connect(format!("http://127.0.0.1:{rls_port}"))
        .await
        .unwrap();
    let asked = RateLimitRequest {
        domain: "test".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![
                Entry {
                    key: "api_key".into(),
                    value: "victim".into(),
                },
                Entry {
                    key: "route".into(),
                    value: "api".into(),
                },
            ],
            ..Default::default()
        }],
        hits_addend: 1,
    };
    let answer = rls.should_rate_limit(asked).await.unwrap().into_inner();
    assert_eq!(answer.overall_code, 1, "OK: {answer:?}");
    let body = r#"{"tenant": "victim", "route": "api"}"#;
    let check = raw_http_with_body(
        ([127, 0, 0, 1], gw.check.unwrap()).into(),
        &format!(
            "POST /v1/check HTTP/1.1\r\nHost: c\r\nContent-Length: {}\r\n",
            body.len()
        ),
        body,
    );
    assert_eq!(check.status, 200, "{}", check.body);
    let waited = seconds(&clock, started);
    assert!(waited < 1.0, "the victims waited {waited} s");
    // The most the gateway held while the flood lasted.
    let mut during = gw.rss_bytes();
    let ended = wait_until(Duration::from_secs(30), || {
        during = during.max(gw.rss_bytes());
        flood.is_finished()
    });
    assert!(ended, "the flood did not end");
    let report = flood.join().unwrap();
    // What the gateway let in: at most each connection's budget plus its
    // HTTP/2 window (128 + 256 KiB), 15 MiB for 40.
    let sent = report["sent"].as_u64().unwrap();
    assert!(
        sent <= 40 * (384 << 10),
        "the gateway took {sent} bytes: {report}"
    );
    // Those bytes, and 4,000 streams' state (in a debug build).
    let grown = during.saturating_sub(before);
    assert!(
        grown < 96 << 20,
        "RSS grew by {grown} bytes (before {before}, during {during})"
    );
    assert_eq!(report["alive"], 40, "{report}");
}

#[actix_web::test]
async fn resets_and_failed_accepts_are_summarised_not_logged_one_by_one() {
    let (_up, _dir, gw) = gateway_under("noise", "", &["prlimit", "--nofile=256"]);
    // 300 connections, each resetting 25 streams at once: past the HTTP/2
    // library's limit of pending resets, which it warns about per
    // connection.
    h2_client("resets", gw.proxy, &["300", "25", "/slow?ms=0"]);
    // Then more connections than file descriptors: accepts fail.
    let hogs: Vec<TcpStream> = (0..400)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", gw.proxy)).ok())
        .collect();
    // Held until an accept has failed and been summarised (the admin
    // listener cannot take a scrape meanwhile: no file descriptor is left).
    let failed = "Accepting client connections failed";
    let summarised = wait_until(Duration::from_secs(12), || {
        std::fs::read_to_string(&gw.log).is_ok_and(|log| log.contains(failed))
    });
    drop(hogs);
    let log = || std::fs::read_to_string(&gw.log).unwrap();
    assert!(summarised, "no failed accept in the log:\n{}", log());
    let counted = eventually(Duration::from_secs(12), || async {
        let counts = |series| gw.metric(series).is_some_and(|n| n > 0.0);
        counts("tollgate_malformed_requests_total") && counts("tollgate_accept_errors_total")
    })
    .await;
    let log = log();
    assert!(counted, "not counted in /metrics; log:\n{log}");
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .collect();
    assert!(
        warnings.len() <= 3,
        "{} warnings, not one summary each:\n{}",
        warnings.len(),
        warnings.join("\n")
    );
    assert!(log.contains(failed), "{log}");
}

/// Regression: streams reset before their answer freed their in-flight
/// slots while the upstream kept working (570 requests at the upstream
/// against a cap of 128).
#[test]
fn reset_streams_keep_their_slots_until_the_upstream_answers() {
    let (up, _dir, gw) = gateway_under(
        "cancel",
        "[upstream]\nmax_connections_per_tenant = 2\ntimeout_ms = 10000\n\
         [default_rule]\ncapacity = 1000\nrefill_per_second = 1000\n",
        &[],
    );
    // Five batches of 8 streams of one tenant, each reset after 0.3 s,
    // while the upstream takes 1.5 s per request.
    for _ in 0..5 {
        let seen = h2_client(
            "cancel",
            gw.proxy,
            &["8", "/slow?ms=1500", "canceller", "0.3"],
        );
        assert!(seen["answered"].as_u64().unwrap() <= 8, "{seen}");
    }
    let most = up.most_slow_at_once();
    assert!(
        (1..=2).contains(&most),
        "the upstream worked on {most} at once; the cap is 2"
    );
}
