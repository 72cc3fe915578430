//! Rules in PostgreSQL: propagation to every gateway, the admin API, and
//! its validation and auth.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{
    Gateway, GatewayConfig, RedisServer, TempDir, TestDatabase, Upstream, admin, answers,
    eventually, get, get_as, limit_of, metric, ready, wait_for_limit,
};

const TOKEN: &str = "s3cret-token";
const READ_TOKEN: &str = "read-only-token";

/// Gateways on one database and one Redis.
struct Fleet {
    db: TestDatabase,
    fleet: common::Fleet,
}

impl std::ops::Deref for Fleet {
    type Target = common::Fleet;

    fn deref(&self) -> &common::Fleet {
        &self.fleet
    }
}

/// `n` gateways on one database and one Redis, admin token [`TOKEN`] and
/// read token [`READ_TOKEN`].
fn fleet(n: usize) -> Fleet {
    let db = TestDatabase::create();
    let fleet = common::Fleet::start("pg", n, "", |i, config, dir| {
        config.database_url = db.url();
        config.admin_token = TOKEN.to_owned();
        config.admin_read_token = READ_TOKEN.to_owned();
        config.rules_extra = format!(
            "snapshot_file = \"{}\"",
            dir.0.join(format!("snap-{i}.json")).display()
        );
    });
    Fleet { db, fleet }
}

async fn all_reach(fleet: &Fleet, tenant: &str, limit: &str) {
    for (i, gw) in fleet.gateways.iter().enumerate() {
        let waited = wait_for_limit(gw, tenant, limit, Duration::from_secs(1)).await;
        assert!(
            waited.is_some(),
            "gateway {i} did not apply limit {limit} for {tenant} within 1 s"
        );
    }
}

/// `method path` on `gw`'s admin API with the admin token.
async fn with_token(gw: &Gateway, method: &str, path: &str) -> (u16, serde_json::Value) {
    admin(gw, method, path, Some(TOKEN), None).await
}

/// `PUT path` on `gw`'s admin API with the admin token and `body`.
async fn put(gw: &Gateway, path: &str, body: &str) -> (u16, serde_json::Value) {
    admin(gw, "PUT", path, Some(TOKEN), Some(body)).await
}

