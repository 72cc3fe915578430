//! Usage settled after the answer (`routes[].usage_header`), through the
//! proxy to a real streaming upstream (Python's own HTTP server, see
//! `tests/fixtures/usage_upstream.py`): the reservation up front, usage
//! from the answer's head or from the trailers of a chunked event stream,
//! refunds, a reservation header, answers that report nothing or break
//! off, an upstream that cannot be reached, a budget that goes into debt,
//! a rule in shadow mode, Redis failing between the reservation and the
//! settlement, a client that leaves mid-stream, a client speaking HTTP/2,
//! a gateway killed mid-answer, and hyper's server (the demo's upstream),
//! which sends trailers only when asked.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::{RawResponse, Stack, UsageUpstream, raw_http, raw_http_with_body, wait_until};

/// A budget of 1,000 tokens for acme on route llm, in a window that no
/// test sees end.
fn rules() -> String {
    format!(
        "[[rule]]\ntenant = \"acme\"\nroute = \"llm\"\n{}",
        common::steady_quota(1000)
    )
}

/// A gateway with route llm (usage in `X-Usage`, 10 reserved, or what
/// `X-Reserve` asks up to 100) in front of the fixture, and the check.
fn stack(tag: &str, up: &UsageUpstream) -> Stack {
    stack_under(tag, up, &rules())
}

/// The same gateway under `rules`.
fn stack_under(tag: &str, up: &UsageUpstream, rules: &str) -> Stack {
    let port = up.port;
    Stack::start(tag, rules, |c, _| {
        c.extra = format!(
            "[[routes]]\nid = \"llm\"\npath_prefix = \"/llm\"\n\
             upstream = \"http://127.0.0.1:{port}\"\nusage_header = \"x-usage\"\n\
             reserve = 10\nreserve_header = \"x-reserve\"\nmax_reserve = 100\n\
             [check]\nlisten = \"127.0.0.1:0\"\n"
        );
    })
}

/// `GET /llm/<what>` as acme, with `extra` header lines.
fn get(addr: SocketAddr, what: &str, extra: &str) -> RawResponse {
    raw_http(
        addr,
        &format!("GET /llm/{what} HTTP/1.1\r\nHost: api\r\nX-Api-Key: acme\r\n{extra}"),
    )
}

/// `GET /llm/<what>` as acme, read as it comes until the connection ends
/// (an answer cut short is no valid HTTP for `raw_http`).
fn cut_short(addr: SocketAddr, what: &str) -> String {
    let mut stream = send(addr, what, "Connection: close\r\n");
    let mut raw = Vec::new();
    // The gateway ends the connection with an error, or closes it.
    let _ = stream.read_to_end(&mut raw);
    String::from_utf8_lossy(&raw).into_owned()
}

/// A connection on which `GET /llm/<what>` was sent as acme, with
/// `extra` header lines; reads time out after 10 s.
fn send(addr: SocketAddr, what: &str, extra: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET /llm/{what} HTTP/1.1\r\nHost: api\r\nX-Api-Key: acme\r\n{extra}\r\n"
    )
    .unwrap();
    stream
}

/// The answer to a charge of nothing for acme: what it has left.
fn charge_nothing(check: SocketAddr) -> serde_json::Value {
    charge_nothing_on(check, "llm")
}

