//! A throwaway Redis Sentinel deployment: a primary with a replica,
//! watched by three sentinels that fail over quickly; which primary they
//! name, and a sentinel frozen on demand.

use std::process::{Command, Stdio};
use std::time::Duration;

use super::redis_access::cli;
use super::{Access, KillOnDrop, RedisServer, TempDir, free_port, spawn_from, wait_until};

/// The name the test sentinels monitor their primary under.
pub const SENTINEL_MASTER: &str = "tollgate-test";

/// A primary, its replica, and three sentinels (quorum 2) that declare
/// the primary down after 1 s and promote the replica.
pub struct RedisSentinel {
    /// Declared first, so dropped (killed) before the servers they watch.
    sentinel_children: Vec<KillOnDrop>,
    /// The primary at start, then the replica: index 0 and 1.
    pub servers: Vec<RedisServer>,
    /// The sentinels' ports.
    pub sentinels: Vec<u16>,
    /// How the sentinels are reached.
    sentinel_access: Access,
    _dir: TempDir,
}

impl RedisSentinel {
    /// Everything plain, no passwords.
    pub fn start() -> Self {
        Self::start_as(Access::default(), None)
    }

    /// Primary and replica reached as `data` says (the replica and the
    /// sentinels authenticate with its user), the sentinels over the same
    /// TLS, requiring `sentinel_password` when set.
    pub fn start_as(data: Access, sentinel_password: Option<&str>) -> Self {
        let dir = TempDir::new("sentinel");
        let primary = RedisServer::start_as(data.clone(), Vec::new());
        let mut replica_args = vec![
            "--replicaof".into(),
            "127.0.0.1".into(),
            primary.port.to_string(),
        ];
        if let Some((user, password)) = &data.user {
            replica_args.extend([
                "--masteruser".into(),
                user.clone(),
                "--masterauth".into(),
                password.clone(),
            ]);
        }
        let replica = RedisServer::start_as(data.clone(), replica_args);
        let sentinel_access = Access {
            tls: data.tls.clone(),
            user: sentinel_password.map(|p| ("default".to_owned(), p.to_owned())),
        };
        let mut sentinels = Vec::new();
        let mut children = Vec::new();
        // The configuration of a sentinel listening on `port`.
        let conf_for = |port: u16| {
            let mut conf = match &data.tls {
                None => format!("port {port}\n"),
                Some(tls) => format!(
                    "port 0\ntls-port {port}\ntls-cert-file {}\ntls-key-file {}\n\
                 tls-ca-cert-file {}\ntls-auth-clients no\ntls-replication yes\n",
                    tls.server.0.display(),
                    tls.server.1.display(),
                    tls.ca.display()
                ),
            };
            conf.push_str(&format!(
                "bind 127.0.0.1\ndir {}\n\
             sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {} 2\n\
             sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
             sentinel failover-timeout {SENTINEL_MASTER} 5000\n\
             sentinel parallel-syncs {SENTINEL_MASTER} 1\n",
                dir.0.display(),
                primary.port
            ));
            if let Some((user, password)) = &data.user {
                conf.push_str(&format!(
                "sentinel auth-user {SENTINEL_MASTER} {user}\nsentinel auth-pass {SENTINEL_MASTER} {password}\n"
            ));
            }
            if let Some(password) = sentinel_password {
                conf.push_str(&format!(
                    "requirepass {password}\nsentinel sentinel-pass {password}\n"
                ));
            }
            conf
        };
        for i in 0..3 {
            let (port, child) = start_sentinel(&dir, i, &sentinel_access, &conf_for);
            sentinels.push(port);
            children.push(child);
        }
        let deployment = Self {
            servers: vec![primary, replica],
            sentinels,
            sentinel_access,
            sentinel_children: children,
            _dir: dir,
        };
        assert!(
            wait_until(Duration::from_secs(20), || deployment.sentinels.iter().all(
                |&p| {
                    deployment
                        .sentinel_cmd(p, &["SENTINEL", "CKQUORUM", SENTINEL_MASTER])
                        .is_some_and(|r| r.contains("OK"))
                        && deployment
                            .sentinel_cmd(p, &["SENTINEL", "REPLICAS", SENTINEL_MASTER])
                            .is_some_and(|r| r.contains("slave"))
                }
            )),
            "the sentinels did not agree on the primary and its replica"
        );
        deployment
    }

    /// One command to the sentinel on `port`.
    fn sentinel_cmd(&self, port: u16, args: &[&str]) -> Option<String> {
        cli(port, &self.sentinel_access, args)
    }

    /// Freezes sentinel `i` (SIGSTOP): it holds every connection open and
    /// answers nothing.
    pub fn pause_sentinel(&self, i: usize) {
        self.sentinel_children[i].pause();
    }

    /// Seeds for `redis.sentinel_nodes` (`rediss://` URLs over TLS).
    pub fn nodes(&self) -> Vec<String> {
        let scheme = if self.sentinel_access.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        self.sentinels
            .iter()
            .map(|p| format!("{scheme}://127.0.0.1:{p}"))
            .collect()
    }

    /// The port of the primary the first sentinel that answers names.
    pub fn primary_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|&p| {
            let reply =
                self.sentinel_cmd(p, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER])?;
            reply
                .lines()
                .filter(|l| !l.starts_with(['*', '$']))
                .nth(1)?
                .trim()
                .parse()
                .ok()
        })
    }
}

/// Starts sentinel `i` from the configuration `conf_for(port)` makes, on a
/// free port it answers `PING` on within 5 s: three tries, each on another
/// port (one found free may be taken before the sentinel binds it).
fn start_sentinel(
    dir: &TempDir,
    i: usize,
    access: &Access,
    conf_for: &dyn Fn(u16) -> String,
) -> (u16, KillOnDrop) {
    for _ in 0..3 {
        let port = free_port();
        let conf = dir.file(&format!("sentinel-{i}.conf"), &conf_for(port));
        let child = KillOnDrop(spawn_from(
            "redis-server",
            Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        ));
        if wait_until(Duration::from_secs(5), || {
            cli(port, access, &["PING"]).is_some_and(|r| r.contains("PONG"))
        }) {
            return (port, child);
        }
    }
    panic!("sentinel {i} did not answer PING on a free port after 3 attempts");
}
