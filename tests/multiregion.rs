//! The two-region cluster, with real processes: two Redis servers,
//! PostgreSQL, four gateway processes (two per region) and a real
//! Prometheus scraping them. Starting from 50/50 with traffic split 70/30,
//! the rebalancer moves the shares to the traffic ratio; the total admitted
//! across both regions stays within 5 % of the global limit; with
//! Prometheus stopped the shares hold still. The Grafana dashboard's every
//! PromQL expression is checked against this Prometheus, and every metric
//! name it uses against a gateway's `/metrics`.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;
use std::rc::Rc;
use std::time::Duration;

use common::{
    GatewayProcess, PrometheusServer, RedisServer, TempDir, TestDatabase, Upstream, client,
    eventually,
};
use tollgate::clock::{Clock, SystemClock};

const TOKEN: &str = "mr-token";
/// Seconds between rebalancer rounds.
const INTERVAL: u64 = 2;

fn gateway_config(
    region: &str,
    dir: &TempDir,
    db: &TestDatabase,
    prometheus: &str,
    upstream: &str,
) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:{{proxy}}\"\nadmin_listen = \"127.0.0.1:{{admin}}\"\nworkers = 1\n\
         [instance]\nregion = \"{region}\"\nheartbeat_ms = 1000\n\
         [redis]\ntimeout_ms = 200\n\
         [regions]\ndir = \"{regions}\"\n\
         [rules]\ndatabase_url = \"{db}\"\nsnapshot_file = \"\"\n\
         [admin]\ntoken = \"{TOKEN}\"\n\
         [rebalancer]\nenabled = true\nprometheus_url = \"{prometheus}\"\ninterval_seconds = {INTERVAL}\nwindow_seconds = 8\n\
         [[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"{upstream}\"\n",
        regions = dir.0.join("regions").display(),
        db = db.url(),
    )
}

/// What the load tasks saw, read by the test itself (a task's own panic
/// would be lost).
#[derive(Default)]
struct Seen {
    /// Set to stop every load task.
    stop: Cell<bool>,
    /// Whether admissions are counted now.
    counting: Cell<bool>,
    /// acme's admissions while counting.
    admitted: Cell<u64>,
    /// Answers other than 200 or 429, and requests that got no answer.
    unexpected: RefCell<Vec<String>>,
}

/// Sends `per_second` requests per second for `tenant` to `url` until
/// `seen.stop`, counting acme's admissions while `seen.counting` is set.
fn load(url: String, tenant: &'static str, per_second: u64, seen: Rc<Seen>) {
    actix_web::rt::spawn(async move {
        let c = client();
        let period = Duration::from_micros(1_000_000 / per_second);
        let mut next = actix_web::rt::time::Instant::now();
        while !seen.stop.get() {
            match common::status_as(&c, &url, tenant).await {
                Some(200) => {
                    if tenant == "acme" && seen.counting.get() {
                        seen.admitted.set(seen.admitted.get() + 1);
                    }
                }
                Some(429) => {}
                other => seen
                    .unexpected
                    .borrow_mut()
                    .push(format!("{other:?} from {url} for {tenant}")),
            }
            next += period;
            actix_web::rt::time::sleep_until(next).await;
        }
    });
}

