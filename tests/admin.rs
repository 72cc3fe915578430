//! The admin listener: /live, /ready and a Prometheus-valid /metrics.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use common::{Gateway, Stack, admin, client, get, ready, text};

#[actix_web::test]
async fn live_ready_and_metrics_report_the_gateway() {
    let s = Stack::start(
        "admin",
        "[[rule]]\ntenant = \"a\"\nroute = \"api\"\ncapacity = 5\nrefill_per_second = 1\nname = \"Tenant A\"\n\
         [[rule]]\ntenant = \"sk-unnamed\"\nroute = \"api\"\ncapacity = 5\nrefill_per_second = 1\n",
        |_, _| {},
    );
    let gw = &s.gw;
    let c = client();

    let live = c.get(gw.admin_url("/live")).send().await.unwrap();
    assert_eq!(live.status(), 200);

    for _ in 0..3 {
        get(&gw.url("/m"), Some("metrics-tenant")).await;
    }
    get(&gw.url("/m"), Some("a")).await;
    get(&gw.url("/m"), Some("sk-unnamed")).await;
    get(&gw.url("/m"), None).await;

    let ready = ready(gw).await;
    assert_eq!(ready["status"], "ready");
    assert_eq!(ready["redis"], "up");
    assert_eq!(ready["rules"]["count"], 2);
    assert_eq!(ready["rules"]["source"], "file");
    assert_eq!(ready["live_instances"], 1);

    let mut res = c.get(gw.admin_url("/metrics")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let text = String::from_utf8(res.body().await.unwrap().to_vec()).unwrap();
    for needle in [
        "tollgate_requests_total{route=\"api\",tenant=\"_other\",outcome=\"allowed\",entry=\"proxy\"}",
        "tollgate_requests_total{route=\"api\",tenant=\"_other\",outcome=\"rejected\",entry=\"proxy\"}",
        "tollgate_requests_total{route=\"api\",tenant=\"_other\",outcome=\"unauthorized\",entry=\"proxy\"}",
        "tollgate_requests_total{route=\"api\",tenant=\"Tenant A\",outcome=\"allowed\",entry=\"proxy\"}",
        &format!(
            "tollgate_requests_total{{route=\"api\",tenant=\"{}\",outcome=\"allowed\",entry=\"proxy\"}}",
            tollgate::key::fingerprint("sk-unnamed")
        ),
        "tollgate_decision_duration_seconds_bucket{source=\"redis\"",
        "tollgate_redis_call_duration_seconds_bucket",
        "tollgate_redis_errors_total{kind=\"timeout\"}",
        "tollgate_upstream_duration_seconds_bucket{route=\"api\"",
        concat!(
            "tollgate_build_info{version=\"",
            env!("CARGO_PKG_VERSION"),
            "\"} 1"
        ),
        "tollgate_process_resident_memory_bytes ",
        "tollgate_process_cpu_seconds ",
        "tollgate_process_open_fds ",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    assert!(
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .all(|l| l.is_empty() || l.starts_with("tollgate_")),
        "every series is prefixed tollgate_"
    );
    assert!(
        !text.contains("metrics-tenant"),
        "a tenant without a rule never becomes a label"
    );
    for key in ["tenant=\"a\"", "sk-unnamed"] {
        assert!(
            !text.contains(key),
            "an API key is shown in /metrics: {key}"
        );
    }
    promtool_accepts(&text);
}

#[actix_web::test]
async fn admin_reads_need_a_token_and_no_surface_shows_one() {
    let s = Stack::start(
        "admin-auth",
        "[[rule]]\ntenant = \"secret-key\"\nroute = \"api\"\ncapacity = 5\nrefill_per_second = 1\n",
        |_, _| {},
    );
    let open = &s.gw;
    let mut config = s.config.clone();
    for path in [
        "/admin/rules",
        "/admin/rules/secret-key/api",
        "/admin/shares",
    ] {
        let (status, body) = admin(open, "GET", path, None, None).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (403, Some("reads_disabled")),
            "{path}"
        );
    }

    config.admin_token = "write-token".into();
    config.admin_read_token = "read-token".into();
    let gw = Gateway::start(&config);
    let (status, body) = admin(&gw, "GET", "/admin/rules", None, None).await;
    assert_eq!(status, 401);
    assert!(!body.to_string().contains("secret-key"));
    assert_eq!(
        admin(&gw, "GET", "/admin/rules", Some("wrong"), None)
            .await
            .0,
        401
    );
    for token in ["read-token", "write-token"] {
        let (status, page) = admin(&gw, "GET", "/admin/rules", Some(token), None).await;
        assert_eq!(status, 200, "{token}");
        assert_eq!(page["rules"][0]["tenant"], "secret-key");
    }
    // Two Authorization headers are refused, whichever of them is right.
    for (first, second) in [
        ("wrong", "read-token"),
        ("read-token", "wrong"),
        ("read-token", "read-token"),
    ] {
        let mut res = client()
            .get(gw.admin_url("/admin/rules"))
            .append_header(("authorization", format!("Bearer {first}")))
            .append_header(("authorization", format!("Bearer {second}")))
            .send()
            .await
            .unwrap();
        let body: serde_json::Value = res.json().await.unwrap();
        assert_eq!(res.status(), 400, "{first}, {second}: {body}");
        assert_eq!(body["field"], "authorization");
        assert!(!body.to_string().contains("secret-key"));
    }
    for surface in ["/ready", "/metrics"] {
        let text = text(&gw.admin_url(surface)).await;
        for secret in ["write-token", "read-token"] {
            assert!(!text.contains(secret), "{surface} shows {secret}");
        }
    }
}

/// Runs `promtool check metrics` on the exposition.
fn promtool_accepts(text: &str) {
    let mut child = common::spawn_from(
        "prometheus",
        Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool rejected /metrics:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
