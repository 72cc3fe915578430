//! The HTTP check (`[check]`): `POST /v1/check` and `/v1/auth`, asked
//! directly, by a real nginx (`auth_request`, with the snippet shipped in
//! `config/nginx-tollgate.conf`) and by a real Caddy (`forward_auth`, with
//! `config/Caddyfile.tollgate`), each in front of an upstream.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::peers::{Listening, assert_acme_gets_three, shipped_config};
use common::{
    RawResponse, Stack, TempDir, free_port, raw_http, raw_http_with_body, spawn_from, stop_child,
    wait_until,
};

const RULES: &str =
    "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\ncapacity = 3\nrefill_per_second = 1\n";

/// A stack whose gateway serves the check, refusing with `refused`.
fn stack(tag: &str, refused: u16) -> Stack {
    Stack::start(tag, RULES, |c, _| {
        c.extra = format!(
            "[default_rule]\ncapacity = 20\nrefill_per_second = 1\n\
             [check]\nlisten = \"127.0.0.1:0\"\nrefused_status = {refused}\n"
        );
    })
}

fn post_check(addr: SocketAddr, body: &str) -> RawResponse {
    post(addr, "/v1/check", body)
}

/// `POST path` with the JSON `body`.
fn post(addr: SocketAddr, path: &str, body: &str) -> RawResponse {
    raw_http_with_body(
        addr,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n",
            body.len()
        ),
        body,
    )
}

