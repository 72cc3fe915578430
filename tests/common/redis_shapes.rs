//! Throwaway Redis deployments as operators run them: a server (over TLS,
//! with ACL users), a Redis Cluster (with replicas), and a primary with a
//! replica watched by three sentinels. Each on free ports, killed on drop.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{TempDir, free_port, wait_until};

/// TLS for a test server: its certificate, the CA clients are checked
/// against, and whether clients must show a certificate.
#[derive(Clone, Debug)]
pub struct TlsAccess {
    /// The CA that signed the server's certificate (and clients').
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub server: (PathBuf, PathBuf),
    /// A client certificate and key, for redis-cli and for mutual TLS.
    pub client: (PathBuf, PathBuf),
    /// Whether the server requires a client certificate.
    pub require_client_cert: bool,
}

/// How a test server is reached: plain or TLS, as the default user or
/// an ACL user.
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// TLS, when the server speaks only TLS.
    pub tls: Option<TlsAccess>,
    /// An ACL user and password (the `default` user is then disabled).
    pub user: Option<(String, String)>,
}

impl Access {
    /// The server arguments this access needs, for a server on `port`.
    fn server_args(&self, port: u16) -> Vec<String> {
        let mut args = match &self.tls {
            None => vec!["--port".into(), port.to_string()],
            Some(tls) => vec![
                "--port".into(),
                "0".into(),
                "--tls-port".into(),
                port.to_string(),
                "--tls-cert-file".into(),
                tls.server.0.display().to_string(),
                "--tls-key-file".into(),
                tls.server.1.display().to_string(),
                "--tls-ca-cert-file".into(),
                tls.ca.display().to_string(),
                "--tls-auth-clients".into(),
                if tls.require_client_cert { "yes" } else { "no" }.into(),
                "--tls-replication".into(),
                "yes".into(),
            ],
        };
        if let Some((user, password)) = &self.user {
            args.extend([
                "--user".into(),
                "default".into(),
                "off".into(),
                "--user".into(),
                user.clone(),
                "on".into(),
                format!(">{password}"),
                "~*".into(),
                "&*".into(),
                "+@all".into(),
            ]);
        }
        args
    }

    /// `redis-cli` arguments for this access.
    fn cli_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(tls) = &self.tls {
            args.extend([
                "--tls".into(),
                "--cacert".into(),
                tls.ca.display().to_string(),
                "--cert".into(),
                tls.client.0.display().to_string(),
                "--key".into(),
                tls.client.1.display().to_string(),
            ]);
        }
        if let Some((user, password)) = &self.user {
            args.extend([
                "--user".into(),
                user.clone(),
                "--pass".into(),
                password.clone(),
                "--no-auth-warning".into(),
            ]);
        }
        args
    }
}

/// A `redis-server` on a free port, killed on drop.
pub struct RedisServer {
    pub port: u16,
    /// Extra server arguments (cluster mode, data directory).
    args: Vec<String>,
    /// How it is reached.
    access: Access,
    child: Child,
}

impl RedisServer {
    /// Starts a server that keeps nothing on disk.
    ///
    /// # Panics
    /// When `redis-server` is not installed or does not come up.
    pub fn start() -> Self {
        Self::start_with(Vec::new())
    }

    /// Starts a server on a free port with extra arguments.
    pub fn start_with(args: Vec<String>) -> Self {
        Self::start_as(Access::default(), args)
    }

    /// Starts a server on a free port reached as `access` says, with
    /// extra arguments.
    pub fn start_as(access: Access, args: Vec<String>) -> Self {
        for _ in 0..3 {
            let port = free_port();
            let child = spawn_redis(port, &access, &args);
            let mut server = Self {
                port,
                args: args.clone(),
                access: access.clone(),
                child,
            };
            if wait_until(Duration::from_secs(5), || server.ping()) {
                return server;
            }
            let _ = server.child.kill();
        }
        panic!("redis-server did not answer PING on a free port after 3 attempts");
    }

