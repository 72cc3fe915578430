//! PostgreSQL for the tests: throwaway databases on the test server and
//! throwaway clusters (initdb) that a test may stop and start.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use futures_util::StreamExt;
use tollgate::app::{self, Listeners};
use tollgate::clock::{Clock, SystemClock};
use tollgate::config;

use super::*;

/// Runs `sql` through a PostgreSQL client command (`psql`, errors shown
/// with their SQLSTATE), failing with an install hint when it is missing.
fn run_psql(url: &str, sql: &str) -> std::process::Output {
    output_from(
        "postgresql-client",
        Command::new("psql").args([
            "-X",
            "-q",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-v",
            "VERBOSITY=verbose",
            "-d",
            url,
            "-c",
            sql,
        ]),
    )
}

/// Runs `sql` with `psql`, which must succeed. Returns trimmed stdout of
/// an unaligned, tuples-only query.
pub fn psql(url: &str, sql: &str) -> String {
    let out = run_psql(url, sql);
    assert!(
        out.status.success(),
        "psql {sql:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The PostgreSQL server tests create throwaway databases on
/// (`TOLLGATE_TEST_POSTGRES`, default the local server with trust auth).
pub fn test_postgres() -> String {
    std::env::var("TOLLGATE_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// A throwaway database on the shared test server, dropped on drop.
pub struct TestDatabase {
    pub name: String,
    server: String,
}

impl TestDatabase {
    pub fn create() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "tollgate_test_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let server = test_postgres();
        psql(
            &format!("{server}/postgres"),
            &format!("CREATE DATABASE {name}"),
        );
        Self { name, server }
    }

    pub fn url(&self) -> String {
        format!("{}/{}", self.server, self.name)
    }

    pub fn sql(&self, sql: &str) -> String {
        psql(&self.url(), sql)
    }

    /// Runs `sql`, which a CHECK constraint must refuse (SQLSTATE 23514);
    /// any other outcome (success, a refused connection, a syntax error)
    /// fails the test. Returns the error, which names the constraint.
    pub fn refuses(&self, sql: &str) -> String {
        let out = run_psql(&self.url(), sql);
        let error = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            !out.status.success() && error.contains("ERROR:  23514:"),
            "{sql:?} was not refused by a check constraint: {error}"
        );
        error
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args(["-X", "-q", "-d", &format!("{}/postgres", self.server), "-c"])
            .arg(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .output();
    }
}

/// A throwaway PostgreSQL cluster (initdb) on a free port that tests may
/// stop and start; removed on drop.
pub struct PgCluster {
    pub port: u16,
    dir: TempDir,
    bin: PathBuf,
}

impl PgCluster {
    /// Initialises and starts a cluster with trust auth for `postgres`.
    pub fn start() -> Self {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .ok()
            .and_then(|versions| {
                versions
                    .filter_map(Result::ok)
                    .map(|v| v.path().join("bin"))
                    .filter(|b| b.join("initdb").exists())
                    .max()
            })
            .unwrap_or_else(|| {
                panic!("no PostgreSQL server binaries under /usr/lib/postgresql; install them with `apt-get install -y postgresql`")
            });
        let dir = TempDir::new("pg");
        if running_as_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir.0)
                .status()
                .expect("chown is available");
            assert!(
                status.success(),
                "cannot hand the cluster directory to postgres"
            );
        }
        let cluster = Self {
            port: free_port(),
            dir,
            bin,
        };
        cluster.run(
            "initdb",
            &[
                "-D",
                &cluster.data(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        cluster.resume();
        cluster
    }

    fn data(&self) -> String {
        self.dir.0.join("data").display().to_string()
    }

    /// A server binary, run as the postgres user when we are root
    /// (PostgreSQL refuses to run as root).
    fn command(&self, tool: &str) -> Command {
        let exe = self.bin.join(tool);
        if running_as_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        }
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let out = self
            .command(tool)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {tool}: {e}"));
        assert!(
            out.status.success(),
            "{tool} {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts (or restarts) the server and waits until it accepts connections.
    pub fn resume(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.0.display()
        );
        let log = self.dir.0.join("server.log").display().to_string();
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-o",
                &options,
                "-l",
                &log,
                "-w",
                "start",
            ],
        );
    }

    /// Stops the server (fast shutdown: open connections are cut).
    pub fn stop(&self) {
        self.run("pg_ctl", &["-D", &self.data(), "-m", "fast", "-w", "stop"]);
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn sql(&self, sql: &str) -> String {
        psql(&self.url(), sql)
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .args(["-D", &self.data(), "-m", "immediate", "-w", "stop"])
            .output();
    }
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
