//! Redis reached as managed services require: TLS verified against a CA
//! (with a client certificate), ACL users with the password in a file,
//! and `check-config` refusing what would not work. Real `redis-server`
//! processes in TLS mode, with certificates made by `openssl`.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::num::NonZeroU32;
use std::process::Command;
use std::time::Duration;

use common::certs::{TestPki, make_signed};
use common::{
    Access, Gateway, GatewayConfig, GatewayProcess, RedisCluster, RedisSentinel, RedisServer,
    SENTINEL_MASTER, TempDir, TlsAccess, Upstream, eventually, get, ready,
};
use tollgate::bucket::{Ask, BucketSpec, RedisBucket};
use tollgate::clock::SystemClock;
use tollgate::config::{RedisCredentials, RedisSettings, RedisTarget, RedisTlsFiles};
use tollgate::redis_client::RedisConnector;
use tollgate::telemetry::{self, Metrics};

/// A TLS-only Redis whose certificate the test CA signed, for
/// `localhost` and 127.0.0.1; clients must show a certificate when
/// `mutual`.
fn tls_redis(pki: &TestPki, mutual: bool) -> RedisServer {
    RedisServer::start_as(
        Access {
            tls: Some(TlsAccess {
                ca: pki.ca.clone(),
                server: pki.server.clone(),
                client: pki.client.clone(),
                require_client_cert: mutual,
            }),
            user: None,
        },
        Vec::new(),
    )
}

/// The `[redis]` lines trusting `ca`, with the client certificate when
/// `client` is set.
fn tls_keys(
    ca: &std::path::Path,
    client: Option<&(std::path::PathBuf, std::path::PathBuf)>,
) -> String {
    let mut keys = format!("ca_file = \"{}\"\n", ca.display());
    if let Some((cert, key)) = client {
        keys.push_str(&format!(
            "tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
            cert.display(),
            key.display()
        ));
    }
    keys
}

/// Whether `key` exists on `redis` (`redis-cli`'s answer).
fn exists(redis: &RedisServer, key: &str) -> bool {
    redis.cmd(&["EXISTS", key]).trim() == "1"
}

#[actix_web::test]
async fn mutual_tls_shares_limits_and_reconnects_after_a_restart() {
    let dir = TempDir::new("redis-tls");
    let pki = TestPki::make(&dir.0);
    let mut redis = tls_redis(&pki, true);
    let up = Upstream::start();
    let mut config = GatewayConfig::new(&redis.url(), dir.file("rules.toml", ""), &up.url());
    config.redis_extra = tls_keys(&pki.ca, Some(&pki.client));
    config.extra.push_str("[breaker]\ncooldown_ms = 200\n");
    let gateways = [Gateway::start(&config), Gateway::start(&config)];
    assert_eq!(ready(&gateways[0]).await["redis"], "up");
    assert_eq!(
        ready(&gateways[0]).await["redis_topology"]["mode"],
        "single"
    );

    // Two gateways, one bucket of 2 in the TLS Redis.
    let statuses = [
        get(&gateways[0].url("/a"), Some("tls-a")).await.0,
        get(&gateways[1].url("/a"), Some("tls-a")).await.0,
        get(&gateways[0].url("/a"), Some("tls-a")).await.0,
    ];
    assert_eq!(statuses, [200, 200, 429]);
    assert!(exists(&redis, "rl2:{tls-a}:api"));

    redis.kill();
    redis.restart();
    let shared_again = eventually(Duration::from_secs(10), || async {
        get(&gateways[0].url("/a"), Some("tls-b")).await;
        exists(&redis, "rl2:{tls-b}:api")
    })
    .await;
    assert!(shared_again, "no decision reached the restarted TLS Redis");
    assert!(redis.command_calls("script|load") >= 1 || redis.command_calls("eval") >= 1);
}

