//! Envoy's rate limit service (`[rls]`), driven end to end by a gRPC client
//! generated from Envoy's published protos (the `envoy-types` crate), as
//! Envoy itself would call it: limits shared by two gateways through real
//! Redis, `hits_addend`, several descriptors in one request, malformed
//! requests refused without taking anything, charges (usage reported
//! after the fact, as Envoy's `apply_on_stream_done` sends it),
//! concurrency slots held for named requests and released, and answers
//! from the local fallback while Redis is paused.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{Gateway, Stack, eventually};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use tollgate::clock::{Clock, SystemClock};
use tonic::transport::Channel;

/// acme's limit, and the same for a tenant only the charge test uses
/// (metrics are the test process's, so its series must be its own).
const RULES: &str = "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\ncapacity = 10\nrefill_per_second = 1\n\
                     [[rule]]\ntenant = \"charger\"\nroute = \"api\"\nname = \"Charger\"\n\
                     capacity = 10\nrefill_per_second = 1\n\
                     [[rule]]\ntenant = \"slotted\"\nroute = \"api\"\n\
                     [[rule.limit]]\nconcurrent = 2\n";

/// A stack whose gateways serve RLS on a free port, with `domain` when
/// given and Redis calls bounded by `redis_timeout_ms`.
fn stack(tag: &str, domain: &str, redis_timeout_ms: u64) -> Stack {
    Stack::start(tag, RULES, |c, _| {
        c.redis_timeout_ms = redis_timeout_ms;
        c.extra = format!(
            "[default_rule]\ncapacity = 20\nrefill_per_second = 1\n\
             [rls]\nlisten = \"127.0.0.1:0\"\ndomain = \"{domain}\"\n"
        );
    })
}

async fn client(gw: &Gateway) -> RateLimitServiceClient<Channel> {
    let addr = gw.rls.expect("the gateway serves RLS");
    RateLimitServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

/// A descriptor of `tenant` on `route`, with its own `hits` when given.
fn descriptor(tenant: &str, route: &str, hits: Option<u64>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: vec![
            Entry {
                key: "api_key".into(),
                value: tenant.into(),
            },
            Entry {
                key: "route".into(),
                value: route.into(),
            },
        ],
        hits_addend: hits.map(|value| UInt64Value { value }),
        ..Default::default()
    }
}

fn request(descriptors: Vec<RateLimitDescriptor>, hits_addend: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".into(),
        descriptors,
        hits_addend,
    }
}

async fn ask(c: &mut RateLimitServiceClient<Channel>, r: RateLimitRequest) -> RateLimitResponse {
    c.should_rate_limit(r).await.unwrap().into_inner()
}

