//! The command line: check-config and serve refuse bad configuration with
//! exit code 64 and list every problem.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::process::{Command, Output};

fn tollgate() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"));
    cmd.env_remove("RUST_LOG");
    cmd
}

/// `tollgate` with `args`, run to its end.
fn run(args: &[&str]) -> Output {
    tollgate().args(args).output().unwrap()
}

/// `out` of a command that must have succeeded.
fn assert_success(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `tollgate check-config --config path`, run to its end.
fn check_config(path: &std::path::Path) -> Output {
    tollgate()
        .args(["check-config", "--config"])
        .arg(path)
        .output()
        .unwrap()
}

/// `tollgate serve` on the shipped config with `name=value` in its
/// environment, run to its end (it must refuse to start).
fn serve_shipped_with(name: &str, value: impl AsRef<std::ffi::OsStr>) -> Output {
    tollgate()
        .args(["serve", "--config", "config/tollgate.toml"])
        .env(name, value)
        .output()
        .unwrap()
}

/// The stderr of `out`, which must have exited with 64 (bad
/// configuration).
fn refused_with_64(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    stderr
}

fn write_config(name: &str, contents: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("tollgate-cli-{}-{name}", std::process::id()));
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn check_config_accepts_the_shipped_config() {
    let out = check_config("config/tollgate.toml".as_ref());
    assert_success(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("valid"));
}

#[test]
fn check_config_lists_every_problem_and_exits_64() {
    let path = write_config(
        "bad.toml",
        r#"
[server]
listen = "not-an-address"
[default_rule]
capacity = 0
[[routes]]
id = "r"
path_prefix = "nope"
upstream = "http://127.0.0.1:1"
"#,
    );
    let out = check_config(&path);
    let _ = std::fs::remove_file(&path);
    let stderr = refused_with_64(&out);
    for key in [
        "server.listen",
        "default_rule.capacity",
        "routes[0].path_prefix",
    ] {
        assert!(stderr.contains(key), "{key} missing from:\n{stderr}");
    }
}

#[test]
fn serve_refuses_a_bad_environment_override_with_64() {
    let out = serve_shipped_with("TOLLGATE__SERVER__WORKERS", "many");
    assert!(refused_with_64(&out).contains("TOLLGATE__SERVER__WORKERS"));
}

#[test]
fn serve_refuses_an_invalid_rules_file_with_64() {
    let rules = write_config(
        "rules.toml",
        "[[rule]]\ntenant = \"{x}\"\nroute = \"r\"\ncapacity = 1\nrefill_per_second = 1\n",
    );
    let out = serve_shipped_with("TOLLGATE__RULES__FILE", &rules);
    let _ = std::fs::remove_file(&rules);
    assert!(refused_with_64(&out).contains("rule[0].tenant"));
}

#[test]
fn missing_config_file_exits_64() {
    refused_with_64(&run(&["serve", "--config", "/nonexistent/tollgate.toml"]));
}

#[test]
fn migrate_creates_the_rules_table_and_can_run_again() {
    let db = common::TestDatabase::create();
    for _ in 0..2 {
        assert_success(&run(&["migrate", "--database-url", &db.url()]));
    }
    assert_eq!(
        db.sql(
            "SELECT string_agg(event_manipulation, ',' ORDER BY event_manipulation) \
             FROM information_schema.triggers WHERE trigger_name = 'rate_limit_rule_notify'"
        ),
        "DELETE,INSERT,UPDATE",
        "insert, update and delete each fire the notify trigger"
    );
    refused_with_64(&run(&["migrate", "--database-url", "mysql://nope"]));
}

#[test]
fn migrate_names_a_missing_database_and_how_to_create_it() {
    let name = format!("tollgate_missing_{}", std::process::id());
    let out = run(&[
        "migrate",
        "--database-url",
        &format!("{}/{name}", common::test_postgres()),
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "database \"{name}\" does not exist: create it (psql -c 'CREATE DATABASE \"{name}\"'"
        )),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("does not exist").count(),
        1,
        "said once: {stderr}"
    );
}

