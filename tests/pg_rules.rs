//! Rules in PostgreSQL: propagation to every gateway, the admin API, and
//! its validation and auth.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{
    Gateway, GatewayConfig, RedisServer, TempDir, TestDatabase, Upstream, admin, get, limit_of,
    metric, ready, wait_for_limit,
};

const TOKEN: &str = "s3cret-token";
const READ_TOKEN: &str = "read-only-token";

struct Fleet {
    db: TestDatabase,
    gateways: Vec<Gateway>,
    redis: RedisServer,
    _up: Upstream,
    _dir: TempDir,
}

/// `n` gateways on one database and one Redis, admin token [`TOKEN`] and
/// read token [`READ_TOKEN`].
fn fleet(n: usize) -> Fleet {
    let db = TestDatabase::create();
    let redis = RedisServer::start();
    let up = Upstream::start();
    let dir = TempDir::new("pg");
    let gateways = (0..n)
        .map(|i| {
            let mut config = GatewayConfig::new(&redis.url(), dir.0.join("unused.toml"), &up.url());
            config.database_url = db.url();
            config.admin_token = TOKEN.to_owned();
            config.admin_read_token = READ_TOKEN.to_owned();
            config.rules_extra = format!(
                "snapshot_file = \"{}\"",
                dir.0.join(format!("snap-{i}.json")).display()
            );
            Gateway::start(&config)
        })
        .collect();
    Fleet {
        db,
        gateways,
        redis,
        _up: up,
        _dir: dir,
    }
}