#[actix_web::test]
async fn servers_that_cannot_be_verified_are_never_used() {
    let dir = TempDir::new("redis-tls-refused");
    let pki = TestPki::make(&dir.0);
    let up = Upstream::start();
    // The right CA, but a certificate for another name than 127.0.0.1.
    let wrong_name = make_signed(
        &dir.0,
        "wrong-name",
        "other.example",
        "DNS:other.example",
        "serverAuth",
    );
    let misnamed = RedisServer::start_as(
        Access {
            tls: Some(TlsAccess {
                ca: pki.ca.clone(),
                server: wrong_name,
                client: pki.client.clone(),
                require_client_cert: false,
            }),
            user: None,
        },
        Vec::new(),
    );
    let trusted = tls_redis(&pki, false);
    for (redis, ca, what) in [
        (&misnamed, &pki.ca, "a certificate for another host name"),
        (
            &trusted,
            &pki.other_ca,
            "a certificate from an untrusted CA",
        ),
    ] {
        let mut config = GatewayConfig::new(&redis.url(), dir.file("rules.toml", ""), &up.url());
        config.redis_extra = tls_keys(ca, None);
        let gw = Gateway::start(&config);
        let down = eventually(Duration::from_secs(5), || async {
            ready(&gw).await["redis"] == "down"
        })
        .await;
        assert!(down, "{what}: {}", ready(&gw).await);
        // Still served, locally.
        assert_eq!(
            get(&gw.url("/a"), Some("unverified")).await.0,
            200,
            "{what}"
        );
        assert!(!exists(redis, "rl2:{unverified}:api"), "{what}");
    }
}

#[actix_web::test]
async fn an_acl_user_with_a_password_file_is_used_and_its_password_shown_nowhere() {
    const PASSWORD: &str = "pw-7f3a9c";
    let redis = RedisServer::start_as(
        Access {
            tls: None,
            user: Some(("tollgate".into(), PASSWORD.into())),
        },
        Vec::new(),
    );
    let dir = TempDir::new("redis-acl");
    let up = Upstream::start();
    let password = dir.file("redis.password", &format!("{PASSWORD}\n"));
    let wrong = dir.file("wrong.password", "not-the-password\n");
    let rules = dir.file("rules.toml", "");
    let toml = |redis_keys: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:{{proxy}}\"\nadmin_listen = \"127.0.0.1:{{admin}}\"\n\
             [redis]\n{redis_keys}\n[rules]\nfile = \"{}\"\n\
             [[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"{}\"\n",
            rules.display(),
            up.url()
        )
    };
    let port = redis.port;
    let file_user = GatewayProcess::start(
        "file-user",
        &dir,
        &toml(&format!(
            "url = \"redis://127.0.0.1:{port}\"\nusername = \"tollgate\"\npassword_file = \"{}\"",
            password.display()
        )),
    );
    let url_user = GatewayProcess::start(
        "url-user",
        &dir,
        &toml(&format!(
            "url = \"redis://tollgate:{PASSWORD}@127.0.0.1:{port}\""
        )),
    );
    let wrong_user = GatewayProcess::start(
        "wrong-user",
        &dir,
        &toml(&format!(
            "url = \"redis://127.0.0.1:{port}\"\nusername = \"tollgate\"\npassword_file = \"{}\"",
            wrong.display()
        )),
    );
    for (gw, tenant) in [(&file_user, "acl-file"), (&url_user, "acl-url")] {
        assert_eq!(gw.get(tenant, "/a").status, 200);
        assert_eq!(
            redis
                .cmd(&["EXISTS", &format!("rl2:{{{tenant}}}:api")])
                .trim(),
            "1",
            "{}",
            gw.name
        );
    }
    assert!(
        common::wait_until(Duration::from_secs(5), || wrong_user.ready()["redis"]
            == "down"),
        "a wrong password must not pass"
    );
    assert_eq!(
        wrong_user.get("acl-wrong", "/a").status,
        200,
        "served locally"
    );
    for gw in [&file_user, &url_user, &wrong_user] {
        let shown = format!(
            "{}\n{}\n{}",
            gw.ready(),
            gw.admin_text("/metrics"),
            std::fs::read_to_string(&gw.log).unwrap()
        );
        assert!(
            !shown.contains(PASSWORD),
            "{}: the password was shown",
            gw.name
        );
        assert!(
            !shown.contains("not-the-password"),
            "{}: the wrong password was shown",
            gw.name
        );
    }
}