/// A JSON answer of a gateway's admin listener.
async fn admin_json(gw: &GatewayProcess, path: &str) -> serde_json::Value {
    client()
        .get(gw.admin_url(path))
        .insert_header(("authorization", format!("Bearer {TOKEN}")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// `GET /admin/shares` of a gateway.
async fn shares(gw: &GatewayProcess) -> serde_json::Value {
    admin_json(gw, "/admin/shares").await
}

/// eu-west's global share, as `/admin/shares` shows it.
async fn global_share(gw: &GatewayProcess) -> f64 {
    shares(gw).await["regions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == "eu-west")
        .and_then(|r| r["share"].as_f64())
        .unwrap()
}

/// Every `region_share` row, as `/admin/shares` shows them.
async fn share_rows(gw: &GatewayProcess) -> serde_json::Value {
    shares(gw).await["rows"].clone()
}

async fn metrics_text(gw: &GatewayProcess) -> String {
    common::text(&gw.admin_url("/metrics")).await
}

/// Sum of one series over the gateways.
async fn sum_metric(gateways: &[GatewayProcess], series: &str) -> f64 {
    let mut values = Vec::new();
    for gw in gateways {
        values.extend(common::series_value(&metrics_text(gw).await, series));
    }
    // A gateway exports some series only once they count (the rebalancer's
    // rounds on the leader); a name no gateway exports is misspelt.
    assert!(!values.is_empty(), "no gateway exports {series}");
    values.iter().sum()
}

#[actix_web::test]
async fn shares_follow_traffic_limits_hold_and_a_prometheus_outage_freezes_them() {
    let dir = TempDir::new("multiregion");
    let db = TestDatabase::create();
    let (eu_redis, us_redis) = (RedisServer::start(), RedisServer::start());
    let up = Upstream::start();
    std::fs::create_dir_all(dir.0.join("regions")).unwrap();
    for (id, redis) in [("eu-west", &eu_redis), ("us-east", &us_redis)] {
        dir.file(
            &format!("regions/{id}.toml"),
            &format!(
                "id = \"{id}\"\ndefault_share = 0.5\n[redis]\nurl = \"{}\"\n",
                redis.url()
            ),
        );
    }

    // Prometheus scrapes the gateways' admin ports, which exist only once
    // they run; its own port is chosen first so the gateways know it.
    let prom_port = common::free_port();
    let prom_url = format!("http://127.0.0.1:{prom_port}");
    let gateways: Vec<GatewayProcess> = [
        ("eu-1", "eu-west"),
        ("eu-2", "eu-west"),
        ("us-1", "us-east"),
        ("us-2", "us-east"),
    ]
    .into_iter()
    .map(|(name, region)| {
        GatewayProcess::start(
            name,
            &dir,
            &gateway_config(region, &dir, &db, &prom_url, &up.url()),
        )
    })
    .collect();
    let targets: Vec<(u16, &str)> = gateways
        .iter()
        .map(|g| {
            (
                g.admin,
                if g.name.starts_with("eu") {
                    "eu-west"
                } else {
                    "us-east"
                },
            )
        })
        .collect();
    let mut prometheus = PrometheusServer::start_on(&dir, &targets, prom_port);

    // A global limit for acme: 40 burst, 20/s.
    let put = client()
        .put(gateways[0].admin_url("/admin/rules/acme/api"))
        .insert_header(("authorization", format!("Bearer {TOKEN}")))
        .send_body(r#"{"capacity": 40, "refill_per_second": 20}"#)
        .await
        .unwrap();
    assert_eq!(put.status(), 201);

    // Traffic 70/30: acme at 2x its limit, and rule-less guests.
    let seen = Rc::new(Seen::default());
    for gw in &gateways {
        let rate = if gw.name.starts_with("eu") { 14 } else { 6 };
        load(gw.url("/orders"), "acme", rate, seen.clone());
        load(gw.url("/orders"), "guest", rate, seen.clone());
    }

    // Convergence from 50/50 to 70/30 within ±0.05, in a bounded number of rounds.
    let converged = eventually(Duration::from_secs(90), || async {
        (global_share(&gateways[0]).await - 0.7).abs() <= 0.05
    })
    .await;
    assert!(
        converged,
        "shares did not converge: eu-west at {}",
        global_share(&gateways[0]).await
    );
    let applied = sum_metric(
        &gateways,
        "tollgate_rebalance_rounds_total{result=\"applied\"}",
    )
    .await;
    assert!((1.0..=15.0).contains(&applied), "{applied} applied rounds");
    // Exactly one leader: only one instance ever ran a round itself.
    let mut leaders = 0;
    let mut leader_id = String::new();
    for gw in &gateways {
        let text = metrics_text(gw).await;
        let acted = text.lines().any(|l| {
            l.starts_with("tollgate_rebalance_rounds_total{")
                && !l.contains("not_leader")
                && l.rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .is_some_and(|v| v > 0.0)
        });
        leaders += usize::from(acted);
        if acted {
            leader_id = admin_json(gw, "/ready").await["instance"]
                .as_str()
                .unwrap()
                .to_owned();
        }
    }
    assert_eq!(leaders, 1, "exactly one instance leads the rebalancer");
    // Its decisions are recorded: by whom, what changed, and the demand.
    let listed = shares(&gateways[0]).await;
    let decisions = listed["decisions"].as_array().unwrap();
    assert!(!decisions.is_empty(), "{listed}");
    for decision in decisions {
        assert_eq!(decision["instance_id"], leader_id.as_str(), "{decision}");
        for change in decision["changes"].as_array().unwrap() {
            let share = change["shares"]["eu-west"].as_f64().unwrap();
            assert!(share > 0.5 && share < 1.0, "{decision}");
            let demand = change["demand_per_second"]["eu-west"].as_f64().unwrap();
            assert!(demand > 0.0, "{decision}");
        }
    }

    // The dashboards, against this Prometheus and these gateways.
    dashboards_are_valid(&prometheus, &gateways[0]).await;

    // The global limit holds across both regions: acme is over its share
    // in both, so the cluster admits about the global refill rate.
    // Local fallback decisions (a Redis call slower than its timeout on a
    // loaded machine) admit from 1/N of the limit: counted, to tell them
    // apart from a limit that does not hold.
    const FALLBACK_ALLOWED: &str = "tollgate_fallback_decisions_total{outcome=\"allowed\"}";
    let fallbacks_before = sum_metric(&gateways, FALLBACK_ALLOWED).await;
    let clock = SystemClock::new();
    let counted_from = clock.now_ms();
    seen.counting.set(true);
    actix_web::rt::time::sleep(Duration::from_secs(20)).await;
    seen.counting.set(false);
    let seconds = (clock.now_ms() - counted_from) as f64 / 1000.0;
    let fallbacks = sum_metric(&gateways, FALLBACK_ALLOWED).await - fallbacks_before;
    let ideal = 20.0 * seconds;
    let got = seen.admitted.get() as f64;
    assert!(
        (got - ideal).abs() <= 0.05 * ideal,
        "admitted {got} in {seconds:.1} s, ideal {ideal:.0} (global 20/s); \
         {fallbacks} admissions (all tenants) by the local fallback meanwhile"
    );

    // Prometheus down: the shares hold still, even set back to 50/50, far
    // from the traffic ratio the rebalancer moved them to above.
    let errors_before = sum_metric(
        &gateways,
        "tollgate_rebalance_rounds_total{result=\"prometheus_error\"}",
    )
    .await;
    prometheus.stop();
    let reset = client()
        .put(gateways[0].admin_url("/admin/shares"))
        .insert_header(("authorization", format!("Bearer {TOKEN}")))
        .send_body(r#"{"tenant": null, "route": null, "shares": {"eu-west": 0.5, "us-east": 0.5}}"#)
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    // The gateway's view follows the database by NOTIFY: wait for it.
    assert!(
        eventually(Duration::from_secs(5), || async {
            share_rows(&gateways[0]).await[0]["share"] == 0.5
        })
        .await,
        "the reset shares did not reach the gateway"
    );
    let before = share_rows(&gateways[0]).await;
    // Two failed rounds later the shares are where they were.
    let failed_twice = eventually(Duration::from_secs(6 * INTERVAL), || async {
        let errors = sum_metric(
            &gateways,
            "tollgate_rebalance_rounds_total{result=\"prometheus_error\"}",
        )
        .await;
        errors >= errors_before + 2.0
    })
    .await;
    assert!(failed_twice, "failed rounds are counted");
    let after = share_rows(&gateways[0]).await;
    assert_eq!(before, after, "shares moved while Prometheus was down");
    seen.stop.set(true);
    let unexpected = seen.unexpected.borrow();
    assert!(
        unexpected.is_empty(),
        "{} requests answered neither 200 nor 429, first: {:?}",
        unexpected.len(),
        unexpected.first()
    );
}

/// Every PromQL expression of every dashboard is accepted by Prometheus and
/// returns data; every metric it names is exported by tollgate.
async fn dashboards_are_valid(prometheus: &PrometheusServer, gateway: &GatewayProcess) {
    let exported = metrics_text(gateway).await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("grafana/dashboards");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let dashboard: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        for panel in dashboard["panels"].as_array().unwrap() {
            for target in panel["targets"].as_array().unwrap() {
                let expr = target["expr"].as_str().unwrap();
                let promql = expr
                    .replace("$__rate_interval", "30s")
                    .replace("$region", ".*");
                // A series may reach Prometheus only at its next scrape.
                let answer = RefCell::new(serde_json::Value::Null);
                eventually(Duration::from_secs(10), || async {
                    let found = prometheus.query(&promql).await;
                    let empty = found["data"]["result"]
                        .as_array()
                        .is_some_and(|r| r.is_empty());
                    let done = found["status"] != "success" || !empty;
                    *answer.borrow_mut() = found;
                    done
                })
                .await;
                let answer = answer.into_inner();
                assert_eq!(
                    answer["status"], "success",
                    "{}: {expr}: {answer}",
                    panel["title"]
                );
                let result = answer["data"]["result"].as_array().unwrap();
                assert!(!result.is_empty(), "{}: no data for {expr}", panel["title"]);
                for name in metric_names(expr) {
                    assert!(
                        exported.contains(&format!("# TYPE {name} ")),
                        "{}: {name} is not exported by tollgate",
                        panel["title"]
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 15, "only {checked} expressions checked");
}

/// `tollgate_*` metric names in a PromQL expression, without histogram
/// suffixes.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("tollgate_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        names.insert(base.to_owned());
        rest = &tail[end..];
    }
    names
}
