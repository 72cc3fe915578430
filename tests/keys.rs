//! API keys: missing → 401, malformed → 400, and a rejected key never
//! reaches Redis.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use actix_web::http::header::HeaderValue;
use common::{Stack, client};

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
    let ok = c
        .get(gw.url("/x"))
        .insert_header(("x-api-key", "k".repeat(64)))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert!(redis.command_calls("evalsha") > calls);
    assert!(redis.cmd(&["KEYS", "rl2:*"]).starts_with("*1\r\n"));
}