#[actix_web::test]
async fn script_calls_ride_their_own_lines_over_mutual_tls_as_the_acl_user() {
    const PASSWORD: &str = "pw-lines-51c2";
    let dir = TempDir::new("redis-lines");
    let pki = TestPki::make(&dir.0);
    let redis = RedisServer::start_as(
        Access {
            tls: Some(TlsAccess {
                ca: pki.ca.clone(),
                server: pki.server.clone(),
                client: pki.client.clone(),
                require_client_cert: true,
            }),
            user: Some(("tollgate".into(), PASSWORD.into())),
        },
        Vec::new(),
    );
    telemetry::install();
    let timeout = Duration::from_secs(2);
    let settings = RedisSettings {
        target: RedisTarget::Single(redis.url()),
        timeout,
        connect_timeout: timeout,
        max_keys_per_call: 16,
        max_calls_in_flight: 1,
        credentials: RedisCredentials {
            username: Some("tollgate".into()),
            password_file: Some(dir.file("redis.password", &format!("{PASSWORD}\n"))),
        },
        sentinel_credentials: RedisCredentials::default(),
        tls: RedisTlsFiles {
            ca_file: Some(pki.ca.clone()),
            client: Some(pki.client.clone()),
        },
    };
    let conn = RedisConnector::new(&settings).unwrap().unwrap().connect();
    let bucket = RedisBucket::new(conn.clone(), timeout, Metrics::new(), SystemClock::shared());
    let spec = BucketSpec {
        capacity: NonZeroU32::new(50).unwrap(),
        refill_per_second: 0.001,
    };
    let take = async || {
        bucket
            .take("rl2:{line-tls}:r", &spec, Ask::single(1))
            .await
            .unwrap()
            .decision
    };
    // The shared connection gone, the calls ride the line alone.
    redis.assert_calls_ride_a_line(&conn, 3, &take).await;
    assert_eq!(take().await.remaining, 45);
}