fn header<'a>(res: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    res.response_headers_to_add
        .iter()
        .find(|h| h.key == name)
        .map(|h| h.value.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_holds_across_two_gateways_over_envoys_protocol() {
    let s = stack("rls-two", "", 1000);
    let other = Gateway::start(&s.config);
    let (mut a, mut b) = (client(&s.gw).await, client(&other).await);
    let mut ok = 0;
    let mut over = 0;
    for i in 0..14 {
        let c = if i % 2 == 0 { &mut a } else { &mut b };
        let res = ask(c, request(vec![descriptor("acme", "api", None)], 0)).await;
        assert_eq!(res.statuses.len(), 1);
        let status = &res.statuses[0];
        assert_eq!(res.overall_code, status.code);
        let limit = status.current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (1, Unit::Second as i32)
        );
        assert_eq!(limit.name, "api");
        assert_eq!(header(&res, "ratelimit-policy"), Some("\"api\";q=10;w=10"));
        if res.overall_code == Code::Ok as i32 {
            ok += 1;
            assert_eq!(status.limit_remaining, 10 - ok);
            assert!(header(&res, "retry-after").is_none());
        } else {
            assert_eq!(res.overall_code, Code::OverLimit as i32);
            over += 1;
            assert_eq!(status.limit_remaining, 0);
            let wait = status.duration_until_reset.as_ref().unwrap().seconds;
            assert!((1..=2).contains(&wait), "wait {wait}");
            assert_eq!(header(&res, "retry-after"), Some(wait.to_string().as_str()));
        }
    }
    // 14 asks within a second or two: 10 of capacity, at most one refill.
    assert!((10..=11).contains(&ok), "{ok} allowed");
    assert_eq!(ok + over, 14);
    let metrics = common::metrics_text(&s.gw);
    assert!(
        metrics.contains("outcome=\"allowed\",entry=\"rls\"}"),
        "RLS decisions are counted with entry=\"rls\""
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_addend_and_several_descriptors_in_one_request() {
    let s = stack("rls-hits", "", 1000);
    let mut c = client(&s.gw).await;
    // The request's hits_addend is every descriptor's cost but the one
    // that names its own.
    let res = ask(
        &mut c,
        request(
            vec![
                descriptor("acme", "api", None),
                descriptor("beta", "api", Some(5)),
            ],
            3,
        ),
    )
    .await;
    assert_eq!(res.overall_code, Code::Ok as i32);
    let remaining: Vec<u32> = res.statuses.iter().map(|s| s.limit_remaining).collect();
    assert_eq!(remaining, [7, 15], "in request order: 10 - 3, then 20 - 5");
    // The headers report the tighter of the two.
    assert_eq!(header(&res, "ratelimit"), Some("\"api\";r=7;t=0"));

    // One descriptor over, one not: OVER_LIMIT overall, each its own.
    let res = ask(
        &mut c,
        request(
            vec![
                descriptor("beta", "api", Some(1)),
                descriptor("acme", "api", Some(8)),
            ],
            0,
        ),
    )
    .await;
    assert_eq!(res.overall_code, Code::OverLimit as i32);
    let codes: Vec<i32> = res.statuses.iter().map(|s| s.code).collect();
    assert_eq!(codes, [Code::Ok as i32, Code::OverLimit as i32]);
    assert_eq!(res.statuses[0].limit_remaining, 14);
    assert!(header(&res, "retry-after").is_some());
}

/// `descriptor` marked as a charge of `hits` (given back when `refund`).
fn charge(tenant: &str, hits: u64, refund: bool) -> RateLimitDescriptor {
    let mut d = descriptor(tenant, "api", Some(hits));
    d.entries.push(Entry {
        key: "charge".into(),
        value: "true".into(),
    });
    d.is_negative_hits = refund;
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_is_taken_past_zero_and_never_answered_over_limit() {
    let s = stack("rls-charge", "", 1000);
    let mut c = client(&s.gw).await;
    // acme has 10 at 1/s: 12 charged leave 2 in debt.
    let res = ask(&mut c, request(vec![charge("charger", 12, false)], 0)).await;
    assert_eq!(
        res.overall_code,
        Code::Ok as i32,
        "a charge is never refused"
    );
    assert_eq!(res.statuses[0].limit_remaining, 0);
    let wait = res.statuses[0]
        .duration_until_reset
        .as_ref()
        .unwrap()
        .seconds;
    assert_eq!(wait, 3, "2 in debt and one token at 1/s");
    let res = ask(&mut c, request(vec![descriptor("charger", "api", None)], 0)).await;
    assert_eq!(res.overall_code, Code::OverLimit as i32);
    // A charge of 0 reads what is left; a refund gives tokens back.
    let res = ask(&mut c, request(vec![charge("charger", 0, false)], 0)).await;
    assert_eq!(res.statuses[0].limit_remaining, 0);
    let res = ask(&mut c, request(vec![charge("charger", 7, true)], 0)).await;
    assert_eq!(res.statuses[0].limit_remaining, 5);
    let res = ask(&mut c, request(vec![descriptor("charger", "api", None)], 0)).await;
    assert_eq!(
        (res.overall_code, res.statuses[0].limit_remaining),
        (Code::Ok as i32, 4)
    );
    let mut bad = charge("charger", 1, false);
    bad.entries[2].value = "yes".into();
    let err = c
        .should_rate_limit(request(vec![bad], 0))
        .await
        .unwrap_err();
    assert!(
        err.message()
            .contains("\"charge\" must be \"true\", found \"yes\""),
        "{err:?}"
    );
    // Charges are usage of requests already counted, not requests.
    let metrics = common::metrics_text(&s.gw);
    let series = "tollgate_requests_total{route=\"api\",tenant=\"Charger\",outcome=\"allowed\",entry=\"rls\"} 1\n";
    assert!(
        metrics.contains(series),
        "one request, four charges: {metrics}"
    );
}

/// A descriptor of `slotted` on route api naming request `id`; a release
/// of its slots when `release`.
fn slotted(id: &str, release: bool) -> RateLimitDescriptor {
    let mut d = descriptor("slotted", "api", None);
    d.entries.push(Entry {
        key: "request_id".into(),
        value: id.into(),
    });
    if release {
        d.entries.push(Entry {
            key: "release".into(),
            value: "true".into(),
        });
    }
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_are_held_for_named_requests_until_released_or_refused_together() {
    let s = stack("rls-slots", "", 1000);
    let mut c = client(&s.gw).await;
    let mut code =
        async |d: RateLimitDescriptor| ask(&mut c, request(vec![d], 0)).await.overall_code;
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    assert_eq!(code(slotted("a", false)).await, ok);
    assert_eq!(code(slotted("b", false)).await, ok);
    assert_eq!(code(slotted("c", false)).await, over, "two at once");
    // Envoy's stream-done call for a: its slot is back.
    assert_eq!(code(slotted("a", true)).await, ok);
    assert_eq!(code(slotted("c", false)).await, ok);
    assert_eq!(code(slotted("b", true)).await, ok);
    // One descriptor over the limit refuses the request: the slot another
    // descriptor took goes back. (acme's 10 tokens spent first.)
    assert_eq!(code(descriptor("acme", "api", Some(10))).await, ok);
    let res = ask(
        &mut c,
        request(
            vec![slotted("d", false), descriptor("acme", "api", None)],
            0,
        ),
    )
    .await;
    assert_eq!(res.overall_code, over);
    let taken = eventually(Duration::from_secs(1), || {
        let mut c = c.clone();
        async move {
            ask(&mut c, request(vec![slotted("e", false)], 0))
                .await
                .overall_code
                == ok
        }
    })
    .await;
    assert!(taken, "d's slot never came back");
    let mut code =
        async |d: RateLimitDescriptor| ask(&mut c, request(vec![d], 0)).await.overall_code;
    assert_eq!(code(slotted("f", false)).await, over, "c and e hold both");
    // A release names its request.
    let mut nameless = descriptor("slotted", "api", None);
    nameless.entries.push(Entry {
        key: "release".into(),
        value: "true".into(),
    });
    let err = c
        .should_rate_limit(request(vec![nameless], 0))
        .await
        .unwrap_err();
    assert!(
        err.message().contains("a release names its request"),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_invalid_argument_or_refused_and_take_nothing() {
    let s = stack("rls-bad", "edge", 1000);
    let mut c = client(&s.gw).await;
    let good = || descriptor("acme", "api", None);
    let mut no_tenant = good();
    no_tenant.entries.remove(0);
    let mut twice = good();
    twice.entries.push(twice.entries[0].clone());
    let negative = RateLimitDescriptor {
        is_negative_hits: true,
        ..good()
    };
    let cases = [
        (
            vec![good(), no_tenant],
            "descriptors[1]: no entry \"api_key\"",
        ),
        (
            vec![good(), twice],
            "descriptors[1]: more than one entry \"api_key\"",
        ),
        (
            vec![descriptor("acme", "nope", None)],
            "descriptors[0]: \"route\": no route \"nope\" (routes: api)",
        ),
        (
            vec![negative],
            "negative hits (returning tokens) are served on a charge only",
        ),
        (
            vec![descriptor("acme", "api", Some(0))],
            "hits_addend 0 (asking without taking) is not supported",
        ),
        (
            vec![descriptor("acme", &"r".repeat(5000), None)],
            "… (5000 bytes)",
        ),
        (vec![], "no descriptors"),
        (vec![good(); 65], "65 descriptors"),
    ];
    for (descriptors, expected) in cases {
        let err = c
            .should_rate_limit(request(descriptors, 0))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains(expected), "{expected}: {err:?}");
    }
    let mut other_domain = request(vec![good()], 0);
    other_domain.domain = "internal".into();
    let err = c.should_rate_limit(other_domain).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("domain \"internal\""), "{err:?}");

    // A tenant value that is not a key comes from the client: refused,
    // never an error that Envoy could let through.
    for bad in ["ac me", "{acme}", "", &"k".repeat(5000)] {
        let res = ask(
            &mut c,
            request(vec![good(), descriptor(bad, "api", None)], 0),
        )
        .await;
        assert_eq!(res.overall_code, Code::OverLimit as i32, "{bad:?}");
        assert_eq!(res.statuses[1].code, Code::OverLimit as i32, "{bad:?}");
    }

    // Nothing was taken by any of them.
    let res = ask(&mut c, request(vec![good()], 0)).await;
    assert_eq!(res.statuses[0].limit_remaining, 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_paused_answers_come_from_the_fallback_within_the_timeout() {
    let s = stack("rls-paused", "", 50);
    let mut c = client(&s.gw).await;
    assert_eq!(
        ask(&mut c, request(vec![descriptor("acme", "api", None)], 0))
            .await
            .overall_code,
        Code::Ok as i32
    );
    s.redis.pause();
    let clock = SystemClock::new();
    for _ in 0..3 {
        let started = clock.now_ms();
        let res = ask(&mut c, request(vec![descriptor("acme", "api", None)], 0)).await;
        let took = clock.now_ms() - started;
        assert_eq!(res.overall_code, Code::Ok as i32, "the fallback admits");
        assert!(
            took < 1000,
            "answered in {took} ms with redis.timeout_ms = 50"
        );
    }
    let metrics = common::metrics_text(&s.gw);
    s.redis.resume();
    assert!(
        metrics.contains("tollgate_fallback_decisions_total{outcome=\"allowed\"}"),
        "the fallback decided"
    );
}