    /// Kills the server (SIGKILL): connections drop, state is lost.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port (empty, unless its
    /// arguments name a data directory).
    pub fn restart(&mut self) {
        self.child = spawn_redis(self.port, &self.access, &self.args);
        assert!(
            wait_until(Duration::from_secs(5), || self.ping()),
            "redis-server did not come back on port {}",
            self.port
        );
    }

    /// Its URL for the gateway (`rediss://` over TLS; no credentials).
    pub fn url(&self) -> String {
        let scheme = if self.access.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// Whether the server answers PING right now.
    pub fn ping(&self) -> bool {
        self.try_cmd(&["PING"]).is_some_and(|r| r.contains("PONG"))
    }

    /// Runs one command and returns the reply: raw RESP for a plain
    /// server, `redis-cli`'s text for one over TLS or with a user.
    pub fn cmd(&self, args: &[&str]) -> String {
        self.try_cmd(args).expect("redis answers")
    }

    fn try_cmd(&self, args: &[&str]) -> Option<String> {
        if self.access.tls.is_none() && self.access.user.is_none() {
            return redis_cli(self.port, args);
        }
        let out = Command::new("redis-cli")
            .args(self.access.cli_args())
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run redis-cli ({e}); install it with `apt-get install -y redis-tools`"
                )
            });
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// An async connection for assertions (plain servers).
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("test redis accepts connections")
    }

    /// Freezes the server (SIGSTOP), as a hung Redis would be.
    pub fn pause(&self) {
        signal(self.child.id(), "-STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        signal(self.child.id(), "-CONT");
    }

    /// `calls` of one command in INFO commandstats (0 when never called).
    pub fn command_calls(&self, command: &str) -> u64 {
        let stats = self.cmd(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{command}:calls=");
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// Whether the server is a primary (`ROLE` says `master`).
    pub fn is_primary(&self) -> bool {
        self.try_cmd(&["ROLE"])
            .is_some_and(|r| r.contains("master"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One command to the server on `port` reached as `access` says: raw RESP
/// over plain TCP for a plain server without a user, else `redis-cli`'s
/// text.
fn cli(port: u16, access: &Access, args: &[&str]) -> Option<String> {
    if access.tls.is_none() && access.user.is_none() {
        return redis_cli(port, args);
    }
    let out = Command::new("redis-cli")
        .args(access.cli_args())
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run redis-cli ({e}); install it with `apt-get install -y redis-tools`")
        });
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Spawns `redis-server` on `port` reached as `access` says, keeping
/// nothing on disk.
fn spawn_redis(port: u16, access: &Access, args: &[String]) -> Child {
    Command::new("redis-server")
        .args(access.server_args(port))
        .args(["--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run redis-server ({e}); install it with `apt-get install -y redis-server`"
            )
        })
}

/// A Redis Cluster on free ports (below 55536: a node's bus port is its
/// port + 10000), with a short node timeout so failures are noticed
/// quickly.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    _dir: TempDir,
}

impl RedisCluster {
    /// Three primaries, no replicas, a 1 s node timeout.
    pub fn start() -> Self {
        Self::start_shaped(0, &[], &Access::default())
    }

    /// Three primaries with `replicas` replicas each, every node reached
    /// as `access` says (over TLS, the cluster bus too) and started with
    /// `extra` arguments.
    pub fn start_shaped(replicas: usize, extra: &[&str], access: &Access) -> Self {
        let dir = TempDir::new("cluster");
        let nodes: Vec<RedisServer> = (0..3 * (1 + replicas))
            .map(|i| {
                let node_dir = dir.0.join(format!("node-{i}"));
                std::fs::create_dir_all(&node_dir).unwrap();
                let mut args: Vec<String> = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "1000",
                    "--dir",
                ]
                .map(String::from)
                .to_vec();
                args.push(node_dir.display().to_string());
                args.extend(extra.iter().map(|a| a.to_string()));
                if access.tls.is_some() {
                    args.extend(["--tls-cluster".into(), "yes".into()]);
                }
                loop {
                    let node = RedisServer::start_as(access.clone(), args.clone());
                    if node.port < 55_536 {
                        break node;
                    }
                }
            })
            .collect();
        // Bounded: redis-cli waits for ever for nodes that cannot meet.
        let mut create = Command::new("timeout");
        create
            .args(["30", "redis-cli"])
            .args(access.cli_args())
            .arg("--cluster")
            .arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run redis-cli ({e}); install it with `apt-get install -y redis-tools`"
                )
            });
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes, _dir: dir };
        cluster.wait_healthy();
        if replicas > 0 {
            assert!(
                wait_until(Duration::from_secs(20), || cluster
                    .nodes
                    .iter()
                    .filter(|n| !n.is_primary())
                    .all(|n| n
                        .cmd(&["INFO", "replication"])
                        .contains("master_link_status:up"))),
                "the replicas did not sync"
            );
        }
        cluster
    }

    /// Seeds for `redis.cluster_nodes` (`rediss://` URLs over TLS).
    pub fn seeds(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| n.url().replace("redis://", ""))
            .collect()
    }

    /// Whether `key` exists on the node that owns it (the others answer
    /// MOVED).
    pub fn exists(&self, key: &str) -> bool {
        self.nodes.iter().any(|n| {
            n.try_cmd(&["EXISTS", key])
                .is_some_and(|r| matches!(r.trim(), ":1" | "1"))
        })
    }

    /// The index of the running primary that serves `key`'s slot.
    pub fn owner_of(&self, key: &str) -> Option<usize> {
        self.nodes.iter().position(|n| {
            n.is_primary()
                && n.try_cmd(&["GET", key])
                    .is_some_and(|r| !r.contains("MOVED"))
        })
    }

    /// Waits until every running node reports `cluster_state:ok`.
    pub fn wait_healthy(&self) {
        assert!(
            wait_until(Duration::from_secs(20), || self
                .nodes
                .iter()
                .filter(|n| n.ping())
                .all(|n| n
                    .try_cmd(&["CLUSTER", "INFO"])
                    .is_some_and(|i| i.contains("cluster_state:ok")))),
            "the cluster did not become healthy"
        );
    }
}