/// `tollgate check-config` on `toml`: exit code and stderr.
fn check_config(dir: &TempDir, toml: &str) -> (Option<i32>, String) {
    let path = dir.file("check.toml", toml);
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check-config", "--config"])
        .arg(&path)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_config_reads_the_redis_files_as_the_gateway_does() {
    let dir = TempDir::new("redis-check");
    let pki = TestPki::make(&dir.0);
    let rules = dir.file("rules.toml", "");
    let base = |redis: &str| {
        format!(
            "[redis]\n{redis}\n[rules]\nfile = \"{}\"\n\
             [[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"http://127.0.0.1:9\"\n",
            rules.display()
        )
    };
    let good = format!(
        "url = \"rediss://cache.example:6380\"\n{}",
        tls_keys(&pki.ca, Some(&pki.client))
    );
    let (code, stderr) = check_config(&dir, &base(&good));
    assert_eq!(code, Some(0), "{stderr}");
    let swapped_key = format!(
        "url = \"rediss://cache.example:6380\"\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"",
        pki.client.0.display(),
        pki.server.1.display()
    );
    // A bundle with one certificate that does not parse: the Redis client
    // refuses the whole file, so check-config must too.
    let bundle = dir.file(
        "bundle.crt",
        &format!(
            "{}-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            std::fs::read_to_string(&pki.ca).unwrap()
        ),
    );
    for (redis, expected) in [
        (
            format!(
                "url = \"rediss://h:6380\"\nca_file = \"{}\"",
                bundle.display()
            ),
            "redis.ca_file:",
        ),
        (
            format!(
                "url = \"rediss://h:6380\"\nca_file = \"{}/missing.crt\"",
                dir.0.display()
            ),
            "redis.ca_file:",
        ),
        (swapped_key, "redis.tls_key_file:"),
        (
            "url = \"rediss://h:6380/#insecure\"".to_owned(),
            "redis.url:",
        ),
        (
            format!(
                "url = \"redis://h:6379\"\nca_file = \"{}\"",
                pki.ca.display()
            ),
            "redis.ca_file: is set, but",
        ),
        (
            format!(
                "url = \"redis://h:6379\"\npassword_file = \"{}/none\"",
                dir.0.display()
            ),
            "redis.password_file: cannot read",
        ),
        (
            "sentinel_nodes = [\"s:26379\"]".to_owned(),
            "redis.sentinel_master:",
        ),
    ] {
        let (code, stderr) = check_config(&dir, &base(&redis));
        assert_eq!(code, Some(64), "{redis}: {stderr}");
        assert!(stderr.contains(expected), "{redis}: {stderr}");
    }
}

/// TLS access to test servers signed by `pki`'s CA, with `user`.
fn tls_access(pki: &TestPki, user: Option<(&str, &str)>) -> Access {
    Access {
        tls: Some(TlsAccess {
            ca: pki.ca.clone(),
            server: pki.server.clone(),
            client: pki.client.clone(),
            require_client_cert: false,
        }),
        user: user.map(|(u, p)| (u.to_owned(), p.to_owned())),
    }
}

/// `/ready` once it reports Redis up (or as it stands after 10 s): a
/// lookup over TLS may outlast start-up on a busy machine, after which the
/// gateway is ready with Redis down and keeps looking.
async fn ready_with_redis_up(gw: &Gateway) -> serde_json::Value {
    eventually(Duration::from_secs(10), || async {
        ready(gw).await["redis"] == "up"
    })
    .await;
    ready(gw).await
}

#[actix_web::test]
async fn a_tls_cluster_is_reached_through_rediss_seeds() {
    let dir = TempDir::new("redis-tls-cluster");
    let pki = TestPki::make(&dir.0);
    let cluster = RedisCluster::start_shaped(0, &[], &tls_access(&pki, None));
    let up = Upstream::start();
    let mut config = GatewayConfig::new("", dir.file("rules.toml", ""), &up.url());
    config.cluster_nodes = cluster.seeds();
    assert!(config.cluster_nodes[0].starts_with("rediss://"));
    config.redis_extra = tls_keys(&pki.ca, None);
    let gw = Gateway::start(&config);
    let seen = ready_with_redis_up(&gw).await;
    assert_eq!(seen["redis"], "up", "{seen}");
    assert_eq!(
        seen["redis_topology"]["primaries"]
            .as_array()
            .unwrap()
            .len(),
        3,
        "{seen}"
    );
    for n in 0..6 {
        let tenant = format!("tls-cluster-{n}");
        assert_eq!(get(&gw.url("/a"), Some(&tenant)).await.0, 200);
        assert!(cluster.exists(&format!("rl2:{{{tenant}}}:api")), "{tenant}");
    }
}

#[actix_web::test]
async fn sentinel_over_tls_with_passwords_follows_a_failover() {
    const DATA: &str = "data-pw-51c2";
    const SENTINEL: &str = "sentinel-pw-9d04";
    let dir = TempDir::new("redis-tls-sentinel");
    let pki = TestPki::make(&dir.0);
    let mut deployment =
        RedisSentinel::start_as(tls_access(&pki, Some(("tollgate", DATA))), Some(SENTINEL));
    let up = Upstream::start();
    let data_file = dir.file("data.password", DATA);
    let sentinel_file = dir.file("sentinel.password", SENTINEL);
    let mut config = GatewayConfig::new("", dir.file("rules.toml", ""), &up.url());
    config.redis_extra = format!(
        "sentinel_nodes = {:?}\nsentinel_master = \"{SENTINEL_MASTER}\"\n\
         username = \"tollgate\"\npassword_file = \"{}\"\nsentinel_password_file = \"{}\"\n{}",
        deployment.nodes(),
        data_file.display(),
        sentinel_file.display(),
        tls_keys(&pki.ca, None)
    );
    config.extra.push_str("[breaker]\ncooldown_ms = 200\n");
    let gw = Gateway::start(&config);
    let primary = |port: u16| serde_json::Value::from(format!("127.0.0.1:{port}"));
    let seen = ready_with_redis_up(&gw).await;
    assert_eq!(seen["redis"], "up", "{seen}");
    assert_eq!(
        seen["redis_topology"]["primaries"][0]["address"],
        primary(deployment.servers[0].port)
    );
    assert_eq!(get(&gw.url("/a"), Some("tls-s-before")).await.0, 200);
    assert!(exists(&deployment.servers[0], "rl2:{tls-s-before}:api"));

    deployment.servers[0].kill();
    let new_primary = primary(deployment.servers[1].port);
    let followed = eventually(Duration::from_secs(20), || async {
        get(&gw.url("/a"), Some("tls-s-during")).await;
        let seen = ready(&gw).await;
        seen["redis"] == "up" && seen["redis_topology"]["primaries"][0]["address"] == new_primary
    })
    .await;
    assert!(followed, "{}", ready(&gw).await);
    assert_eq!(get(&gw.url("/a"), Some("tls-s-after")).await.0, 200);
    assert!(exists(&deployment.servers[1], "rl2:{tls-s-after}:api"));
}