#[test]
fn post_v1_check_answers_the_decision_and_refuses_bad_input() {
    let s = stack("check-post", 403);
    let addr = s.gw.check.unwrap();
    let ask = |body: &str| post_check(addr, body);
    let res = ask(r#"{"tenant": "acme", "route": "api", "cost": 2}"#);
    assert_eq!(res.status, 200, "{}", res.body);
    let json = res.json();
    assert_eq!(json["allowed"], true);
    assert_eq!(json["remaining"], 1);
    assert_eq!(json["limit"], 3);
    assert_eq!(res.header("ratelimit"), Some("\"api\";r=1;t=0"));
    let res = ask(r#"{"tenant": "acme", "route": "api", "cost": 2}"#);
    assert_eq!(res.status, 429, "{}", res.body);
    assert_eq!(res.json()["allowed"], false);
    assert!(res.header("retry-after").is_some());

    for (body, expected) in [
        (
            r#"{"tenant": "acme", "rout": "api"}"#,
            "rout: is not a field here (the fields: tenant, route, cost, request_id)",
        ),
        (
            r#"{"tenant": "acme", "route": "nope"}"#,
            "route: no route \"nope\" (routes: api)",
        ),
        (
            r#"{"tenant": "ac me", "route": "api"}"#,
            "tenant \"ac me\":",
        ),
        (
            r#"{"tenant": "acme", "route": "api", "cost": 0}"#,
            "cost must be between 1",
        ),
        ("not json", "body: is not valid JSON"),
    ] {
        let res = ask(body);
        assert_eq!(res.status, 400, "{body}: {}", res.body);
        let message = res.json()["message"].as_str().unwrap().to_owned();
        assert!(message.contains(expected), "{body}: {message}");
    }
    let res = raw_http(addr, "GET /v1/check HTTP/1.1\r\nHost: c\r\n");
    assert_eq!(res.status, 405);
    let res = raw_http(addr, "GET /elsewhere HTTP/1.1\r\nHost: c\r\n");
    assert_eq!(res.status, 404);
    let metrics = common::metrics_text(&s.gw);
    assert!(
        metrics.contains("outcome=\"rejected\",entry=\"check\"}"),
        "{metrics}"
    );
}

#[test]
fn post_v1_charge_takes_usage_past_zero_and_a_negative_cost_gives_it_back() {
    let s = stack("check-charge", 403);
    let addr = s.gw.check.unwrap();
    let charge = |body: &str| post(addr, "/v1/charge", body);
    // acme has 3 at 1/s: a charge of 5 leaves 2 in debt, 3 s from a token.
    let res = charge(r#"{"tenant": "acme", "route": "api", "cost": 5}"#);
    assert_eq!(res.status, 200, "{}", res.body);
    let json = res.json();
    assert_eq!(json["allowed"], true, "a charge is never refused");
    assert_eq!(
        (
            json["remaining"].as_u64(),
            json["retry_after_seconds"].as_u64()
        ),
        (Some(0), Some(3))
    );
    assert_eq!(res.header("ratelimit"), Some("\"api\";r=0;t=3"));
    let res = post_check(addr, r#"{"tenant": "acme", "route": "api"}"#);
    assert_eq!(res.status, 429, "the debt is paid back first: {}", res.body);
    assert_eq!(res.header("retry-after"), Some("3"));
    // A refund, never above the limit's size.
    let res = charge(r#"{"tenant": "acme", "route": "api", "cost": -10}"#);
    assert_eq!(res.json()["remaining"], 3, "{}", res.body);
    let res = post_check(addr, r#"{"tenant": "acme", "route": "api"}"#);
    assert_eq!(
        (res.status, res.json()["remaining"].as_u64()),
        (200, Some(2))
    );

    for (body, expected) in [
        (
            r#"{"tenant": "acme", "route": "api"}"#,
            "cost is required for a charge",
        ),
        (
            r#"{"tenant": "acme", "route": "api", "cost": 5000000000}"#,
            "cost must be between -4294967295 and 4294967295",
        ),
        (
            r#"{"tenant": "acme", "route": "api", "cost": 1.5}"#,
            "cost: holds a value this field does not take",
        ),
        (
            r#"{"tenant": "acme", "route": "nope", "cost": 1}"#,
            "route: no route",
        ),
    ] {
        let res = charge(body);
        assert_eq!(res.status, 400, "{body}: {}", res.body);
        let message = res.json()["message"].as_str().unwrap().to_owned();
        assert!(message.contains(expected), "{body}: {message}");
    }
    assert_eq!(
        raw_http(addr, "GET /v1/charge HTTP/1.1\r\nHost: c\r\n").status,
        405
    );
    // Nothing malformed was charged.
    let res = post_check(addr, r#"{"tenant": "acme", "route": "api"}"#);
    assert_eq!(res.json()["remaining"], 1, "{}", res.body);
}

#[test]
fn v1_auth_reads_the_subrequest_headers() {
    let s = stack("check-auth", 429);
    let addr = s.gw.check.unwrap();
    let auth = |headers: &str| {
        raw_http(
            addr,
            &format!("GET /v1/auth HTTP/1.1\r\nHost: c\r\n{headers}"),
        )
    };
    let res = auth("X-Api-Key: acme\r\nX-Tollgate-Route: api\r\nX-Tollgate-Cost: 3\r\n");
    assert_eq!(res.status, 200);
    assert_eq!(res.header("ratelimit"), Some("\"api\";r=0;t=0"));
    let res = auth("X-Api-Key: acme\r\nX-Tollgate-Route: api\r\n");
    assert_eq!(res.status, 429, "check.refused_status");
    assert!(res.header("retry-after").is_some());
    assert_eq!(auth("X-Tollgate-Route: api\r\n").status, 401);
    assert_eq!(
        auth("X-Api-Key: a\r\nX-Api-Key: b\r\nX-Tollgate-Route: api\r\n").status,
        401
    );
    assert_eq!(auth("X-Api-Key: acme\r\n").status, 400, "no route");
    let twice = "X-Api-Key: beta\r\nX-Tollgate-Route: api\r\nX-Tollgate-Route: other\r\n";
    assert_eq!(auth(twice).status, 400, "a route header twice");
    let res = auth("X-Api-Key: beta\r\nX-Tollgate-Route: api\r\nX-Tollgate-Cost: x\r\n");
    assert_eq!(res.status, 400);
    // None of the malformed ones took anything from beta.
    let res = auth("X-Api-Key: beta\r\nX-Tollgate-Route: api\r\n");
    assert_eq!(res.header("ratelimit"), Some("\"api\";r=19;t=0"));
}

/// A cost larger than the bucket follows one rule wherever it is named (a
/// route's `cost`, the check's `cost` or `X-Tollgate-Cost`): it is clamped
/// to the capacity, so it passes only on a full bucket and empties it.
#[test]
fn a_cost_above_capacity_is_clamped_as_a_routes_cost_is() {
    let s = Stack::start("check-cost", "", |c, up| {
        c.extra = "[default_rule]\ncapacity = 20\nrefill_per_second = 1\n\
                   [check]\nlisten = \"127.0.0.1:0\"\n"
            .to_owned();
        c.routes = format!(
            "[[routes]]\nid = \"heavy\"\npath_prefix = \"/heavy\"\ncost = 50\nupstream = \"{up}\"\n\
             [[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"{up}\"\n"
        );
    });
    let check = s.gw.check.unwrap();
    let proxied = |tenant: &str| {
        raw_http(
            s.gw.addr,
            &format!("GET /heavy HTTP/1.1\r\nHost: g\r\nX-Api-Key: {tenant}\r\n"),
        )
    };
    let checked = |tenant: &str, cost: u32| {
        post_check(
            check,
            &format!(r#"{{"tenant": "{tenant}", "route": "heavy", "cost": {cost}}}"#),
        )
    };
    let authed = |tenant: &str, cost: u32| {
        raw_http(
            check,
            &format!(
                "GET /v1/auth HTTP/1.1\r\nHost: c\r\nX-Api-Key: {tenant}\r\n\
                 X-Tollgate-Route: heavy\r\nX-Tollgate-Cost: {cost}\r\n"
            ),
        )
    };
    let answers = [
        (proxied("by-route"), proxied("by-route")),
        (checked("by-check", 50), checked("by-check", 1)),
        (authed("by-auth", 50), authed("by-auth", 1)),
    ];
    for (i, (full, after)) in answers.iter().enumerate() {
        assert_eq!(full.status, 200, "{i}: {}", full.body);
        assert_eq!(full.header("x-ratelimit-remaining"), Some("0"), "{i}");
        assert_eq!(full.header("x-ratelimit-limit"), Some("20"), "{i}");
        assert_ne!(after.status, 200, "{i}: the bucket was emptied");
        assert_eq!(after.header("x-ratelimit-remaining"), Some("0"), "{i}");
        // One token is 1 s away at 1/s; the clamped cost waits for a full
        // bucket (20 s) on the route, the cost of one for a single token.
        let wait: u64 = after.header("retry-after").unwrap().parse().unwrap();
        let expected = if i == 0 { 19..=20 } else { 1..=1 };
        assert!(expected.contains(&wait), "{i}: Retry-After {wait}");
    }
}

/// nginx with the shipped snippet, on a port of its own, asking the check
/// at `check` in front of the API at `api`.
struct Nginx {
    child: Child,
    /// Where it listens.
    addr: SocketAddr,
    _dir: TempDir,
}

impl Nginx {
    fn start(check: SocketAddr, api: &str) -> Self {
        let snippet = shipped_config("config/nginx-tollgate.conf");
        // A port found free may be taken before nginx binds it: nginx then
        // exits without writing its pid file, and another port is tried.
        for _ in 0..3 {
            let listen = free_port();
            let dir = TempDir::new("nginx");
            let prefix = dir.0.display().to_string();
            dir.file(
                "tollgate.conf",
                &snippet
                    .replace("server 127.0.0.1:8082;", &format!("server {check};"))
                    .replace(
                        "listen 127.0.0.1:8000;",
                        &format!("listen 127.0.0.1:{listen};"),
                    )
                    .replace(
                        "proxy_pass http://127.0.0.1:9000;",
                        &format!("proxy_pass {};", api.trim_end_matches('/')),
                    ),
            );
            let conf = dir.file(
                "nginx.conf",
                &format!(
                    "daemon off;\nworker_processes 1;\nerror_log {prefix}/error.log warn;\n\
                     pid {prefix}/nginx.pid;\nevents {{ worker_connections 64; }}\n\
                     http {{\n  access_log off;\n  include {prefix}/tollgate.conf;\n}}\n"
                ),
            );
            let mut child = spawn_from(
                "nginx-light",
                Command::new("nginx")
                    .args(["-p", &prefix, "-c"])
                    .arg(&conf)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
            );
            // nginx writes its pid file once its sockets are bound.
            let pid = dir.0.join("nginx.pid");
            wait_until(Duration::from_secs(10), || {
                pid.exists() || child.try_wait().is_ok_and(|exited| exited.is_some())
            });
            if pid.exists() {
                return Self {
                    child,
                    addr: SocketAddr::from(([127, 0, 0, 1], listen)),
                    _dir: dir,
                };
            }
            stop_child(&mut child, "-TERM");
            eprintln!(
                "nginx did not start on port {listen}: {}",
                std::fs::read_to_string(dir.0.join("error.log")).unwrap_or_default()
            );
        }
        panic!("nginx did not start in three tries");
    }
}

impl Drop for Nginx {
    /// SIGTERM to the master, which stops its worker before it exits (a
    /// SIGKILL would leave the worker behind).
    fn drop(&mut self) {
        stop_child(&mut self.child, "-TERM");
    }
}

/// `GET /thing` through the proxy at `addr` as `key`, naming another
/// route and cost than the proxy's own `X-Tollgate-*` headers.
fn get_thing_overriding_route_and_cost(addr: SocketAddr, key: &str) -> RawResponse {
    raw_http(
        addr,
        &format!(
            "GET /thing HTTP/1.1\r\nHost: api\r\nX-Api-Key: {key}\r\n\
             X-Tollgate-Cost: 3\r\nX-Tollgate-Route: nope\r\n"
        ),
    )
}

#[test]
fn nginx_auth_request_limits_with_the_shipped_snippet() {
    let s = stack("check-nginx", 403);
    let nginx = Nginx::start(s.gw.check.unwrap(), &s.up.url());
    let addr = nginx.addr;
    // A client's own X-Tollgate-* headers are replaced by the snippet's:
    // each request still costs 1 on route api.
    let get = |key: &str| get_thing_overriding_route_and_cost(addr, key);
    let res = assert_acme_gets_three(get);
    assert_eq!(res.json()["error"], "rate_limited");
    // Another tenant is not affected; a request without a key is 401.
    assert_eq!(get("beta").status, 200);
    let res = raw_http(addr, "GET /thing HTTP/1.1\r\nHost: api\r\n");
    assert_eq!(res.status, 401);
}

#[test]
fn nginx_refuses_when_tollgate_cannot_be_reached() {
    let up = common::Upstream::start();
    let unreachable = SocketAddr::from(([127, 0, 0, 1], common::refused_port()));
    let nginx = Nginx::start(unreachable, &up.url());
    let res = raw_http(
        nginx.addr,
        "GET /thing HTTP/1.1\r\nHost: api\r\nX-Api-Key: acme\r\n",
    );
    assert_eq!(res.status, 500, "refused, not let through");
}

/// Caddy with the shipped Caddyfile, on a port of its own, asking the
/// check at `check` in front of the API at `api`.
fn start_caddy(check: SocketAddr, api: &str) -> Listening {
    let shipped = shipped_config("config/Caddyfile.tollgate");
    let caddy = common::peers::peer("caddy");
    Listening::start("caddy", Duration::from_secs(10), |listen, dir| {
        let config = dir.file(
            "Caddyfile",
            &shipped
                .replace("http://:8001", &format!("http://:{listen}"))
                .replace(
                    "forward_auth 127.0.0.1:8082",
                    &format!("forward_auth {check}"),
                )
                .replace(
                    "reverse_proxy 127.0.0.1:9000",
                    &format!(
                        "reverse_proxy {}",
                        api.trim_start_matches("http://").trim_end_matches('/')
                    ),
                ),
        );
        let mut command = Command::new(&caddy);
        command
            .args(["run", "--adapter", "caddyfile", "--config"])
            .arg(&config)
            .env("HOME", &dir.0)
            .env("XDG_DATA_HOME", &dir.0)
            .env("XDG_CONFIG_HOME", &dir.0);
        command
    })
}

#[test]
fn caddy_forward_auth_limits_with_the_shipped_caddyfile() {
    let s = stack("check-caddy", 429);
    let caddy = start_caddy(s.gw.check.unwrap(), &s.up.url());
    // The client's own X-Tollgate-* headers are replaced: each request
    // costs 1 on route api.
    let get = |key: &str| get_thing_overriding_route_and_cost(caddy.addr, key);
    assert_acme_gets_three(get);
    assert_eq!(get("beta").status, 200, "another tenant is not affected");
    let res = raw_http(caddy.addr, "GET /thing HTTP/1.1\r\nHost: api\r\n");
    assert_eq!(res.status, 401, "no key");
    drop(caddy);
    let up = common::Upstream::start();
    let unreachable = SocketAddr::from(([127, 0, 0, 1], common::refused_port()));
    let caddy = start_caddy(unreachable, &up.url());
    let res = raw_http(
        caddy.addr,
        "GET /thing HTTP/1.1\r\nHost: api\r\nX-Api-Key: acme\r\n",
    );
    assert_eq!(
        res.status, 502,
        "refused, not let through, when tollgate cannot be reached"
    );
}
