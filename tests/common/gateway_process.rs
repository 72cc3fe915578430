//! Gateways run as their own `tollgate serve` processes (their own
//! metrics registry, as in production): started on a config file, found
//! by the ports their log names, paused and killed as a test needs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{KillOnDrop, RawResponse, TempDir, http_status, raw_http, series_value, wait_until};

/// A gateway running as its own `tollgate serve` process (its own metrics
/// registry, as in production); killed on drop.
pub struct GatewayProcess {
    pub name: String,
    pub proxy: u16,
    pub admin: u16,
    /// Envoy's rate limit service, when served.
    pub rls: Option<u16>,
    /// The HTTP check, when served.
    pub check: Option<u16>,
    /// Where its stderr (the log) goes.
    pub log: PathBuf,
    child: KillOnDrop,
}

impl GatewayProcess {
    /// Writes `toml` (with `{proxy}` and `{admin}` set to port 0, so the
    /// gateway binds free ports itself, with no race) and starts
    /// `tollgate serve` on it; reads the bound ports from its log and waits
    /// until `/ready` answers 200.
    pub fn start(name: &str, dir: &TempDir, toml: &str) -> Self {
        Self::start_under(name, dir, toml, &[])
    }

    /// As [`GatewayProcess::start`], the gateway run by the command
    /// `under` (e.g. `prlimit --nofile=256`) when it is not empty.
    pub fn start_under(name: &str, dir: &TempDir, toml: &str, under: &[&str]) -> Self {
        let toml = toml.replace("{proxy}", "0").replace("{admin}", "0");
        let path = dir.file(&format!("{name}.toml"), &toml);
        let log_path = dir.0.join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).unwrap();
        let bin = env!("CARGO_BIN_EXE_tollgate");
        let mut command = match under {
            [] => Command::new(bin),
            [program, args @ ..] => {
                let mut command = Command::new(program);
                command.args(args).arg(bin);
                command
            }
        };
        let mut child = KillOnDrop(
            command
                .args(["serve", "--config"])
                .arg(&path)
                .env_remove("RUST_LOG")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("the tollgate binary runs"),
        );
        let mut ports = None;
        let found = wait_until(Duration::from_secs(20), || {
            ports = serving_ports(&std::fs::read_to_string(&log_path).unwrap_or_default());
            ports.is_some()
        });
        let Some((proxy, admin, rls, check)) = ports.filter(|_| found) else {
            child.kill();
            panic!("gateway {name} did not start; see {}", log_path.display());
        };
        let gateway = Self {
            name: name.to_owned(),
            proxy,
            admin,
            rls,
            check,
            log: log_path.clone(),
            child,
        };
        let admin_addr: SocketAddr = ([127, 0, 0, 1], admin).into();
        assert!(
            wait_until(Duration::from_secs(20), || http_status(
                admin_addr, "/ready"
            ) == Some(200)),
            "gateway {name} was not ready; see {}",
            log_path.display()
        );
        gateway
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.proxy)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin)
    }

    /// The address of its rate limit service (which it must serve).
    pub fn rls_addr(&self) -> SocketAddr {
        ([127, 0, 0, 1], self.rls.expect("the gateway serves [rls]")).into()
    }

    /// `GET path` through the proxy as `tenant` (a blocking raw request).
    pub fn get(&self, tenant: &str, path: &str) -> RawResponse {
        raw_http(
            ([127, 0, 0, 1], self.proxy).into(),
            &format!("GET {path} HTTP/1.1\r\nHost: t\r\nX-Api-Key: {tenant}\r\n"),
        )
    }

    /// The body of `GET path` on the admin listener.
    pub fn admin_text(&self, path: &str) -> String {
        raw_http(
            ([127, 0, 0, 1], self.admin).into(),
            &format!("GET {path} HTTP/1.1\r\nHost: t\r\n"),
        )
        .body
    }

    /// One series' value in its `/metrics` (a blocking read); `None` when it is not exported.
    pub fn metric(&self, series: &str) -> Option<f64> {
        series_value(&self.admin_text("/metrics"), series)
    }

    /// `GET /ready` as JSON.
    pub fn ready(&self) -> serde_json::Value {
        serde_json::from_str(&self.admin_text("/ready")).unwrap_or_default()
    }

    /// Its resident memory (VmRSS), in bytes.
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the gateway process runs");
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("a VmRSS line");
        kib * 1024
    }

    /// Freezes the gateway (SIGSTOP): its sockets stay open, nothing answers.
    pub fn pause(&self) {
        self.child.pause();
    }

    /// Thaws a paused gateway (SIGCONT).
    pub fn resume(&self) {
        self.child.resume();
    }

    /// Kills the gateway (SIGKILL): nothing it holds is given back.
    pub fn kill(&mut self) {
        self.child.kill();
    }
}

/// The proxy and admin ports of the `tollgate is serving.` log line, in
/// either log format.
fn serving_ports(log: &str) -> Option<(u16, u16, Option<u16>, Option<u16>)> {
    let line = log.lines().find(|l| l.contains("tollgate is serving."))?;
    let json: Option<serde_json::Value> = serde_json::from_str(line).ok();
    let port = |field: &str| -> Option<u16> {
        let addr = match &json {
            Some(object) => object[field].as_str()?,
            None => line
                .split_whitespace()
                .find_map(|w| w.strip_prefix(field)?.strip_prefix('='))?,
        };
        addr.rsplit(':').next()?.parse().ok()
    };
    Some((port("proxy")?, port("admin")?, port("rls"), port("check")))
}