/// The answer to a charge of nothing for acme on `route`.
fn charge_nothing_on(check: SocketAddr, route: &str) -> serde_json::Value {
    let body = format!(r#"{{"tenant": "acme", "route": "{route}", "cost": 0}}"#);
    let res = raw_http_with_body(
        check,
        &format!(
            "POST /v1/charge HTTP/1.1\r\nHost: c\r\nContent-Length: {}\r\n",
            body.len()
        ),
        &body,
    );
    res.json()
}

/// What acme has left of its budget.
fn left(check: SocketAddr) -> u64 {
    charge_nothing(check)["remaining"].as_u64().unwrap()
}

/// Waits until acme has `expected` left (a settlement runs after its
/// answer has gone on).
fn settles_at(check: SocketAddr, expected: u64) {
    let mut seen = 0;
    let settled = wait_until(Duration::from_secs(5), || {
        seen = left(check);
        seen == expected
    });
    assert!(settled, "{seen} left, {expected} expected");
}

#[test]
fn usage_from_the_head_or_the_trailers_is_settled_against_the_reservation() {
    let up = UsageUpstream::start();
    let s = stack("usage-settle", &up);
    let (addr, check) = (s.gw.addr, s.gw.check.unwrap());
    // 10 reserved, 30 used: 20 more charged once the answer is out.
    let res = get(addr, "header?used=30", "");
    assert_eq!(res.status, 200, "{}", res.body);
    assert_eq!(res.header("x-usage"), Some("30"));
    assert_eq!(
        res.header("ratelimit"),
        Some("\"llm.1\";r=990;t=0"),
        "the reservation"
    );
    settles_at(check, 970);
    // An event stream reporting 50 in its trailers, 5 reserved by header.
    let res = get(addr, "stream?used=50", "X-Reserve: 5\r\n");
    assert_eq!(res.status, 200);
    assert!(res.body.contains("data: token 4"), "{}", res.body);
    settles_at(check, 920);
    // Less used than reserved: the rest is given back.
    let res = get(addr, "header?used=2", "X-Reserve: 100\r\n");
    assert_eq!(res.header("ratelimit"), Some("\"llm.1\";r=820;t=0"));
    settles_at(check, 918);
    // A reservation header above max_reserve is capped; a malformed one
    // is refused and takes nothing.
    get(addr, "header?used=100", "X-Reserve: 100000\r\n");
    settles_at(check, 818);
    let res = get(addr, "header?used=1", "X-Reserve: lots\r\n");
    assert_eq!(
        (res.status, res.json()["error"].as_str()),
        (400, Some("invalid_reservation"))
    );
    assert_eq!(left(check), 818);
}

#[test]
fn an_answer_that_reports_nothing_or_breaks_off_keeps_its_reservation() {
    let up = UsageUpstream::start();
    let s = stack("usage-none", &up);
    let (addr, check) = (s.gw.addr, s.gw.check.unwrap());
    assert_eq!(get(addr, "none", "").status, 200);
    assert_eq!(left(check), 990);
    // The stream breaks off before its trailers: the client gets what
    // came, and the 10 reserved stay charged.
    let answer = cut_short(addr, "broken?used=50");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("data: token 4"), "{answer}");
    assert_eq!(left(check), 980);
    // Both reservations expired unsettled, and are counted so. (Metrics
    // are this process's: no other test leaves one unsettled.)
    let series = "tollgate_usage_tokens_total{route=\"llm\",kind=\"expired\"}";
    let mut expired = None;
    let counted = wait_until(Duration::from_secs(5), || {
        expired = common::series_value(&common::metrics_text(&s.gw), series);
        expired == Some(20.0)
    });
    assert!(counted, "{expired:?} tokens counted as expired");
    // Well past the budget: the quota goes into debt, and the next
    // request waits for the window's end.
    get(addr, "header?used=5000", "");
    settles_at(check, 0);
    let refused = get(addr, "header?used=1", "");
    assert_eq!(refused.status, 429);
    let wait: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!(
        (1..=common::STEADY_WINDOW_SECONDS).contains(&wait),
        "Retry-After {wait}"
    );
}