#[test]
fn check_config_refuses_rules_for_routes_the_gateway_does_not_have() {
    let rules = write_config(
        "unknown-route.rules.toml",
        "[[rule]]\ntenant = \"a\"\nroute = \"orders\"\ncapacity = 1\nrefill_per_second = 1\n\n\
         [[rule]]\ntenant = \"a\"\nroute = \"order\"\ncapacity = 1\nrefill_per_second = 1\n",
    );
    let config = write_config(
        "unknown-route.toml",
        &format!(
            "[rules]\nfile = \"{}\"\n[[routes]]\nid = \"orders\"\npath_prefix = \"/orders\"\n\
             upstream = \"http://127.0.0.1:1\"\n",
            rules.display()
        ),
    );
    let out = check_config(&config);
    let _ = (std::fs::remove_file(&config), std::fs::remove_file(&rules));
    let stderr = refused_with_64(&out);
    assert!(
        stderr.contains(
            "rule[1].route: no route \"order\" in this gateway's configuration (routes: orders)"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("rule[0]"), "{stderr}");
}

/// Starts `tollgate demo` in `dir` (also its TMPDIR, where the demo keeps
/// its own rules file when there is no config/rules.toml) and returns its
/// banner, up to the line that ends it.
fn demo_banner(dir: &std::path::Path) -> String {
    use std::io::{BufRead, BufReader};

    // Port 0 everywhere: the banner is all this reads, and no port is
    // taken from under another test.
    let mut child = common::KillOnDrop(
        tollgate()
            .arg("demo")
            .current_dir(dir)
            .env("TMPDIR", dir)
            .env("TOLLGATE__SERVER__LISTEN", "127.0.0.1:0")
            .env("TOLLGATE__SERVER__ADMIN_LISTEN", "127.0.0.1:0")
            .env("TOLLGATE__REDIS__URL", "")
            .env("TOLLGATE__ROUTES__0__UPSTREAM", "http://127.0.0.1:0")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut seen = String::new();
    for line in BufReader::new(child.0.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.starts_with("Edit the rules file") {
            break;
        }
    }
    child.kill();
    seen
}

#[test]
fn demo_runs_from_any_directory_and_sizes_its_loop_to_the_rules() {
    let dir = common::TempDir::new("demo-anywhere");
    // No config/rules.toml here: no rules, the default burst of 20 at
    // 10/s, and a loop of 43 requests that runs past it with two seconds
    // of refill.
    let seen = demo_banner(&dir.0);
    assert!(
        seen.contains("config/rules.toml not found: no rules"),
        "{seen}"
    );
    assert!(seen.contains("for i in $(seq 43)"), "{seen}");
    // The demo's own file shows an example; a rule appended to it, as a
    // newcomer would, is valid and survives the next start.
    let own = dir.0.join("tollgate-demo-rules.toml");
    let made = std::fs::read_to_string(&own).unwrap();
    assert!(made.contains("# [[rule]]"), "{made}");
    let appended = format!(
        "{made}[[rule]]\ntenant = \"shop-b\"\nroute = \"create-order\"\ncapacity = 5\nrefill_per_second = 1\n"
    );
    std::fs::write(&own, appended).unwrap();
    let seen = demo_banner(&dir.0);
    assert!(seen.contains("kept from an earlier demo"), "{seen}");
    assert!(seen.contains("for i in $(seq 10)"), "{seen}");
}

#[test]
fn check_config_says_when_an_in_flight_bound_is_held_to_the_pool() {
    let dir = common::TempDir::new("cli-pool");
    let rules = dir.file("rules.toml", "");
    let path = dir.file(
        "pool.toml",
        &format!(
            "[rules]\nfile = \"{}\"\n[upstream]\nmax_connections_per_worker = 8\n\
             [[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"http://127.0.0.1:9\"\n",
            rules.display()
        ),
    );
    let out = check_config(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for key in [
        "upstream.max_connections_per_tenant = 64",
        "upstream.max_connections_without_rule = 128",
    ] {
        assert!(
            stderr.contains(&format!("note: {key} is more than half of upstream.max_connections_per_worker = 8: 4 are allowed")),
            "{stderr}"
        );
    }
}
