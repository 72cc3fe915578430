//! One throwaway `redis-server` on a free port (plain, over TLS or with an
//! ACL user, as its [`Access`] says), which a test may kill, restart,
//! pause and ask for its command counts; killed on drop.

use std::process::{Command, Stdio};
use std::time::Duration;

use tollgate::bucket::Decision;
use tollgate::redis_client::{NodeAddr, RedisConn};

use super::redis_access::cli;
use super::{Access, KillOnDrop, TempDir, free_port, spawn_from, wait_until};

/// A `redis-server` on a free port, killed on drop.
pub struct RedisServer {
    pub port: u16,
    /// Extra server arguments (cluster mode, data directory).
    args: Vec<String>,
    /// How it is reached.
    access: Access,
    child: KillOnDrop,
    /// Its own working directory, so that it never loads a `dump.rdb` it
    /// did not write (a replica saves what it synced into its directory).
    /// Declared after the child: the server is killed before it goes.
    dir: TempDir,
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
            let dir = TempDir::new("redis");
            let child = spawn_redis(port, &access, &dir, &args);
            let mut server = Self {
                port,
                args: args.clone(),
                access: access.clone(),
                child,
                dir,
            };
            if wait_until(Duration::from_secs(5), || server.ping()) {
                return server;
            }
            server.child.kill();
        }
        panic!("redis-server did not answer PING on a free port after 3 attempts");
    }

    /// Kills the server (SIGKILL): connections drop, state is lost.
    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// Starts the server again on the same port (empty, unless its
    /// arguments name a data directory).
    pub fn restart(&mut self) {
        self.child = spawn_redis(self.port, &self.access, &self.dir, &self.args);
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

    /// The ids of the clients connected, in the order they connected,
    /// other than the one asking.
    pub fn client_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .cmd(&["CLIENT", "LIST", "TYPE", "normal"])
            .lines()
            .filter(|line| !line.contains("cmd=client|list"))
            .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("id=")))
            .map(|id| id.parse().expect("a client id"))
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Asserts that the script calls `take` makes through `conn` ride
    /// `conn`'s own line: the first takes the shared connection and has
    /// one line opened; with the shared connection killed, `more` calls
    /// are each allowed and nothing reopens it.
    pub async fn assert_calls_ride_a_line(
        &self,
        conn: &RedisConn,
        more: usize,
        take: impl AsyncFn() -> Decision,
    ) {
        let addr = NodeAddr::new("127.0.0.1", self.port);
        assert!(take().await.allowed);
        assert!(wait_until(Duration::from_secs(5), || conn
            .lines_open(&addr)
            == 1));
        let ids = self.client_ids();
        assert_eq!(ids.len(), 2, "the shared connection and one line: {ids:?}");
        self.cmd(&["CLIENT", "KILL", "ID", &ids[0].to_string()]);
        for _ in 0..more {
            assert!(take().await.allowed);
        }
        assert_eq!(self.client_ids(), &ids[1..], "only the line is connected");
        assert_eq!(conn.lines_open(&addr), 1);
    }

    /// [`RedisServer::cmd`], `None` when the server cannot be reached or
    /// the command fails.
    pub(super) fn try_cmd(&self, args: &[&str]) -> Option<String> {
        cli(self.port, &self.access, args)
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
        self.child.pause();
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.child.resume();
    }

    /// `calls` of one command in INFO commandstats (0 when never called:
    /// such a command has no line there; a line that does not parse fails
    /// the test).
    pub fn command_calls(&self, command: &str) -> u64 {
        let stats = self.cmd(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{command}:calls=");
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map_or(0, |rest| {
                let calls = rest.split(',').next().unwrap_or_default();
                calls
                    .parse()
                    .unwrap_or_else(|_| panic!("cmdstat_{command} calls unreadable: {rest}"))
            })
    }

    /// Whether the server is a primary (`ROLE` says `master`).
    pub fn is_primary(&self) -> bool {
        self.try_cmd(&["ROLE"])
            .is_some_and(|r| r.contains("master"))
    }
}

/// Spawns `redis-server` on `port` reached as `access` says, in `dir`,
/// saving nothing on disk (a replica still saves what it synced there).
fn spawn_redis(port: u16, access: &Access, dir: &TempDir, args: &[String]) -> KillOnDrop {
    KillOnDrop(spawn_from(
        "redis-server",
        Command::new("redis-server")
            .args(access.server_args(port))
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir.0)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    ))
}
