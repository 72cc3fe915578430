//! API keys: missing → 401, malformed → 400, and a rejected key never
//! reaches Redis.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use actix_web::http::header::HeaderValue;
use common::{Stack, client, get_as};

#[actix_web::test]
async fn bad_keys_are_rejected_before_redis() {
    let s = Stack::start("keys", "", |_, _| {});
    let (gw, redis) = (&s.gw, &s.redis);
    let c = client();

    let missing = c.get(gw.url("/x")).send().await.unwrap();
    assert_eq!(missing.status(), 401);

    let too_long = "k".repeat(65);
    let bad: Vec<HeaderValue> = vec![
        HeaderValue::from_static(""),
        HeaderValue::from_str(&too_long).unwrap(),
        HeaderValue::from_static("{tenant}"),
        HeaderValue::from_static("a}b"),
        HeaderValue::from_static("has space"),
        HeaderValue::from_static("semi;colon"),
        HeaderValue::from_bytes(b"\xff\xfe").unwrap(),
    ];
    for value in bad {
        let mut res = c
            .get(gw.url("/x"))
            .insert_header(("x-api-key", value.clone()))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 400, "{value:?}");
        let body: serde_json::Value = res.json().await.unwrap();
        assert_eq!(body["error"], "invalid_api_key", "{value:?}");
        assert!(res.headers().get("x-ratelimit-remaining").is_none());
    }

    // No bucket was touched (a first call always writes its bucket). The
    // membership heartbeat is the only other script caller.
    assert_eq!(redis.cmd(&["KEYS", "rl2:*"]).trim(), "*0");
    let calls = redis.command_calls("evalsha");

    // The longest valid key passes and is counted: the checks above can fail.
    let ok = get_as(&c, &gw.url("/x"), &"k".repeat(64)).await;
    assert_eq!(ok.status(), 200);
    assert!(redis.command_calls("evalsha") > calls);
    assert!(redis.cmd(&["KEYS", "rl2:*"]).starts_with("*1\r\n"));
}

/// API keys are compared byte for byte: keys differing only in case are
/// two tenants with two buckets (an API key is a secret, and secrets are
/// case-sensitive; folding case would merge distinct customers' keys).
#[actix_web::test]
async fn keys_differing_in_case_are_two_tenants() {
    let s = Stack::start("key-case", "", |_, _| {});
    let (gw, redis) = (&s.gw, &s.redis);
    // The default rule holds 2 tokens: the upper-case key spends its own.
    for _ in 0..2 {
        assert_eq!(common::get(&gw.url("/x"), Some("Case-T")).await.0, 200);
    }
    assert_eq!(common::get(&gw.url("/x"), Some("Case-T")).await.0, 429);
    let (status, remaining) = common::get(&gw.url("/x"), Some("case-t")).await;
    assert_eq!((status, remaining.as_deref()), (200, Some("1")));
    for key in ["rl2:{Case-T}:api", "rl2:{case-t}:api"] {
        assert!(redis.cmd(&["EXISTS", key]).contains(":1"), "{key}");
    }
}
