//! Limits and headers end to end: gateway → real Redis → mock upstream.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use common::{
    Gateway, GatewayConfig, Stack, TempDir, Upstream, answers, client, get, get_as, header, metric,
    ratelimit_members, ready,
};

/// `answers` as statuses and remaining counts, each one present.
fn expected(answers: &[(u16, &str)]) -> Vec<(u16, Option<String>)> {
    answers
        .iter()
        .map(|(status, left)| (*status, Some((*left).to_owned())))
        .collect()
}

/// Under the default rule of 2 tokens: two admitted, then one refused.
const TWO_OF_THREE: [(u16, &str); 3] = [(200, "1"), (200, "0"), (429, "0")];

#[actix_web::test]
async fn capacity_two_admits_two_then_rejects_with_remaining_1_0_0() {
    let s = Stack::start("cap2", "", |_, _| {});
    let seen = answers(&s.gw.url("/orders"), "shop-a", 3).await;
    assert_eq!(seen, expected(&TWO_OF_THREE));
}

#[actix_web::test]
async fn rejection_carries_retry_after_and_ietf_headers() {
    let s = Stack::start("headers", "", |_, _| {});
    let gw = &s.gw;
    let c = client();
    let ok = get_as(&c, &gw.url("/x"), "t1").await;
    assert_eq!(ok.status(), 200);
    assert_eq!(header(&ok, "x-ratelimit-limit").as_deref(), Some("2"));
    // The IETF fields, read as RFC 9651 lists: one policy, named after
    // the route, with integer parameters.
    let members = |res: &awc::ClientResponse<_>, name: &str| {
        ratelimit_members(&header(res, name).unwrap_or_else(|| panic!("no {name}")))
    };
    let policy = |params: &[(&str, i64)]| {
        vec![(
            "api".to_owned(),
            params
                .iter()
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect::<Vec<_>>(),
        )]
    };
    assert_eq!(
        members(&ok, "ratelimit-policy"),
        policy(&[("q", 2), ("w", 2)])
    );
    assert_eq!(members(&ok, "ratelimit"), policy(&[("r", 1), ("t", 0)]));
    assert_eq!(header(&ok, "retry-after"), None);

    get_as(&c, &gw.url("/x"), "t1").await;
    let mut rejected = get_as(&c, &gw.url("/x"), "t1").await;
    assert_eq!(rejected.status(), 429);
    // 1 token/s and under a second since the bucket emptied: the real wait
    // is below 1 s, rounded up to 1.
    assert_eq!(header(&rejected, "retry-after").as_deref(), Some("1"));
    assert_eq!(
        header(&rejected, "x-ratelimit-remaining").as_deref(),
        Some("0")
    );
    assert_eq!(header(&rejected, "x-ratelimit-limit").as_deref(), Some("2"));
    assert_eq!(
        members(&rejected, "ratelimit"),
        policy(&[("r", 0), ("t", 1)])
    );
    let body: serde_json::Value = rejected.json().await.unwrap();
    assert_eq!(body["error"], "rate_limited");
}

#[actix_web::test]
async fn rules_override_the_default_and_bucket_keys_expire() {
    let s = Stack::start(
        "ttl",
        "[[rule]]\ntenant = \"big\"\nroute = \"api\"\ncapacity = 30\nrefill_per_second = 3\n",
        |_, _| {},
    );
    let (gw, redis) = (&s.gw, &s.redis);
    assert_eq!(
        answers(&gw.url("/a"), "big", 1).await,
        expected(&[(200, "29")])
    );
    assert_eq!(
        answers(&gw.url("/a"), "small", 1).await,
        expected(&[(200, "1")])
    );

    // Expiry 1.5 to 2 times the time to refill from empty after the bucket
    // is full again: 1/3 s + 15 to 20 s (30/3 s); 1 s + 3 to 4 s (2/1 s).
    let pttl = |key: &str| -> i64 {
        let reply = redis.cmd(&["PTTL", key]);
        reply.trim_start_matches(':').trim().parse().unwrap()
    };
    let (big, small) = (pttl("rl2:{big}:api"), pttl("rl2:{small}:api"));
    assert!((15_000..=20_400).contains(&big), "PTTL {big}");
    assert!((3_900..=5_000).contains(&small), "PTTL {small}");
}

