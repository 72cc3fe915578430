//! Region shares: the admin API validates and stores them, and every
//! gateway enforces its region's share of each limit within a second.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{
    Gateway, GatewayConfig, RedisServer, Stack, TempDir, TestDatabase, Upstream, admin,
    assert_limit_becomes,
};

const TOKEN: &str = "shares-token";

/// `PUT path` on `gw`'s admin API with the admin token and `body`.
async fn put(gw: &Gateway, path: &str, body: &str) -> (u16, serde_json::Value) {
    admin(gw, "PUT", path, Some(TOKEN), Some(body)).await
}

#[actix_web::test]
async fn shares_are_validated_stored_and_enforced_per_region() {
    let db = TestDatabase::create();
    let (eu_redis, us_redis) = (RedisServer::start(), RedisServer::start());
    let up = Upstream::start();
    let dir = TempDir::new("shares");
    std::fs::create_dir_all(dir.0.join("regions")).unwrap();
    for (id, share, redis) in [("eu", 0.7, &eu_redis), ("us", 0.3, &us_redis)] {
        dir.file(
            &format!("regions/{id}.toml"),
            &format!(
                "id = \"{id}\"\ndefault_share = {share}\n[redis]\nurl = \"{}\"\n",
                redis.url()
            ),
        );
    }
    let gateway = |region: &str| {
        let mut config =
            GatewayConfig::new("redis://unused:1", dir.0.join("unused.toml"), &up.url());
        config.database_url = db.url();
        config.admin_token = TOKEN.to_owned();
        config.rules_extra = "snapshot_file = \"\"".into();
        config.extra.push_str(&format!(
            "[instance]\nregion = \"{region}\"\n[regions]\ndir = \"{}\"\n",
            dir.0.join("regions").display()
        ));
        Gateway::start(&config)
    };
    let (eu, us) = (gateway("eu"), gateway("us"));

    for tenant in ["t", "u"] {
        let path = format!("/admin/rules/{tenant}/api");
        let (status, _) = put(&eu, &path, r#"{"capacity": 100, "refill_per_second": 10}"#).await;
        assert_eq!(status, 201, "{tenant}");
    }
    // The region defaults apply: 70 and 30 of the 100-token limit.
    assert_limit_becomes(&eu, "t", "70", Duration::from_secs(1)).await;
    assert_limit_becomes(&us, "t", "30", Duration::from_secs(1)).await;
    // Each region's own Redis holds its bucket.
    assert!(eu_redis.cmd(&["EXISTS", "rl2:{t}:api"]).contains(":1"));
    assert!(us_redis.cmd(&["EXISTS", "rl2:{t}:api"]).contains(":1"));

    for (body, why) in [
        (r#"{"shares": {"eu": 0.6, "us": 0.3}}"#, "does not sum to 1"),
        (r#"{"shares": {"eu": 1.0}}"#, "misses a region"),
        (
            r#"{"shares": {"eu": 0.5, "us": 0.5, "mars": 0.0}}"#,
            "names an unknown region",
        ),
        (r#"{"shares": {"eu": 1.2, "us": -0.2}}"#, "is out of range"),
        (
            r#"{"shares": {"eu": 5e-324, "us": 1.0}}"#,
            "is below the floor",
        ),
        (
            r#"{"shares": {"eu": 1e-17, "us": 1.0}}"#,
            "is below the floor",
        ),
    ] {
        let (status, error) = put(&eu, "/admin/shares", body).await;
        assert_eq!(
            (status, error["field"].as_str()),
            (400, Some("shares")),
            "{why}: {error}"
        );
    }
    let (status, error) = put(
        &eu,
        "/admin/shares",
        r#"{"tenant": "{x}", "shares": {"eu": 0.5, "us": 0.5}}"#,
    )
    .await;
    assert_eq!((status, error["field"].as_str()), (400, Some("tenant")));
    assert_eq!(
        admin(
            &eu,
            "PUT",
            "/admin/shares",
            None,
            Some(r#"{"shares": {"eu": 0.5, "us": 0.5}}"#)
        )
        .await
        .0,
        401
    );
    assert_eq!(
        db.sql("SELECT count(*) FROM region_share"),
        "0",
        "nothing was written"
    );
    let (_, error) = put(
        &eu,
        "/admin/shares",
        r#"{"shares": {"eu": 0.0001, "us": 0.9999}}"#,
    )
    .await;
    assert_eq!(
        error["message"].as_str(),
        Some("eu: must be a number in [0.001, 1], found 0.0001"),
        "{error}"
    );
    // The table holds the same floor for writes that bypass the API.
    let refused = db.refuses("INSERT INTO region_share (region_id, share) VALUES ('eu', 0.0001)");
    assert!(refused.contains("region_share_share_check"), "{refused}");

    // A tenant-specific split, then a global one: the most specific wins.
    let (status, _) = put(
        &us,
        "/admin/shares",
        r#"{"tenant": "t", "shares": {"eu": 0.2, "us": 0.8}}"#,
    )
    .await;
    assert_eq!(status, 200);
    assert_limit_becomes(&eu, "t", "20", Duration::from_secs(1)).await;
    assert_limit_becomes(&us, "t", "80", Duration::from_secs(1)).await;
    let (status, _) = put(
        &us,
        "/admin/shares",
        r#"{"shares": {"eu": 0.4, "us": 0.6}}"#,
    )
    .await;
    assert_eq!(status, 200);
    // u's 100 x the global 0.4.
    assert_limit_becomes(&eu, "u", "40", Duration::from_secs(1)).await;
    assert_eq!(common::limit_of(&eu, "t").await.as_deref(), Some("20"));

    let (_, listing) = admin(&eu, "GET", "/admin/shares", Some(TOKEN), None).await;
    assert_eq!(listing["region"], "eu");
    assert_eq!(listing["rows"].as_array().unwrap().len(), 4);
    assert_eq!(common::each(&listing["regions"], "share"), [0.4, 0.6]);

    assert_eq!(
        admin(&eu, "DELETE", "/admin/shares?tenant=t", Some(TOKEN), None)
            .await
            .0,
        204
    );
    // Back to the global 0.4.
    assert_limit_becomes(&eu, "t", "40", Duration::from_secs(1)).await;
    assert_eq!(
        admin(&eu, "DELETE", "/admin/shares?tenant=t", Some(TOKEN), None)
            .await
            .0,
        404
    );
}

#[actix_web::test]
async fn without_regions_share_writes_are_refused() {
    let s = Stack::start("noregions", "", |config, _| {
        config.admin_token = TOKEN.to_owned();
    });
    let gw = &s.gw;
    let (status, error) = put(gw, "/admin/shares", r#"{"shares": {}}"#).await;
    assert_eq!(
        (status, error["error"].as_str()),
        (409, Some("shares_unavailable"))
    );
    let (status, listing) = admin(gw, "GET", "/admin/shares", Some(TOKEN), None).await;
    assert_eq!(
        (status, listing["region"].clone()),
        (200, serde_json::Value::Null)
    );
}

#[actix_web::test]
async fn recorded_decisions_keep_the_newest_hundred_in_order() {
    use std::collections::BTreeMap;

    use sqlx::Connection as _;
    use tollgate::db::Database;
    use tollgate::db::shares::{Decision, ShareStore};
    use tollgate::region::shares::Scope;

    let db = TestDatabase::create();
    let database = Database::connect_lazy(&db.url()).unwrap();
    database.migrate().await.unwrap();
    let store = ShareStore::new(database);
    let mut conn = sqlx::PgConnection::connect(&db.url()).await.unwrap();
    let global = Scope {
        tenant: None,
        route: None,
    };
    for round in 0..105 {
        let shares = BTreeMap::from([("eu".to_owned(), 0.5), ("us".to_owned(), 0.5)]);
        let decision = Decision {
            instance: "gw-test",
            changes: serde_json::json!([{ "round": round }]),
        };
        ShareStore::replace_on(&mut conn, &[(global.clone(), shares)], Some(&decision))
            .await
            .unwrap();
    }
    assert_eq!(db.sql("SELECT count(*) FROM rebalance_decision"), "100");
    let latest = store.decisions(3).await.unwrap();
    let rounds: Vec<_> = latest
        .iter()
        .map(|d| d.changes[0]["round"].clone())
        .collect();
    assert_eq!(rounds, [104, 103, 102]);
    assert!(latest.iter().all(|d| d.instance_id == "gw-test"));
}