#[actix_web::test]
async fn an_admin_put_through_one_gateway_is_enforced_by_both_within_one_second() {
    let fleet = fleet(2);
    let (a, b) = (&fleet.gateways[0], &fleet.gateways[1]);
    assert_eq!(
        limit_of(b, "acme").await.as_deref(),
        Some("2"),
        "default rule before"
    );

    let (status, row) = put(
        a,
        "/admin/rules/acme/api",
        r#"{"capacity": 40, "refill_per_second": 7}"#,
    )
    .await;
    assert_eq!(status, 201, "{row}");
    assert_eq!(
        (
            row["tenant"].as_str(),
            row["capacity"].as_i64(),
            row["refill_per_second"].as_i64()
        ),
        (Some("acme"), Some(40), Some(7))
    );
    assert!(
        row["updated_at"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{row}"
    );
    all_reach(&fleet, "acme", "40").await;

    let (status, row) = put(
        b,
        "/admin/rules/acme/api",
        r#"{"capacity": 41, "refill_per_second": 7}"#,
    )
    .await;
    assert_eq!((status, row["capacity"].as_i64()), (200, Some(41)));
    all_reach(&fleet, "acme", "41").await;

    // Hot-key options travel the same way: a sharded rule is enforced in
    // untagged sub-bucket keys on every gateway.
    let (status, row) = put(
        a,
        "/admin/rules/wide/api",
        r#"{"capacity": 40, "refill_per_second": 4, "shards": 4, "exact": true}"#,
    )
    .await;
    assert_eq!(
        (status, row["shards"].as_i64(), row["exact"].as_bool()),
        (201, Some(4), Some(true))
    );
    all_reach(&fleet, "wide", "40").await;
    let sub_buckets = fleet.redis.cmd(&["KEYS", "rl2:wide:api:*"]);
    assert!(
        !sub_buckets.starts_with("*0"),
        "sub-bucket keys exist: {sub_buckets}"
    );

    let (status, row) = with_token(a, "GET", "/admin/rules/acme/api").await;
    assert_eq!((status, row["capacity"].as_i64()), (200, Some(41)));

    let (status, _) = with_token(a, "DELETE", "/admin/rules/acme/api").await;
    assert_eq!(status, 204);
    all_reach(&fleet, "acme", "2").await;
    assert_eq!(with_token(a, "GET", "/admin/rules/acme/api").await.0, 404);
    assert_eq!(
        with_token(a, "DELETE", "/admin/rules/acme/api").await.0,
        404
    );
}

#[actix_web::test]
async fn a_rule_name_is_stored_and_labels_the_tenant_on_every_gateway() {
    let fleet = fleet(2);
    let (a, b) = (&fleet.gateways[0], &fleet.gateways[1]);
    let (status, row) = put(
        a,
        "/admin/rules/sk-named-key/api",
        r#"{"capacity": 30, "refill_per_second": 3, "name": "Pg Named Tenant"}"#,
    )
    .await;
    assert_eq!(
        (status, row["name"].as_str()),
        (201, Some("Pg Named Tenant"))
    );
    all_reach(&fleet, "sk-named-key", "30").await;
    // Served by gateway b only: the named series counts it only if b's own
    // labels carry the name that travelled in the change event.
    let series = |outcome: &str| {
        format!(
            "tollgate_requests_total{{route=\"api\",tenant=\"Pg Named Tenant\",outcome=\"{outcome}\",entry=\"proxy\"}}"
        )
    };
    let answered = || async {
        let allowed = metric(b, &series("allowed"))
            .await
            .expect("allowed exported");
        allowed
            + metric(b, &series("rejected"))
                .await
                .expect("rejected exported")
    };
    let before = answered().await;
    limit_of(b, "sk-named-key").await;
    let after = answered().await;
    assert_eq!(after, before + 1.0);
    let (_, text) = admin(b, "GET", "/metrics", None, None).await;
    assert!(!text.as_str().unwrap().contains("sk-named-key"));

    // The table refuses a name the gateway would refuse.
    fleet
        .db
        .refuses("UPDATE rate_limit_rule SET name = '_other' WHERE tenant_id = 'sk-named-key'");
    let (_, row) = with_token(a, "GET", "/admin/rules/sk-named-key/api").await;
    assert_eq!(row["name"], "Pg Named Tenant");
}

#[actix_web::test]
async fn plain_sql_changes_propagate_like_api_writes() {
    let fleet = fleet(2);
    fleet.db.sql("INSERT INTO rate_limit_rule (tenant_id, route_id, capacity, refill_per_second) VALUES ('sql-t', 'api', 11, 1)");
    all_reach(&fleet, "sql-t", "11").await;
    fleet
        .db
        .sql("UPDATE rate_limit_rule SET capacity = 12 WHERE tenant_id = 'sql-t'");
    all_reach(&fleet, "sql-t", "12").await;
    fleet
        .db
        .sql("UPDATE rate_limit_rule SET tenant_id = 'sql-u' WHERE tenant_id = 'sql-t'");
    all_reach(&fleet, "sql-t", "2").await;
    all_reach(&fleet, "sql-u", "12").await;
    fleet.db.sql("TRUNCATE rate_limit_rule");
    all_reach(&fleet, "sql-u", "2").await;
    // One transaction passing through a state twice: PostgreSQL folds
    // identical notifications of one transaction into one, so each change
    // event must differ, or the gateways would stop at 13.
    fleet.db.sql("INSERT INTO rate_limit_rule (tenant_id, route_id, capacity, refill_per_second) VALUES ('sql-v', 'api', 13, 1)");
    all_reach(&fleet, "sql-v", "13").await;
    fleet.db.sql(
        "BEGIN; UPDATE rate_limit_rule SET capacity = 14; UPDATE rate_limit_rule SET capacity = 13; \
         UPDATE rate_limit_rule SET capacity = 14; COMMIT",
    );
    all_reach(&fleet, "sql-v", "14").await;
}

#[actix_web::test]
async fn invalid_writes_are_refused_with_the_field_and_change_nothing() {
    let fleet = fleet(1);
    let gw = &fleet.gateways[0];
    let ok = r#"{"capacity": 5, "refill_per_second": 1}"#;
    assert_eq!(put(gw, "/admin/rules/keep/api", ok).await.0, 201);

    let cases = [
        (
            "/admin/rules/keep/api",
            r#"{"capacity": 0, "refill_per_second": 1}"#,
            "capacity",
        ),
        (
            "/admin/rules/keep/api",
            r#"{"capacity": 2147483648, "refill_per_second": 1}"#,
            "capacity",
        ),
        (
            "/admin/rules/keep/api",
            r#"{"capacity": 5, "refill_per_second": -1}"#,
            "refill_per_second",
        ),
        (
            "/admin/rules/keep/api",
            r#"{"capacity": 5}"#,
            "refill_per_second",
        ),
        (
            "/admin/rules/keep/api",
            r#"{"capacity": "9", "refill_per_second": 1}"#,
            "capacity",
        ),
        (
            "/admin/rules/keep/api",
            r#"{"capacity": 5, "refill_per_second": 1, "burst": 2}"#,
            "burst",
        ),
        ("/admin/rules/keep/api", "not json", "body"),
        // A key named twice is refused, not settled by the last copy.
        (
            "/admin/rules/keep/api",
            r#"{"capacity": 5, "refill_per_second": 1, "capacity": 5000}"#,
            "capacity",
        ),
        (
            "/admin/rules/keep/api",
            r#"{"capacity": 5, "refill_per_second": 1, "limits": [{"quota": 9, "window": "day", "quota": 1}]}"#,
            "limits[0].quota",
        ),
        ("/admin/rules/ke%7Bep/api", ok, "tenant"),
        (
            &format!("/admin/rules/{}/api", "t".repeat(65)),
            ok,
            "tenant",
        ),
        ("/admin/rules/keep/a%20pi", ok, "route"),
        // A well-formed id, but no route of this gateway's has it.
        ("/admin/rules/keep/no-such-route", ok, "route"),
    ];
    for (path, body, field) in cases {
        let (status, error) = put(gw, path, body).await;
        assert_eq!(status, 400, "{path} {body}: {error}");
        assert_eq!(error["field"], field, "{path} {body}: {error}");
        assert_eq!(error["error"], "invalid_request");
    }
    let large = " ".repeat(70_000);
    let (status, error) = put(gw, "/admin/rules/keep/api", &large).await;
    assert_eq!(
        (status, error["field"].as_str()),
        (413, Some("body")),
        "{error}"
    );
    let (_, row) = with_token(gw, "GET", "/admin/rules/keep/api").await;
    assert_eq!(row["capacity"], 5, "nothing changed");
    assert_eq!(fleet.db.sql("SELECT count(*) FROM rate_limit_rule"), "1");
}

#[actix_web::test]
async fn writes_need_the_bearer_token() {
    let fleet = fleet(1);
    let gw = &fleet.gateways[0];
    let body = Some(r#"{"capacity": 5, "refill_per_second": 1}"#);
    assert_eq!(
        admin(gw, "PUT", "/admin/rules/t/api", None, body).await.0,
        401
    );
    assert_eq!(
        admin(gw, "PUT", "/admin/rules/t/api", Some("wrong"), body)
            .await
            .0,
        401
    );
    assert_eq!(
        admin(gw, "PUT", "/admin/rules/t/api", Some(&TOKEN[..4]), body)
            .await
            .0,
        401
    );
    assert_eq!(
        admin(gw, "DELETE", "/admin/rules/t/api", None, None)
            .await
            .0,
        401
    );
    assert_eq!(
        admin(gw, "PUT", "/admin/rules/t/api", Some(READ_TOKEN), body)
            .await
            .0,
        401,
        "the read token cannot write"
    );
    assert_eq!(fleet.db.sql("SELECT count(*) FROM rate_limit_rule"), "0");
    assert_eq!(
        admin(gw, "PUT", "/admin/rules/t/api", Some(TOKEN), body)
            .await
            .0,
        201
    );
}

#[actix_web::test]
async fn rules_are_listed_in_pages_and_by_tenant() {
    let fleet = fleet(1);
    let gw = &fleet.gateways[0];
    fleet.db.sql(
        "INSERT INTO rate_limit_rule (tenant_id, route_id, capacity, refill_per_second) VALUES \
         ('a', 'r1', 1, 1), ('a', 'r2', 2, 1), ('b', 'r1', 3, 1), ('b', 'r2', 4, 1), ('c', 'r1', 5, 1)",
    );
    let mut seen = Vec::new();
    let mut path = "/admin/rules?limit=2".to_owned();
    loop {
        let (status, page) = with_token(gw, "GET", &path).await;
        assert_eq!(status, 200, "{page}");
        let rules = page["rules"].as_array().unwrap();
        assert!(rules.len() <= 2);
        seen.extend(rules.iter().map(|r| {
            format!(
                "{}/{}",
                r["tenant"].as_str().unwrap(),
                r["route"].as_str().unwrap()
            )
        }));
        match page["next_after"].as_str() {
            Some(next) => path = format!("/admin/rules?limit=2&after={next}"),
            None => break,
        }
    }
    assert_eq!(seen, vec!["a/r1", "a/r2", "b/r1", "b/r2", "c/r1"]);

    let (_, page) = with_token(gw, "GET", "/admin/rules?tenant=b").await;
    assert_eq!(common::each(&page["rules"], "capacity"), [3, 4]);
    assert_eq!(
        with_token(gw, "GET", "/admin/rules?limit=0").await.1["field"],
        "limit"
    );
    assert_eq!(
        with_token(gw, "GET", "/admin/rules?page=2").await.1["field"],
        "page"
    );
}

#[actix_web::test]
async fn file_mode_lists_rules_but_refuses_writes_with_409() {
    let rules = "[[rule]]\ntenant = \"f\"\nroute = \"api\"\ncapacity = 9\nrefill_per_second = 1\n";
    // No admin token (writes disabled), only a read token. The 409 says
    // where rules come from, before any token check.
    let s = common::Stack::start("filemode", rules, |config, _| {
        config.admin_read_token = TOKEN.to_owned();
    });
    let gw = &s.gw;
    let put = r#"{"capacity": 5, "refill_per_second": 1}"#;
    for (method, body) in [("PUT", Some(put)), ("DELETE", None)] {
        let (status, error) = admin(gw, method, "/admin/rules/f/api", None, body).await;
        assert_eq!(
            (status, error["error"].as_str()),
            (409, Some("rules_from_file")),
            "{method}"
        );
    }
    let (status, page) = with_token(gw, "GET", "/admin/rules").await;
    assert_eq!(status, 200);
    assert_eq!(page["rules"][0]["capacity"], 9);
    assert_eq!(
        with_token(gw, "GET", "/admin/rules/f/api").await.1["capacity"],
        9
    );
}

#[actix_web::test]
async fn writes_are_disabled_when_no_token_is_configured() {
    let redis = RedisServer::start();
    let up = Upstream::start();
    let db = TestDatabase::create();
    let dir = TempDir::new("notoken");
    let mut config = GatewayConfig::new(&redis.url(), dir.0.join("unused.toml"), &up.url());
    config.database_url = db.url();
    config.rules_extra = "snapshot_file = \"\"".into();
    let gw = Gateway::start(&config);
    let (status, error) = admin(
        &gw,
        "PUT",
        "/admin/rules/t/api",
        Some(""),
        Some(r#"{"capacity": 5, "refill_per_second": 1}"#),
    )
    .await;
    assert_eq!(
        (status, error["error"].as_str()),
        (403, Some("writes_disabled"))
    );
}

#[actix_web::test]
async fn a_rule_put_in_shadow_mode_forwards_refusals_on_every_gateway() {
    let fleet = fleet(2);
    let (a, b) = (&fleet.gateways[0], &fleet.gateways[1]);
    let (status, row) = put(
        a,
        "/admin/rules/dry-run/api",
        r#"{"capacity": 1, "refill_per_second": 1, "mode": "shadow"}"#,
    )
    .await;
    assert_eq!((status, row["mode"].as_str()), (201, Some("shadow")));
    all_reach(&fleet, "dry-run", "1").await;
    // The change event carried the mode: b forwards what the bucket refuses.
    let seen = answers(&b.url("/x"), "dry-run", 3).await;
    assert!(seen.iter().all(|(status, _)| *status == 200), "{seen:?}");
    assert_eq!(seen[2].1.as_deref(), Some("0"));

    // The table refuses a mode the gateway would refuse.
    fleet
        .db
        .refuses("UPDATE rate_limit_rule SET mode = 'dry' WHERE tenant_id = 'dry-run'");
    // Back to enforcing, by plain SQL: the third request is a 429 again.
    fleet.db.sql(
        "UPDATE rate_limit_rule SET mode = 'enforce', capacity = 2 WHERE tenant_id = 'dry-run'",
    );
    all_reach(&fleet, "dry-run", "2").await;
    let seen = answers(&b.url("/x"), "dry-run", 3).await;
    assert!(seen.iter().any(|(status, _)| *status == 429), "{seen:?}");
}

/// Waits until every gateway of `fleet` holds `n` rules (a `/ready`
/// without a rule count is not an answer).
async fn all_hold(fleet: &Fleet, n: u64) {
    for (i, gw) in fleet.gateways.iter().enumerate() {
        let held = || async { ready(gw).await["rules"]["count"].as_u64() };
        if !eventually(Duration::from_secs(1), || async { held().await == Some(n) }).await {
            panic!("gateway {i} holds {:?} rules, not {n}", held().await);
        }
    }
}

#[actix_web::test]
async fn quotas_and_tenant_wide_rules_travel_through_the_database() {
    let fleet = fleet(2);
    let (a, b) = (&fleet.gateways[0], &fleet.gateways[1]);
    // A tenant-wide rule of one quota: 3 requests a day on every route.
    let (status, row) = put(
        a,
        "/admin/rules/acme/*",
        r#"{"limits": [{"quota": 3, "window": "day"}]}"#,
    )
    .await;
    assert_eq!(status, 201, "{row}");
    assert_eq!(row["route"], "*");
    assert_eq!(row["capacity"], serde_json::Value::Null);
    assert_eq!(
        row["limits"],
        serde_json::json!([{"quota": 3, "window": "day"}])
    );
    all_hold(&fleet, 1).await;
    // The default rule (2 tokens at 1/s) and the quota, on both gateways.
    let mut statuses = Vec::new();
    for (gw, path) in [(a, "/one"), (b, "/two"), (a, "/three")] {
        statuses.push(get(&gw.url(path), Some("acme")).await.0);
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    assert_eq!(statuses, [200, 200, 200]);
    // The quota refuses the fourth: a wait for its day, not a second.
    let refused = get_as(&common::client(), &b.url("/four"), "acme").await;
    assert_eq!(refused.status(), 429);
    let retry: u64 = common::header(&refused, "retry-after")
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry > 1, "retry after {retry} s");
    assert!(
        common::header(&refused, "ratelimit-policy")
            .unwrap()
            .contains("\"*.1\";q=3;w=86400"),
        "the tenant-wide quota is listed"
    );

    // More than eight limits in force together are refused by field.
    let nine = format!(
        r#"{{"capacity": 1, "refill_per_second": 1, "limits": [{}]}}"#,
        [r#"{"capacity": 5, "refill_per_second": 1}"#; 7].join(", ")
    );
    let (status, body) = put(a, "/admin/rules/acme/api", &nine).await;
    assert_eq!(
        (status, body["field"].as_str()),
        (400, Some("limits")),
        "{body}"
    );

    // The table refuses half a first bucket, and a rule with no limit.
    fleet.db.refuses(
        "INSERT INTO rate_limit_rule (tenant_id, route_id, capacity) VALUES ('x', 'api', 5)",
    );
    fleet
        .db
        .refuses("INSERT INTO rate_limit_rule (tenant_id, route_id) VALUES ('x', 'api')");
    // Deleting the tenant-wide rule reaches every gateway.
    let (status, _) = with_token(a, "DELETE", "/admin/rules/acme/*").await;
    assert_eq!(status, 204);
    all_hold(&fleet, 0).await;
}

#[actix_web::test]
async fn existing_rows_become_one_limit_rules_when_migrated() {
    let db = TestDatabase::create();
    // The schema as migrations 1 to 7 left it, with a rule in it.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .collect();
    files.sort();
    for file in files
        .iter()
        .filter(|f| !f.ends_with("0008_rule_limits.sql"))
    {
        db.sql(&std::fs::read_to_string(file).unwrap());
    }
    db.sql(
        "INSERT INTO rate_limit_rule (tenant_id, route_id, capacity, refill_per_second) \
         VALUES ('old', 'api', 7, 3)",
    );
    db.sql(&std::fs::read_to_string(dir.join("0008_rule_limits.sql")).unwrap());
    let store =
        tollgate::db::RuleStore::new(tollgate::db::Database::connect_lazy(&db.url()).unwrap());
    let rules = store.load_all().await.unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].limit.capacity.get(), 7);
    assert_eq!(rules[0].limits().count(), 1);
    assert_eq!(
        db.sql("SELECT limits::text FROM rate_limit_rule").trim(),
        "[]"
    );
}