#[actix_web::test]
async fn two_gateways_share_one_bucket() {
    let s = Stack::start("shared", "", |_, _| {});
    let (a, b) = (&s.gw, Gateway::start(&s.config));
    assert_eq!(get(&a.url("/o"), Some("shop")).await.0, 200);
    assert_eq!(get(&b.url("/o"), Some("shop")).await.0, 200);
    assert_eq!(get(&a.url("/o"), Some("shop")).await.0, 429);
    assert_eq!(get(&b.url("/o"), Some("shop")).await.0, 429);
}

#[actix_web::test]
async fn route_cost_takes_several_tokens() {
    let s = Stack::start("cost", "", |c, up| {
        c.extra = "[default_rule]\ncapacity = 10\nrefill_per_second = 1\n".into();
        c.routes = format!(
            "[[routes]]\nid = \"search\"\npath_prefix = \"/search\"\nupstream = \"{up}\"\ncost = 4\n"
        );
    });
    assert_eq!(
        answers(&s.gw.url("/search"), "t", 3).await,
        expected(&[(200, "6"), (200, "2"), (429, "0")])
    );
}

#[actix_web::test]
async fn local_only_mode_limits_without_redis() {
    let (up, dir) = (Upstream::start(), TempDir::new("local"));
    dir.file("rules.toml", "");
    let gw = Gateway::start(&GatewayConfig::new("", dir.0.join("rules.toml"), &up.url()));
    assert_eq!(
        answers(&gw.url("/o"), "k", 3).await,
        expected(&TWO_OF_THREE)
    );
    assert_eq!(ready(&gw).await["redis"], "disabled");
}

/// Sends `n` requests as `tenant` and returns each one's status,
/// `X-RateLimit-Remaining` and `Retry-After`.
async fn statuses(gw: &Gateway, tenant: &str, n: usize) -> Vec<(u16, String, Option<String>)> {
    let c = client();
    let mut seen = Vec::new();
    for _ in 0..n {
        let res = get_as(&c, &gw.url("/x"), tenant).await;
        seen.push((
            res.status().as_u16(),
            header(&res, "x-ratelimit-remaining").unwrap_or_default(),
            header(&res, "retry-after"),
        ));
    }
    seen
}

/// `tollgate_requests_total` of `outcome` on route `api` for `tenant`'s
/// label.
fn outcome_series(tenant: &str, outcome: &str) -> String {
    format!(
        "tollgate_requests_total{{route=\"api\",tenant=\"{tenant}\",outcome=\"{outcome}\",entry=\"proxy\"}}"
    )
}

#[actix_web::test]
async fn a_rule_in_shadow_mode_forwards_its_refusals_and_counts_them() {
    let rules = "[[rule]]\ntenant = \"dry\"\nroute = \"api\"\ncapacity = 1\nrefill_per_second = 1\n\
                 mode = \"shadow\"\nname = \"Dry\"\n\n\
                 [[rule]]\ntenant = \"wet\"\nroute = \"api\"\ncapacity = 1\nrefill_per_second = 1\n";
    let s = Stack::start("shadow-rule", rules, |_, _| {});
    let refused = || (200, "0".to_owned(), None);
    assert_eq!(
        statuses(&s.gw, "dry", 3).await,
        [(200, "0".to_owned(), None), refused(), refused()]
    );
    // The same limit without shadow mode still answers 429.
    let wet = statuses(&s.gw, "wet", 2).await;
    assert_eq!((wet[0].0, wet[1].0), (200, 429));
    assert_eq!(wet[1].2.as_deref(), Some("1"));
    assert_eq!(
        metric(&s.gw, &outcome_series("Dry", "shadow_rejected")).await,
        Some(2.0)
    );
    assert_eq!(
        metric(&s.gw, &outcome_series("Dry", "allowed")).await,
        Some(1.0)
    );
    assert_eq!(
        metric(&s.gw, &outcome_series("Dry", "rejected")).await,
        Some(0.0)
    );
    // Tokens were taken as usual: the bucket is as empty as an enforced one.
    let stored = s.redis.cmd(&["EXISTS", "rl2:{dry}:api"]);
    assert_eq!(stored.trim(), ":1");
}

