//! What the gateway writes to its log: JSON lines when asked, no colour
//! codes when the log is not a terminal, and an access line per request
//! when the access log is on (never the API key), and a warning naming
//! each upstream that accepts no connection at start-up.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::time::Duration;

use common::{GatewayProcess, TempDir, Upstream, get, refused_port, wait_until};

/// A local-only gateway process in front of the upstream at `up` with
/// `[log]` set to `log`.
fn gateway(name: &str, dir: &TempDir, up: &str, log: &str) -> GatewayProcess {
    let rules = dir.file(&format!("{name}.rules.toml"), "rule = []\n");
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:{{proxy}}\"\nadmin_listen = \"127.0.0.1:{{admin}}\"\nworkers = 1\n\
         [redis]\nurl = \"\"\n[rules]\nfile = \"{}\"\n[log]\n{log}\n\
         [[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"{}\"\n",
        rules.display(),
        up
    );
    GatewayProcess::start(name, dir, &toml)
}

#[actix_web::test]
async fn json_lines_carry_one_access_line_per_request_without_the_key() {
    let dir = TempDir::new("logs-json");
    let up = Upstream::start();
    let gw = gateway("json", &dir, &up.url(), "format = \"json\"\naccess = true");
    assert_eq!(get(&gw.url("/a"), Some("sk-secret-key")).await.0, 200);
    assert_eq!(get(&gw.url("/b"), None).await.0, 401);

    let text = std::fs::read_to_string(&gw.log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let access: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["target"] == "tollgate::access")
        .collect();
    assert_eq!(access.len(), 2, "{text}");
    let (ok, unauthorized) = (access[0], access[1]);
    assert_eq!(
        (&ok["method"], &ok["route"], &ok["status"], &ok["source"]),
        (&"GET".into(), &"api".into(), &200.into(), &"local".into()),
        "{ok}"
    );
    assert_eq!(
        ok["tenant"],
        tollgate::key::fingerprint("sk-secret-key").as_str()
    );
    assert!(ok["upstream_ms"].as_f64().unwrap() >= 0.0, "{ok}");
    assert!(ok["duration_ms"].as_f64().unwrap() >= ok["upstream_ms"].as_f64().unwrap());
    assert_eq!(unauthorized["status"], 401);
    assert!(unauthorized.get("tenant").is_none(), "{unauthorized}");
    assert!(!text.contains("sk-secret-key"), "the key reached the log");
}

#[actix_web::test]
async fn a_text_log_written_to_a_file_has_no_colour_codes_and_no_access_lines_by_default() {
    let dir = TempDir::new("logs-text");
    let up = Upstream::start();
    let gw = gateway("text", &dir, &up.url(), "level = \"info\"");
    assert_eq!(get(&gw.url("/a"), Some("t1")).await.0, 200);
    let text = std::fs::read_to_string(&gw.log).unwrap();
    assert!(text.contains("tollgate is serving."), "{text}");
    assert!(!text.contains('\u{1b}'), "colour codes in a file: {text:?}");
    assert!(!text.contains(" access "), "{text}");
}

#[test]
fn an_upstream_that_accepts_no_connection_is_named_at_start_up() {
    let dir = TempDir::new("logs-unreachable");
    let port = refused_port();
    let gw = gateway(
        "unreachable",
        &dir,
        &format!("http://127.0.0.1:{port}"),
        "level = \"info\"",
    );
    let warned = |text: &str| {
        text.lines().any(|l| {
            l.contains("No upstream accepts connections")
                && l.contains(&format!("127.0.0.1:{port}"))
                && l.contains("api")
        })
    };
    assert!(
        wait_until(Duration::from_secs(5), || warned(
            &std::fs::read_to_string(&gw.log).unwrap()
        )),
        "{}",
        std::fs::read_to_string(&gw.log).unwrap()
    );
}
