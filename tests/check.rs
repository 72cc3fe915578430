//! The HTTP check (`[check]`): `POST /v1/check` and `/v1/auth`, asked
//! directly, by a real nginx (`auth_request`, with the snippet shipped in
//! `config/nginx-tollgate.conf`) and by a real Caddy (`forward_auth`, with
//! `config/Caddyfile.tollgate`), each in front of an upstream.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{RawResponse, Stack, TempDir, free_port, raw_http, raw_http_with_body, wait_until};

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
    raw_http_with_body(
        addr,
        &format!(
            "POST /v1/check HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n\
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
            "unknown field `rout`",
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
        ("not json", "body:"),
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
        let snippet = std::fs::read_to_string("config/nginx-tollgate.conf").unwrap();
        let readme = std::fs::read_to_string("README.md").unwrap();
        assert!(
            readme.contains(&snippet),
            "the README shows config/nginx-tollgate.conf as it is"
        );
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
            let mut child = Command::new("nginx")
                .args(["-p", &prefix, "-c"])
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!("cannot run nginx ({e}); install it: apt-get install -y nginx-light")
                });
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
            let _ = child.kill();
            let _ = child.wait();
            eprintln!(
                "nginx did not start on port {listen}: {}",
                std::fs::read_to_string(dir.0.join("error.log")).unwrap_or_default()
            );
        }
        panic!("nginx did not start in three tries");
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn nginx_auth_request_limits_with_the_shipped_snippet() {
    let s = stack("check-nginx", 403);
    let nginx = Nginx::start(s.gw.check.unwrap(), &s.up.url());
    let addr = nginx.addr;
    // A client's own X-Tollgate-* headers are replaced by the snippet's:
    // each request still costs 1 on route api.
    let get = |key: &str| {
        raw_http(
            addr,
            &format!(
                "GET /thing HTTP/1.1\r\nHost: api\r\nX-Api-Key: {key}\r\n\
                 X-Tollgate-Cost: 3\r\nX-Tollgate-Route: nope\r\n"
            ),
        )
    };
    for left in (0..3).rev() {
        let res = get("acme");
        assert_eq!(res.status, 200, "{}", res.body);
        assert_eq!(res.json()["path"], "/thing", "the upstream answered");
        assert_eq!(
            res.header("ratelimit"),
            Some(format!("\"api\";r={left};t=0").as_str())
        );
        assert_eq!(res.header("ratelimit-policy"), Some("\"api\";q=3;w=3"));
    }
    let res = get("acme");
    assert_eq!(res.status, 429, "{}", res.body);
    let wait: u64 = res.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&wait), "Retry-After {wait}");
    assert_eq!(
        res.header("ratelimit"),
        Some(format!("\"api\";r=0;t={wait}").as_str())
    );
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
struct Caddy {
    child: Child,
    /// Where it listens.
    addr: SocketAddr,
    _dir: TempDir,
}

impl Caddy {
    fn start(check: SocketAddr, api: &str) -> Self {
        let shipped = std::fs::read_to_string("config/Caddyfile.tollgate").unwrap();
        let readme = std::fs::read_to_string("README.md").unwrap();
        assert!(
            readme.contains(&shipped),
            "the README shows config/Caddyfile.tollgate as it is"
        );
        let caddy = common::peers::peer("caddy");
        for _ in 0..3 {
            let listen = free_port();
            let dir = TempDir::new("caddy");
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
            let mut child = Command::new(&caddy)
                .args(["run", "--adapter", "caddyfile", "--config"])
                .arg(&config)
                .env("HOME", &dir.0)
                .env("XDG_DATA_HOME", &dir.0)
                .env("XDG_CONFIG_HOME", &dir.0)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.0.join("caddy.log")).unwrap())
                .spawn()
                .unwrap();
            let addr = SocketAddr::from(([127, 0, 0, 1], listen));
            let up = wait_until(Duration::from_secs(10), || {
                std::net::TcpStream::connect(addr).is_ok()
                    || child.try_wait().is_ok_and(|exited| exited.is_some())
            });
            if up && child.try_wait().is_ok_and(|exited| exited.is_none()) {
                return Self {
                    child,
                    addr,
                    _dir: dir,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
            eprintln!(
                "caddy did not start on port {listen}: {}",
                std::fs::read_to_string(dir.0.join("caddy.log")).unwrap_or_default()
            );
        }
        panic!("caddy did not start in three tries");
    }
}

impl Drop for Caddy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn caddy_forward_auth_limits_with_the_shipped_caddyfile() {
    let s = stack("check-caddy", 429);
    let caddy = Caddy::start(s.gw.check.unwrap(), &s.up.url());
    let get = |key: &str| {
        raw_http(
            caddy.addr,
            &format!(
                "GET /thing HTTP/1.1\r\nHost: api\r\nX-Api-Key: {key}\r\n\
                 X-Tollgate-Cost: 3\r\nX-Tollgate-Route: nope\r\n"
            ),
        )
    };
    // The client's own X-Tollgate-* headers are replaced: each request
    // costs 1 on route api.
    for left in (0..3).rev() {
        let res = get("acme");
        assert_eq!(res.status, 200, "{}", res.body);
        assert_eq!(res.json()["path"], "/thing", "the upstream answered");
        assert_eq!(
            res.header("ratelimit"),
            Some(format!("\"api\";r={left};t=0").as_str())
        );
        assert_eq!(res.header("ratelimit-policy"), Some("\"api\";q=3;w=3"));
    }
    let res = get("acme");
    assert_eq!(res.status, 429, "{}", res.body);
    let wait: u64 = res.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&wait), "Retry-After {wait}");
    assert_eq!(
        res.header("ratelimit"),
        Some(format!("\"api\";r=0;t={wait}").as_str())
    );
    assert_eq!(get("beta").status, 200, "another tenant is not affected");
    let res = raw_http(caddy.addr, "GET /thing HTTP/1.1\r\nHost: api\r\n");
    assert_eq!(res.status, 401, "no key");
    drop(caddy);
    let up = common::Upstream::start();
    let unreachable = SocketAddr::from(([127, 0, 0, 1], common::refused_port()));
    let caddy = Caddy::start(unreachable, &up.url());
    let res = raw_http(
        caddy.addr,
        "GET /thing HTTP/1.1\r\nHost: api\r\nX-Api-Key: acme\r\n",
    );
    assert_eq!(
        res.status, 502,
        "refused, not let through, when tollgate cannot be reached"
    );
}