#[actix_web::test]
async fn a_shadow_rule_never_switches_off_the_enforced_rule_beside_it() {
    // A tenant-wide rule in shadow mode with room for 1, and the route's
    // rule, enforced, with room for 3.
    let rules = "[[rule]]\ntenant = \"mix\"\nroute = \"*\"\ncapacity = 1\nrefill_per_second = 1\n\
                 mode = \"shadow\"\n\n\
                 [[rule]]\ntenant = \"mix\"\nroute = \"api\"\ncapacity = 3\nrefill_per_second = 1\n";
    let s = Stack::start("shadow-beside", rules, |_, _| {});
    let seen = statuses(&s.gw, "mix", 5).await;
    let codes: Vec<u16> = seen.iter().map(|(status, _, _)| *status).collect();
    // The shadow rule refuses from the second request on; the enforced
    // one still pays for each and refuses once its 3 are spent.
    assert_eq!(codes, [200, 200, 200, 429, 429], "{seen:?}");
    assert_eq!(seen[3].2.as_deref(), Some("1"), "{seen:?}");
}

#[actix_web::test]
async fn limits_shadow_puts_every_rule_in_shadow_mode() {
    let s = Stack::start("shadow-all", "", |c, _| {
        c.extra.push_str("[limits]\nshadow = true\n");
    });
    let seen = statuses(&s.gw, "anyone", 4).await;
    assert!(
        seen.iter()
            .all(|(status, _, retry)| *status == 200 && retry.is_none()),
        "{seen:?}"
    );
    assert_eq!(
        seen.iter().filter(|(_, left, _)| left == "0").count(),
        3,
        "{seen:?}"
    );
    assert_eq!(
        metric(&s.gw, &outcome_series("_other", "shadow_rejected")).await,
        Some(2.0)
    );
}

/// Two routes, each with the catch-all mock upstream behind it.
fn two_routes(c: &mut GatewayConfig, up: &str) {
    c.routes = format!(
        "[[routes]]\nid = \"search\"\npath_prefix = \"/search\"\nupstream = \"{up}\"\n\
         [[routes]]\nid = \"orders\"\npath_prefix = \"/orders\"\nupstream = \"{up}\"\n"
    );
    c.extra = "[default_rule]\ncapacity = 100\nrefill_per_second = 100\n".into();
}