#[test]
fn an_upstream_that_cannot_be_reached_keeps_the_reservation_charged() {
    let up = UsageUpstream::start();
    let port = up.port;
    let rules = format!(
        "[[rule]]\ntenant = \"acme\"\nroute = \"down\"\n{}",
        common::steady_quota(1000)
    );
    // Its own route, so that no other test's expired tokens count here.
    let s = Stack::start("usage-down", &rules, |c, _| {
        c.extra = format!(
            "[[routes]]\nid = \"down\"\npath_prefix = \"/down\"\n\
             upstream = \"http://127.0.0.1:{port}\"\nusage_header = \"x-usage\"\n\
             reserve = 40\n[check]\nlisten = \"127.0.0.1:0\"\n"
        );
    });
    let (addr, check) = (s.gw.addr, s.gw.check.unwrap());
    // The upstream is gone before any connection to it was made.
    drop(up);
    let res = raw_http(
        addr,
        "GET /down/header?used=30 HTTP/1.1\r\nHost: api\r\nX-Api-Key: acme\r\n",
    );
    assert_eq!(res.status, 502, "{}", res.body);
    assert_eq!(charge_nothing_on(check, "down")["remaining"], 960);
    let series = "tollgate_usage_tokens_total{route=\"down\",kind=\"expired\"}";
    let counted = wait_until(Duration::from_secs(5), || {
        common::series_value(&common::metrics_text(&s.gw), series) == Some(40.0)
    });
    assert!(counted, "the reservation expired unsettled");
    // Nothing given back later either.
    assert_eq!(charge_nothing_on(check, "down")["remaining"], 960);
}

#[test]
fn a_request_let_through_in_shadow_mode_is_charged_its_whole_usage() {
    let up = UsageUpstream::start();
    let rules = format!(
        "[[rule]]\ntenant = \"acme\"\nroute = \"llm\"\nmode = \"shadow\"\n{}",
        common::steady_quota(100)
    );
    let s = stack_under("usage-shadow", &up, &rules);
    let (addr, check) = (s.gw.addr, s.gw.check.unwrap());
    // Admitted: 10 reserved, 70 used.
    assert_eq!(get(addr, "header?used=70", "").status, 200);
    settles_at(check, 30);
    // 50 asked of 30 left: refused in shadow mode only, so it goes on
    // having taken nothing, and its 20 used are charged whole (not 20 − 50
    // given back).
    let res = get(addr, "header?used=20", "X-Reserve: 50\r\n");
    assert_eq!(res.status, 200, "{}", res.body);
    settles_at(check, 10);
    // Reporting nothing, such a request costs nothing.
    assert_eq!(get(addr, "none", "X-Reserve: 50\r\n").status, 200);
    assert_eq!(left(check), 10);
}

#[test]
fn with_redis_gone_between_reservation_and_settlement_the_reservation_stands() {
    let up = UsageUpstream::start();
    let s = stack("usage-redis", &up);
    let (addr, check) = (s.gw.addr, s.gw.check.unwrap());
    // Five events 300 ms apart; Redis pauses once the reservation is in.
    let streaming = std::thread::spawn(move || get(addr, "stream?used=50&ms=300", ""));
    settles_at(check, 990);
    s.redis.pause();
    let res = streaming.join().unwrap();
    assert_eq!(res.status, 200, "the answer is not held up");
    assert!(res.body.contains("data: token 4"), "{}", res.body);
    s.redis.resume();
    // The settlement went to the local share. Redis holds the
    // reservation, and the settlement once if the frozen server had
    // already received it (it runs it on waking): never twice.
    let mut shared = None;
    let answered = wait_until(Duration::from_secs(10), || {
        let read = charge_nothing(check);
        shared = Some(read["remaining"].as_u64().unwrap());
        read["source"] == "redis"
    });
    assert!(answered, "Redis answers again");
    assert!(matches!(shared, Some(990 | 950)), "{shared:?} left");
}

#[test]
fn the_demo_chat_answer_is_settled_from_the_trailer_hyper_sends_when_asked() {
    // The demo's upstream is hyper's server, which sends trailers only to
    // a client that asks for them (TE: trailers): the gateway asks.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(tollgate::demo::upstream::serve(listener))
    });
    let s = Stack::start("usage-demo", &rules(), |c, _| {
        c.extra = format!(
            "[[routes]]\nid = \"llm\"\npath_prefix = \"/v1/chat\"\n\
             upstream = \"http://127.0.0.1:{port}\"\nusage_header = \"x-usage\"\nreserve = 10\n\
             [check]\nlisten = \"127.0.0.1:0\"\n"
        );
    });
    let (addr, check) = (s.gw.addr, s.gw.check.unwrap());
    let res = raw_http(
        addr,
        "GET /v1/chat HTTP/1.1\r\nHost: api\r\nX-Api-Key: acme\r\n",
    );
    assert_eq!(res.status, 200, "{}", res.body);
    assert_eq!(res.header("content-type"), Some("text/event-stream"));
    // The last event says what the answer used, as the trailer does.
    let used: u64 = res
        .body
        .rsplit("\"total_tokens\": ")
        .next()
        .and_then(|rest| rest.split('}').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no usage event: {}", res.body));
    assert!((50..=500).contains(&used), "{used}");
    settles_at(check, 1000 - used);
}

