//! What a route matched is what the upstream gets: spellings of a path are
//! normalised before matching and forwarded in normal form; ambiguous ones
//! are refused; CONNECT and TRACE are never proxied. Requests are written
//! on raw sockets, exactly as an attacker would send them.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use common::{Stack, raw_http};

/// A tight route `orders` (tenant `acme`: 4 tokens, 1/s) beside a generous
/// catch-all `everything` (default rule: 1000 tokens).
fn stack(tag: &str) -> Stack {
    let rules =
        "[[rule]]\ntenant = \"acme\"\nroute = \"orders\"\ncapacity = 4\nrefill_per_second = 1\n";
    Stack::start(tag, rules, |c, up| {
        c.extra = "[default_rule]\ncapacity = 1000\nrefill_per_second = 1000\n".into();
        c.routes = format!(
            "[[routes]]\nid = \"everything\"\npath_prefix = \"/\"\nupstream = \"{up}\"\n\
             [[routes]]\nid = \"orders\"\npath_prefix = \"/orders\"\nupstream = \"{up}\"\n"
        );
    })
}

fn get(s: &Stack, target: &str, key: &str) -> common::RawResponse {
    raw_http(
        s.gw.addr,
        &format!("GET {target} HTTP/1.1\r\nHost: gw\r\nX-Api-Key: {key}\r\n"),
    )
}

#[test]
fn spellings_of_a_tight_route_count_against_it_and_reach_the_upstream_normalised() {
    let s = stack("paths-spell");
    for target in ["/%6frders", "//orders", "/./orders/7", "/x/../orders?a=1"] {
        let res = get(&s, target, "acme");
        assert_eq!(res.status, 200, "{target}: {res:?}");
        assert_eq!(
            res.header("x-ratelimit-limit"),
            Some("4"),
            "{target} must be limited as route orders"
        );
        let echo = res.json();
        let path = echo["path"].as_str().unwrap();
        assert!(
            path == "/orders" || path == "/orders/7",
            "{target} → {path}"
        );
        let query = target.split_once('?').map_or("", |(_, q)| q);
        assert_eq!(echo["query"], query, "the query travels as sent");
    }
    // Four tokens spent by four spellings: the fifth spelling is refused.
    let res = get(&s, "/%2e/orders", "acme");
    assert_eq!(res.status, 429, "{res:?}");
    // The generous route is unaffected.
    assert_eq!(get(&s, "/catalog", "acme").status, 200);
}

#[test]
fn ambiguous_paths_are_refused_with_400_and_cost_nothing() {
    let s = stack("paths-ambiguous");
    for target in [
        "/orders;x",
        "/orders;jsessionid=1/7",
        "/a%2forders",
        "/a%5Corders",
        "/orders%zz",
    ] {
        let res = get(&s, target, "acme");
        assert_eq!(res.status, 400, "{target}: {res:?}");
        assert_eq!(res.json()["error"], "invalid_path", "{target}");
    }
    let res = get(&s, "/orders", "acme");
    assert_eq!(res.status, 200);
    assert_eq!(
        res.header("x-ratelimit-remaining"),
        Some("3"),
        "refused paths took no token"
    );
}

#[test]
fn connect_and_trace_answer_405_without_a_decision() {
    let s = stack("paths-methods");
    let connect = raw_http(
        s.gw.addr,
        "CONNECT upstream.example:443 HTTP/1.1\r\nHost: upstream.example:443\r\nX-Api-Key: acme\r\n",
    );
    let trace = raw_http(
        s.gw.addr,
        "TRACE /orders HTTP/1.1\r\nHost: gw\r\nX-Api-Key: acme\r\n",
    );
    for res in [&connect, &trace] {
        assert_eq!(res.status, 405, "{res:?}");
        assert_eq!(res.json()["error"], "method_not_allowed");
        assert!(res.header("allow").unwrap().contains("GET"));
        assert!(!res.header("allow").unwrap().contains("TRACE"));
    }
    let res = get(&s, "/orders", "acme");
    assert_eq!(
        res.header("x-ratelimit-remaining"),
        Some("3"),
        "405 took no token"
    );
}