#[actix_web::test]
async fn a_quota_beside_the_bucket_refuses_until_its_window_ends() {
    let rules = "[[rule]]\ntenant = \"acme\"\nroute = \"search\"\ncapacity = 50\nrefill_per_second = 50\n\
                 [[rule.limit]]\nquota = 3\nwindow = \"day\"\n";
    let s = Stack::start("quota", rules, two_routes);
    let c = client();
    let send = || {
        c.get(s.gw.url("/search"))
            .insert_header(("x-api-key", "acme"))
            .send()
    };
    for left in ["2", "1", "0"] {
        let ok = send().await.unwrap();
        assert_eq!(ok.status(), 200);
        // The quota has fewer requests left than the bucket: it is reported.
        assert_eq!(header(&ok, "x-ratelimit-remaining").as_deref(), Some(left));
        assert_eq!(header(&ok, "x-ratelimit-limit").as_deref(), Some("3"));
    }
    let refused = send().await.unwrap();
    assert_eq!(refused.status(), 429);
    let policies = ratelimit_members(&header(&refused, "ratelimit-policy").unwrap());
    let names: Vec<&str> = policies.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["search", "search.1"]);
    assert_eq!(
        policies[1].1,
        [("q".to_owned(), 3), ("w".to_owned(), 86_400)]
    );
    // Until the next UTC midnight, as Redis's clock tells it.
    let time = s.redis.cmd(&["TIME"]);
    // The first number of the reply: Unix seconds.
    let now: u64 = time
        .split(|c: char| !c.is_ascii_digit())
        .find(|n| n.len() >= 9)
        .unwrap_or_else(|| panic!("TIME said {time:?}"))
        .parse()
        .unwrap();
    let to_midnight = 86_400 - now % 86_400;
    let retry: u64 = header(&refused, "retry-after").unwrap().parse().unwrap();
    assert!(
        retry.abs_diff(to_midnight) <= 2,
        "{retry} against {to_midnight}"
    );
    let current = ratelimit_members(&header(&refused, "ratelimit").unwrap());
    assert_eq!(current[0].0, "search.1");
    // Asking again costs Redis nothing until the day ends.
    let calls = s.redis.command_calls("evalsha");
    for _ in 0..3 {
        let again = send().await.unwrap();
        assert_eq!(again.status(), 429);
        let retry: u64 = header(&again, "retry-after").unwrap().parse().unwrap();
        assert!(retry.abs_diff(to_midnight) <= 2);
    }
    // (The membership heartbeat, a script too, may run once meanwhile.)
    let more = s.redis.command_calls("evalsha") - calls;
    assert!(more <= 1, "{more} script calls for 3 refused requests");
    // Another route of the tenant is not held by this rule's quota.
    let other = get_as(&c, &s.gw.url("/orders"), "acme").await;
    assert_eq!(other.status(), 200);
}

#[actix_web::test]
async fn a_tenant_wide_rule_counts_every_route() {
    let rules = "[[rule]]\ntenant = \"acme\"\nroute = \"*\"\ncapacity = 3\nrefill_per_second = 1\n";
    let s = Stack::start("tenant-wide", rules, two_routes);
    let mut statuses = Vec::new();
    for path in ["/search", "/orders", "/search", "/orders"] {
        statuses.push(get(&s.gw.url(path), Some("acme")).await.0);
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    // Another tenant has only the default rule.
    assert_eq!(get(&s.gw.url("/orders"), Some("globex")).await.0, 200);
    let refused = get_as(&client(), &s.gw.url("/search"), "acme").await;
    let policies = ratelimit_members(&header(&refused, "ratelimit-policy").unwrap());
    let names: Vec<&str> = policies.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["search", "*"]);
    assert_eq!(header(&refused, "x-ratelimit-limit").as_deref(), Some("3"));
}

#[actix_web::test]
async fn a_sharded_rule_with_a_quota_spreads_its_sub_groups_over_a_cluster() {
    let cluster = common::RedisCluster::start();
    let up = Upstream::start();
    let dir = TempDir::new("sharded-groups");
    let rules = dir.file(
        "rules.toml",
        "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\ncapacity = 40\nrefill_per_second = 1\n\
         shards = 4\n[[rule.limit]]\nquota = 40\nwindow = \"day\"\n",
    );
    let mut config = GatewayConfig::new("", rules, &up.url());
    config.cluster_nodes = cluster.seeds();
    let gw = Gateway::start(&config);
    // 40 requests over 4 sub-groups of 10 each: every one is admitted,
    // whichever sub-group each starts at (a full one passes it on).
    for i in 0..40 {
        assert_eq!(get(&gw.url("/x"), Some("acme")).await.0, 200, "request {i}");
    }
    // The day's quota of 40 is spent in every sub-group: refused.
    let (status, remaining) = get(&gw.url("/x"), Some("acme")).await;
    assert_eq!((status, remaining.as_deref()), (429, Some("0")));
    // Each sub-group holds both limits under its own tag.
    for i in 0..4 {
        assert!(cluster.exists(&format!("rl2:{{acme/{i}}}:api")), "{i}");
        assert!(cluster.exists(&format!("rl2:{{acme/{i}}}:api#1d")), "{i}");
    }
    assert!(
        !cluster.exists("rl2:{acme}:api"),
        "the whole group is never asked"
    );
}
