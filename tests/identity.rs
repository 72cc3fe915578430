//! One identity per request: the key that is limited is the only key the
//! upstream sees. Requests are written on raw sockets, since client
//! libraries merge or refuse repeated headers.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use common::{Stack, raw_http};

fn stack(tag: &str) -> Stack {
    Stack::start(tag, "", |c, _| {
        c.extra = "[default_rule]\ncapacity = 5\nrefill_per_second = 1\n".into();
    })
}

fn send(s: &Stack, headers: &str) -> common::RawResponse {
    raw_http(
        s.gw.addr,
        &format!("GET /who HTTP/1.1\r\nHost: gw\r\n{headers}"),
    )
}

#[test]
fn more_than_one_key_is_refused_with_400() {
    let s = stack("identity-several");
    for headers in [
        "X-Api-Key: throwaway1\r\nX-Api-Key: alice\r\n",
        "X-Api-Key: throwaway2, alice\r\n",
        "X-Api-Key: throwaway3\r\nX_Api_Key: alice\r\n",
        "X_API_KEY: alice\r\n",
    ] {
        let res = send(&s, headers);
        assert_eq!(res.status, 400, "{headers:?}: {res:?}");
        assert_eq!(res.json()["error"], "ambiguous_api_key", "{headers:?}");
    }
    // Nothing was charged to alice.
    let res = send(&s, "X-Api-Key: alice\r\n");
    assert_eq!(res.header("x-ratelimit-remaining"), Some("4"));
}

#[test]
fn the_upstream_receives_exactly_the_limited_key_whatever_connection_lists() {
    let s = stack("identity-connection");
    let res = send(
        &s,
        "Connection: x-api-key\r\nX-Api-Key: alice\r\nX-Other: 1\r\n",
    );
    assert_eq!(res.status, 200, "{res:?}");
    let echo = res.json();
    assert_eq!(echo["headers"]["x-api-key"], "alice");
    assert_eq!(echo["headers"]["x-other"], "1");
}