/// The name the test sentinels monitor their primary under.
pub const SENTINEL_MASTER: &str = "tollgate-test";

/// A primary, its replica, and three sentinels (quorum 2) that declare
/// the primary down after 1 s and promote the replica.
pub struct RedisSentinel {
    /// The primary at start, then the replica: index 0 and 1.
    pub servers: Vec<RedisServer>,
    /// The sentinels' ports.
    pub sentinels: Vec<u16>,
    /// How the sentinels are reached.
    sentinel_access: Access,
    sentinel_children: Vec<Child>,
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
        for i in 0..3 {
            let port = free_port();
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
            let conf = dir.file(&format!("sentinel-{i}.conf"), &conf);
            let child = Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!("cannot run redis-server ({e}); install it with `apt-get install -y redis-server`")
                });
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
        signal(self.sentinel_children[i].id(), "-STOP");
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

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        for child in &mut self.sentinel_children {
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Sends `sig` (`-STOP`, `-CONT`) to process `pid`.
pub fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill(1) is available");
    assert!(status.success(), "kill {sig} {pid} failed");
}

/// Sends one inline command over plain TCP (no client library involved).
fn redis_cli(port: u16, args: &[&str]) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut request = format!("*{}\r\n", args.len());
    for a in args {
        request.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    stream.write_all(request.as_bytes()).ok()?;
    let mut buf = vec![0u8; 64 * 1024];
    let n = stream.read(&mut buf).ok()?;
    let mut reply = String::from_utf8_lossy(&buf[..n]).into_owned();
    // A bulk reply may arrive in several reads.
    if let Some(len) = reply
        .strip_prefix('$')
        .and_then(|r| r.split("\r\n").next()?.parse::<usize>().ok())
    {
        while reply.len() < len + 8 {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => reply.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
    }
    Some(reply)
}