#[test]
fn a_client_speaking_http2_is_settled_from_the_upstreams_trailers_too() {
    let up = UsageUpstream::start();
    let s = stack("usage-h2", &up);
    let toml = s.config.toml().replacen(
        "shutdown_timeout_seconds = 1\n",
        "shutdown_timeout_seconds = 1\nh2c = true\n",
        1,
    );
    let gw = common::Gateway::start_toml(&toml);
    let check = gw.check.unwrap();
    // curl over cleartext HTTP/2; the stream reports 40 in its trailers.
    let (seen, body) = common::curl(
        &["--http2-prior-knowledge", "-H", "X-Reserve: 5"],
        &gw.url("/llm/stream?used=40"),
    );
    assert_eq!(seen, "2 200", "{body}");
    assert!(body.contains("data: token 4"), "{body}");
    settles_at(check, 960);
}

#[test]
fn a_gateway_killed_mid_answer_costs_only_what_it_reserved() {
    let up = UsageUpstream::start();
    let s = stack("usage-kill", &up);
    let check = s.gw.check.unwrap();
    let mut doomed = common::GatewayProcess::start("doomed", &s.dir, &s.config.toml());
    let doomed_addr: SocketAddr = ([127, 0, 0, 1], doomed.proxy).into();
    // Five events a second apart, reporting 300 at the end: the gateway
    // dies after the reservation, before the trailers.
    let streaming = std::thread::spawn(move || cut_short(doomed_addr, "stream?used=300&ms=1000"));
    settles_at(check, 990);
    doomed.kill();
    let answer = streaming.join().unwrap();
    assert!(!answer.contains("data: token 4"), "cut off: {answer}");
    // The gateway that would have settled is gone (killed and reaped:
    // SIGKILL is not caught): the 10 reserved are what it cost.
    assert_eq!(left(check), 990);
}

#[test]
fn a_client_that_leaves_mid_stream_keeps_the_reservation_charged() {
    let up = UsageUpstream::start();
    // A route of its own, so that its expired series is this test's.
    let rules = rules().replace("route = \"llm\"", "route = \"gone\"");
    let port = up.port;
    let s = Stack::start("usage-abort", &rules, |c, _| {
        c.extra = format!(
            "[[routes]]\nid = \"gone\"\npath_prefix = \"/llm\"\n\
             upstream = \"http://127.0.0.1:{port}\"\nusage_header = \"x-usage\"\nreserve = 10\n\
             [check]\nlisten = \"127.0.0.1:0\"\n"
        );
    });
    let (addr, check) = (s.gw.addr, s.gw.check.unwrap());
    // Five events 300 ms apart, 300 reported at the end; the client reads
    // the first event and goes.
    let mut stream = send(addr, "stream?used=300&ms=300", "");
    let mut seen = Vec::new();
    let mut buf = [0; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: token 0") {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    drop(stream);
    // The answer would have ended 1.5 s in: the reservation stands, and
    // it is counted as expired.
    let series = "tollgate_usage_tokens_total{route=\"gone\",kind=\"expired\"}";
    let counted = wait_until(Duration::from_secs(5), || {
        common::series_value(&common::metrics_text(&s.gw), series) == Some(10.0)
    });
    assert!(counted, "the reservation expired unsettled");
    // Counted as expired when its settlement was dropped: none can follow.
    assert_eq!(charge_nothing_on(check, "gone")["remaining"], 990);
}