/// Whether the database refuses `sql` (a constraint, say).
fn table_refuses(db: &TestDatabase, sql: &str) -> bool {
    let out = std::process::Command::new("psql")
        .args([
            "-X",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            db.url().as_str(),
            "-c",
            sql,
        ])
        .output()
        .unwrap();
    !out.status.success()
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

#[actix_web::test]
async fn an_admin_put_through_one_gateway_is_enforced_by_both_within_one_second() {
    let fleet = fleet(2);
    let (a, b) = (&fleet.gateways[0], &fleet.gateways[1]);
    assert_eq!(
        limit_of(b, "acme").await.as_deref(),
        Some("2"),
        "default rule before"
    );

    let (status, row) = admin(
        a,
        "PUT",
        "/admin/rules/acme/api",
        Some(TOKEN),
        Some(r#"{"capacity": 40, "refill_per_second": 7}"#),
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

    let (status, row) = admin(
        b,
        "PUT",
        "/admin/rules/acme/api",
        Some(TOKEN),
        Some(r#"{"capacity": 41, "refill_per_second": 7}"#),
    )
    .await;
    assert_eq!((status, row["capacity"].as_i64()), (200, Some(41)));
    all_reach(&fleet, "acme", "41").await;

    // Hot-key options travel the same way: a sharded rule is enforced in
    // untagged sub-bucket keys on every gateway.
    let (status, row) = admin(
        a,
        "PUT",
        "/admin/rules/wide/api",
        Some(TOKEN),
        Some(r#"{"capacity": 40, "refill_per_second": 4, "shards": 4, "exact": true}"#),
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

    let (status, row) = admin(a, "GET", "/admin/rules/acme/api", Some(TOKEN), None).await;
    assert_eq!((status, row["capacity"].as_i64()), (200, Some(41)));

    let (status, _) = admin(a, "DELETE", "/admin/rules/acme/api", Some(TOKEN), None).await;
    assert_eq!(status, 204);
    all_reach(&fleet, "acme", "2").await;
    assert_eq!(
        admin(a, "GET", "/admin/rules/acme/api", Some(TOKEN), None)
            .await
            .0,
        404
    );
    assert_eq!(
        admin(a, "DELETE", "/admin/rules/acme/api", Some(TOKEN), None)
            .await
            .0,
        404
    );
}

#[actix_web::test]
async fn a_rule_name_is_stored_and_labels_the_tenant_on_every_gateway() {
    let fleet = fleet(2);
    let (a, b) = (&fleet.gateways[0], &fleet.gateways[1]);
    let (status, row) = admin(
        a,
        "PUT",
        "/admin/rules/sk-named-key/api",
        Some(TOKEN),
        Some(r#"{"capacity": 30, "refill_per_second": 3, "name": "Pg Named Tenant"}"#),
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
    let before = metric(b, &series("allowed")).await + metric(b, &series("rejected")).await;
    limit_of(b, "sk-named-key").await;
    let after = metric(b, &series("allowed")).await + metric(b, &series("rejected")).await;
    assert_eq!(after, before + 1.0);
    let (_, text) = admin(b, "GET", "/metrics", None, None).await;
    assert!(!text.as_str().unwrap().contains("sk-named-key"));

    // The table refuses a name the gateway would refuse.
    assert!(
        table_refuses(
            &fleet.db,
            "UPDATE rate_limit_rule SET name = '_other' WHERE tenant_id = 'sk-named-key'"
        ),
        "the check constraint refuses '_other'"
    );
    let (_, row) = admin(a, "GET", "/admin/rules/sk-named-key/api", Some(TOKEN), None).await;
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
    assert_eq!(
        admin(gw, "PUT", "/admin/rules/keep/api", Some(TOKEN), Some(ok))
            .await
            .0,
        201
    );

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
        let (status, error) = admin(gw, "PUT", path, Some(TOKEN), Some(body)).await;
        assert_eq!(status, 400, "{path} {body}: {error}");
        assert_eq!(error["field"], field, "{path} {body}: {error}");
        assert_eq!(error["error"], "invalid_request");
    }
    let large = " ".repeat(70_000);
    let (status, error) = admin(
        gw,
        "PUT",
        "/admin/rules/keep/api",
        Some(TOKEN),
        Some(&large),
    )
    .await;
    assert_eq!(
        (status, error["field"].as_str()),
        (413, Some("body")),
        "{error}"
    );
    let (_, row) = admin(gw, "GET", "/admin/rules/keep/api", Some(TOKEN), None).await;
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
        let (status, page) = admin(gw, "GET", &path, Some(TOKEN), None).await;
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

    let (_, page) = admin(gw, "GET", "/admin/rules?tenant=b", Some(TOKEN), None).await;
    let caps: Vec<i64> = page["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["capacity"].as_i64().unwrap())
        .collect();
    assert_eq!(caps, vec![3, 4]);
    assert_eq!(
        admin(gw, "GET", "/admin/rules?limit=0", Some(TOKEN), None)
            .await
            .1["field"],
        "limit"
    );
    assert_eq!(
        admin(gw, "GET", "/admin/rules?page=2", Some(TOKEN), None)
            .await
            .1["field"],
        "page"
    );
}

#[actix_web::test]
async fn file_mode_lists_rules_but_refuses_writes_with_409() {
    let redis = RedisServer::start();
    let up = Upstream::start();
    let dir = TempDir::new("filemode");
    let rules = dir.file(
        "rules.toml",
        "[[rule]]\ntenant = \"f\"\nroute = \"api\"\ncapacity = 9\nrefill_per_second = 1\n",
    );
    // No admin token (writes disabled), only a read token. The 409 says
    // where rules come from, before any token check.
    let mut config = GatewayConfig::new(&redis.url(), rules, &up.url());
    config.admin_read_token = TOKEN.to_owned();
    let gw = Gateway::start(&config);
    let put = r#"{"capacity": 5, "refill_per_second": 1}"#;
    for (method, body) in [("PUT", Some(put)), ("DELETE", None)] {
        let (status, error) = admin(&gw, method, "/admin/rules/f/api", None, body).await;
        assert_eq!(
            (status, error["error"].as_str()),
            (409, Some("rules_from_file")),
            "{method}"
        );
    }
    let (status, page) = admin(&gw, "GET", "/admin/rules", Some(TOKEN), None).await;
    assert_eq!(status, 200);
    assert_eq!(page["rules"][0]["capacity"], 9);
    assert_eq!(
        admin(&gw, "GET", "/admin/rules/f/api", Some(TOKEN), None)
            .await
            .1["capacity"],
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
    let (status, row) = admin(
        a,
        "PUT",
        "/admin/rules/dry-run/api",
        Some(TOKEN),
        Some(r#"{"capacity": 1, "refill_per_second": 1, "mode": "shadow"}"#),
    )
    .await;
    assert_eq!((status, row["mode"].as_str()), (201, Some("shadow")));
    all_reach(&fleet, "dry-run", "1").await;
    // The change event carried the mode: b forwards what the bucket refuses.
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(get(&b.url("/x"), Some("dry-run")).await);
    }
    assert!(seen.iter().all(|(status, _)| *status == 200), "{seen:?}");
    assert_eq!(seen[2].1.as_deref(), Some("0"));

    // The table refuses a mode the gateway would refuse.
    assert!(table_refuses(
        &fleet.db,
        "UPDATE rate_limit_rule SET mode = 'dry' WHERE tenant_id = 'dry-run'"
    ));
    // Back to enforcing, by plain SQL: the third request is a 429 again.
    fleet.db.sql(
        "UPDATE rate_limit_rule SET mode = 'enforce', capacity = 2 WHERE tenant_id = 'dry-run'",
    );
    all_reach(&fleet, "dry-run", "2").await;
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(get(&b.url("/x"), Some("dry-run")).await.0);
    }
    assert!(statuses.contains(&429), "{statuses:?}");
}

/// Waits until every gateway of `fleet` holds `n` rules (a `/ready`
/// without a rule count is not an answer).
async fn all_hold(fleet: &Fleet, n: u64) {
    for (i, gw) in fleet.gateways.iter().enumerate() {
        let mut held = None;
        for _ in 0..50 {
            held = ready(gw).await["rules"]["count"].as_u64();
            if held == Some(n) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(held, Some(n), "gateway {i} holds {held:?} rules, not {n}");
    }
}

#[actix_web::test]
async fn quotas_and_tenant_wide_rules_travel_through_the_database() {
    let fleet = fleet(2);
    let (a, b) = (&fleet.gateways[0], &fleet.gateways[1]);
    // A tenant-wide rule of one quota: 3 requests a day on every route.
    let (status, row) = admin(
        a,
        "PUT",
        "/admin/rules/acme/*",
        Some(TOKEN),
        Some(r#"{"limits": [{"quota": 3, "window": "day"}]}"#),
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
    let refused = common::client()
        .get(b.url("/four"))
        .insert_header(("x-api-key", "acme"))
        .send()
        .await
        .unwrap();
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
    let (status, body) = admin(a, "PUT", "/admin/rules/acme/api", Some(TOKEN), Some(&nine)).await;
    assert_eq!(
        (status, body["field"].as_str()),
        (400, Some("limits")),
        "{body}"
    );

    // The table refuses half a first bucket, and a rule with no limit.
    assert!(table_refuses(
        &fleet.db,
        "INSERT INTO rate_limit_rule (tenant_id, route_id, capacity) VALUES ('x', 'api', 5)"
    ));
    assert!(table_refuses(
        &fleet.db,
        "INSERT INTO rate_limit_rule (tenant_id, route_id) VALUES ('x', 'api')"
    ));
    // Deleting the tenant-wide rule reaches every gateway.
    let (status, _) = admin(a, "DELETE", "/admin/rules/acme/*", Some(TOKEN), None).await;
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
    let store = tollgate::rules::RuleStore::connect_lazy(&db.url()).unwrap();
    let rules = store.load_all().await.unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].limit.capacity.get(), 7);
    assert_eq!(rules[0].limits().count(), 1);
    assert_eq!(
        db.sql("SELECT limits::text FROM rate_limit_rule").trim(),
        "[]"
    );
}
