//! Test support: throwaway Redis servers, a mock upstream, and gateways
//! started in-process on free ports.
//!
//! Every helper cleans up after itself on drop. A missing service binary
//! fails the test with an install hint; nothing is skipped silently.

#![allow(dead_code, unreachable_pub, unused_imports)] // Each test file uses a different subset.

pub mod certs;
pub mod peers;
mod redis_shapes;

pub use redis_shapes::{
    Access, RedisCluster, RedisSentinel, RedisServer, SENTINEL_MASTER, TlsAccess, signal,
};

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use futures_util::StreamExt;
use tollgate::app::{self, Listeners};
use tollgate::clock::{Clock, SystemClock};
use tollgate::config;

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("an ephemeral port is available")
}

/// A port on 127.0.0.1 where connections are refused for as long as the
/// test process runs: bound, never listening, so nothing else can take it
/// (a port merely found free may be taken before it is used).
pub fn refused_port() -> u16 {
    static RESERVED: std::sync::OnceLock<tokio::net::TcpSocket> = std::sync::OnceLock::new();
    let socket = RESERVED.get_or_init(|| {
        let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
        socket
            .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("a port to reserve");
        socket
    });
    socket.local_addr().expect("a bound socket").port()
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tollgate-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir can be created");
        Self(dir)
    }

    pub fn file(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("temp file can be written");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits up to `limit` for `check` to hold, polling every 20 ms.
pub fn wait_until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let clock = SystemClock::new();
    let deadline = clock.now_ms() + limit.as_millis() as u64;
    while clock.now_ms() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    check()
}

/// A mock upstream on a free port, in its own thread and runtime.
///
/// - `/slow?ms=N` answers after N ms;
/// - `/download?bytes=N` streams N bytes in 64 KiB chunks;
/// - `/status/N` answers with status N;
/// - anything else echoes the request as JSON (method, path, query,
///   headers, body length).
pub struct Upstream {
    pub addr: SocketAddr,
}

impl Upstream {
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("port for the mock upstream");
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                HttpServer::new(|| App::new().default_service(web::to(mock)))
                    .workers(1)
                    .disable_signals()
                    .listen(listener)
                    .expect("mock upstream listens")
                    .run()
                    .await
                    .expect("mock upstream runs");
            });
        });
        Self { addr }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

fn query_number(req: &HttpRequest, name: &str) -> u64 {
    req.query_string()
        .split('&')
        .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn mock(req: HttpRequest, mut body: web::Payload) -> HttpResponse {
    let path = req.path().to_owned();
    if path == "/slow" {
        actix_web::rt::time::sleep(Duration::from_millis(query_number(&req, "ms"))).await;
        return HttpResponse::Ok().body("slow");
    }
    if path == "/download" {
        let total = query_number(&req, "bytes");
        let chunk = 64 * 1024u64;
        let chunks = (0..total.div_ceil(chunk)).map(move |i| {
            let n = chunk.min(total - i * chunk) as usize;
            Ok::<_, std::convert::Infallible>(web::Bytes::from(vec![b'x'; n]))
        });
        return HttpResponse::Ok().streaming(futures_util::stream::iter(chunks));
    }
    if let Some(code) = path.strip_prefix("/status/") {
        let code = code.parse().unwrap_or(500);
        return HttpResponse::build(actix_web::http::StatusCode::from_u16(code).unwrap()).finish();
    }
    let mut received = 0usize;
    while let Some(chunk) = body.next().await {
        received += chunk.map(|c| c.len()).unwrap_or(0);
    }
    let headers: BTreeMap<String, String> = req
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("?").to_owned()))
        .collect();
    HttpResponse::Ok()
        .insert_header(("keep-alive", "timeout=99"))
        .insert_header(("proxy-authenticate", "Basic realm=\"upstream\""))
        .json(serde_json::json!({
            "method": req.method().as_str(),
            "path": path,
            "query": req.query_string(),
            "headers": headers,
            "body_bytes": received,
        }))
}

/// A Redis, the mock upstream, a rules file and one gateway in front of
/// them: the set most gateway tests need.
pub struct Stack {
    pub redis: RedisServer,
    pub up: Upstream,
    pub dir: TempDir,
    /// The gateway's config, to start more gateways like it.
    pub config: GatewayConfig,
    pub gw: Gateway,
}

impl Stack {
    /// Starts the set with `rules` as the rules file; `configure` adjusts
    /// the gateway's config (routes, default rule, timeouts) first, given
    /// the upstream's URL.
    pub fn start(tag: &str, rules: &str, configure: impl FnOnce(&mut GatewayConfig, &str)) -> Self {
        let redis = RedisServer::start();
        let up = Upstream::start();
        let dir = TempDir::new(tag);
        let mut config = GatewayConfig::new(&redis.url(), dir.file("rules.toml", rules), &up.url());
        configure(&mut config, &up.url());
        let gw = Gateway::start(&config);
        Self {
            redis,
            up,
            dir,
            config,
            gw,
        }
    }
}

/// A response read off a raw socket.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    /// Header lines as sent, names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl RawResponse {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }
}

/// Sends `head` (request line and headers, each line ending in CRLF, the
/// blank line added here, `Connection: close` too) exactly as written, and
/// reads the whole answer. For what a client library would normalise or
/// refuse to send.
pub fn raw_http(addr: SocketAddr, head: &str) -> RawResponse {
    raw_http_with_body(addr, head, "")
}

/// [`raw_http`] with `body` after the head (which gives its length).
pub fn raw_http_with_body(addr: SocketAddr, head: &str, body: &str) -> RawResponse {
    let mut stream = TcpStream::connect(addr).expect("gateway accepts");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(stream, "{head}Connection: close\r\n\r\n{body}").unwrap();
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .expect("gateway answers in time");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {text:?}"));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect::<Vec<_>>();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    RawResponse {
        status,
        headers,
        body,
    }
}

/// The payload of a chunked body (which must be complete).
fn dechunk(chunked: &str) -> String {
    let mut out = String::new();
    let mut body = chunked;
    loop {
        let (size, rest) = body
            .split_once("\r\n")
            .unwrap_or_else(|| panic!("no chunk size line in {chunked:?}"));
        let n = usize::from_str_radix(size.trim(), 16)
            .unwrap_or_else(|_| panic!("bad chunk size {size:?} in {chunked:?}"));
        if n == 0 {
            return out;
        }
        let data = rest
            .get(..n)
            .unwrap_or_else(|| panic!("a chunk cut short in {chunked:?}"));
        out.push_str(data);
        body = rest[n..]
            .strip_prefix("\r\n")
            .unwrap_or_else(|| panic!("no CRLF after a chunk in {chunked:?}"));
    }
}

/// An upstream on a raw socket that answers every request with a huge
/// body, written as fast as the reader takes it, and records when the
/// reader (the gateway) closes each connection.
pub struct EndlessUpstream {
    pub addr: SocketAddr,
    open: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    closed: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl EndlessUpstream {
    pub fn start() -> Self {
        use std::sync::Arc;
        use std::sync::atomic::AtomicUsize;
        let listener = TcpListener::bind("127.0.0.1:0").expect("port for the upstream");
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (o, c) = (open.clone(), closed.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { break };
                let (o, c) = (o.clone(), c.clone());
                std::thread::spawn(move || {
                    o.fetch_add(1, Ordering::SeqCst);
                    let mut head = [0u8; 4096];
                    let _ = stream.read(&mut head);
                    let chunk = vec![b'x'; 64 * 1024];
                    let _ = write!(
                        stream,
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                        1u64 << 40
                    );
                    while stream.write_all(&chunk).is_ok() {}
                    c.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        Self { addr, open, closed }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Connections opened so far.
    pub fn opened(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Connections the reader has closed so far.
    pub fn closed(&self) -> usize {
        self.closed.load(Ordering::SeqCst)
    }
}

/// Builds gateway configs for tests; both listeners bind port 0.
#[derive(Clone)]
pub struct GatewayConfig {
    pub redis_url: String,
    /// `redis.cluster_nodes`; non-empty switches to Redis Cluster.
    pub cluster_nodes: Vec<String>,
    /// `redis.timeout_ms`.
    pub redis_timeout_ms: u64,
    /// More `[redis]` keys, one per line.
    pub redis_extra: String,
    pub rules_file: PathBuf,
    /// `rules.database_url`; empty = file mode.
    pub database_url: String,
    /// More `[rules]` keys, one per line.
    pub rules_extra: String,
    /// `admin.token`.
    pub admin_token: String,
    /// `admin.read_token`.
    pub admin_read_token: String,
    /// More `[upstream]` keys, one per line.
    pub upstream_extra: String,
    /// More sections (e.g. `[default_rule]`).
    pub extra: String,
    pub routes: String,
    /// `server.workers`.
    pub workers: u32,
    /// `upstream.timeout_ms`.
    pub upstream_timeout_ms: u64,
}

impl GatewayConfig {
    /// One catch-all route `api` to `upstream`, default rule 2 tokens at 1/s.
    pub fn new(redis_url: &str, rules_file: PathBuf, upstream: &str) -> Self {
        Self {
            redis_url: redis_url.to_owned(),
            cluster_nodes: Vec::new(),
            redis_timeout_ms: 1000,
            redis_extra: String::new(),
            rules_file,
            database_url: String::new(),
            rules_extra: String::new(),
            admin_token: String::new(),
            admin_read_token: String::new(),
            upstream_extra: String::new(),
            extra: "[default_rule]\ncapacity = 2\nrefill_per_second = 1\n".to_owned(),
            routes: format!(
                "[[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"{upstream}\"\n"
            ),
            workers: 2,
            upstream_timeout_ms: 1000,
        }
    }

    pub fn toml(&self) -> String {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nworkers = {}\n\
             shutdown_timeout_seconds = 1\n\
             [redis]\nurl = \"{}\"\ncluster_nodes = {:?}\ntimeout_ms = {}\n{}\n\
             [rules]\nfile = \"{}\"\ndatabase_url = \"{}\"\n{}\n\
             [admin]\ntoken = \"{}\"\nread_token = \"{}\"\n\
             [upstream]\nconnect_timeout_ms = 500\ntimeout_ms = {}\n{}\n\
             {}\n{}",
            self.workers,
            self.redis_url,
            self.cluster_nodes,
            self.redis_timeout_ms,
            self.redis_extra,
            self.rules_file.display(),
            self.database_url,
            self.rules_extra,
            self.admin_token,
            self.admin_read_token,
            self.upstream_timeout_ms,
            self.upstream_extra,
            self.extra,
            self.routes
        )
    }
}

/// A gateway running in its own thread and actix System; stopped on drop.
pub struct Gateway {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    /// Envoy's rate limit service, when `[rls] listen` is set.
    pub rls: Option<SocketAddr>,
    /// The HTTP check, when `[check] listen` is set.
    pub check: Option<SocketAddr>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Gateway {
    pub fn start(config: &GatewayConfig) -> Self {
        Self::start_toml(&config.toml())
    }

    pub fn start_toml(toml: &str) -> Self {
        // Gateways in one test process would share the default
        // <hostname>-<pid> id; give each its own, as separate hosts have.
        static N: AtomicU32 = AtomicU32::new(0);
        let id = format!(
            "test-gw-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let env = BTreeMap::from([("TOLLGATE__INSTANCE__ID".to_owned(), id)]);
        let config = config::load(toml, &env)
            .unwrap_or_else(|e| panic!("test config is invalid: {e}\n{toml}"));
        app::check(&config).unwrap_or_else(|p| panic!("test rules are invalid: {p:?}"));
        let listeners = Listeners::bind(&config).expect("ports for the gateway");
        let addr = listeners.proxy_addr().unwrap();
        let admin = listeners.admin_addr().unwrap();
        let (rls, check) = (listeners.rls_addr(), listeners.check_addr());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                app::run(config, listeners, async {
                    let _ = stopped.await;
                })
                .await
                .expect("gateway runs");
            });
        });
        let gateway = Self {
            addr,
            admin,
            rls,
            check,
            stop: Some(stop),
            thread: Some(thread),
        };
        // The sockets accept at once; /ready answers 200 only once startup
        // (migrations, first rule load) is done, the servers run and every
        // worker's Redis connection is warm (or Redis is known down).
        assert!(
            wait_until(Duration::from_secs(15), || http_status(admin, "/ready")
                == Some(200)),
            "the gateway was not ready within 15 s"
        );
        gateway
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Sends the shutdown signal without waiting for the gateway to stop
    /// (dropping it waits).
    pub fn begin_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }
}

/// Status of a plain blocking `GET path` (no client library, for use
/// outside a runtime).
fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut stream = TcpStream::connect(addr).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// An HTTP client for tests (no redirects, generous timeout).
pub fn client() -> awc::Client {
    awc::Client::builder()
        .timeout(Duration::from_secs(10))
        .disable_redirects()
        .finish()
}

/// The body of `GET url`, as text.
pub async fn text(url: &str) -> String {
    let body = client()
        .get(url)
        .send()
        .await
        .expect("the server answers")
        .body()
        .limit(16 * 1024 * 1024)
        .await
        .expect("the body arrives");
    String::from_utf8_lossy(&body).into_owned()
}

/// A header's value as text, if present.
pub fn header<B>(res: &awc::ClientResponse<B>, name: &str) -> Option<String> {
    res.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

/// Sends GET `url` with an optional API key; returns status and the
/// X-RateLimit-Remaining header.
pub async fn get(url: &str, key: Option<&str>) -> (u16, Option<String>) {
    let mut req = client().get(url);
    if let Some(key) = key {
        req = req.insert_header(("x-api-key", key));
    }
    let res = req.send().await.expect("gateway answers");
    (res.status().as_u16(), header(&res, "x-ratelimit-remaining"))
}

/// The status of a GET of `url` as `tenant` on a client kept across
/// requests (so the connection is reused); `None` when nothing answered.
pub async fn status_as(c: &awc::Client, url: &str, tenant: &str) -> Option<u16> {
    let res = c.get(url).insert_header(("x-api-key", tenant)).send().await;
    res.ok().map(|r| r.status().as_u16())
}

/// Runs a PostgreSQL client command (`psql`), failing with an install hint
/// when it is missing. Returns trimmed stdout of an unaligned, tuples-only
/// query.
pub fn psql(url: &str, sql: &str) -> String {
    let out = Command::new("psql")
        .args([
            "-X",
            "-q",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            url,
            "-c",
            sql,
        ])
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run psql ({e}); install it with `apt-get install -y postgresql-client`")
        });
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

/// The `X-RateLimit-Limit` a tenant gets on `path`.
pub async fn limit_of(gw: &Gateway, tenant: &str) -> Option<String> {
    let res = client()
        .get(gw.url("/limit"))
        .insert_header(("x-api-key", tenant))
        .send()
        .await
        .expect("gateway answers");
    header(&res, "x-ratelimit-limit")
}

/// Polls until `tenant`'s limit on `gw` is `expected`; returns the wait in
/// ms, or `None` after `within`.
pub async fn wait_for_limit(
    gw: &Gateway,
    tenant: &str,
    expected: &str,
    within: Duration,
) -> Option<u64> {
    let clock = SystemClock::new();
    let start = clock.now_ms();
    loop {
        if limit_of(gw, tenant).await.as_deref() == Some(expected) {
            return Some(clock.now_ms() - start);
        }
        if clock.now_ms() - start > within.as_millis() as u64 {
            return None;
        }
        actix_web::rt::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls the async `check` every 20 ms until it holds; `false` after
/// `within`.
pub async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let clock = SystemClock::new();
    loop {
        if check().await {
            return true;
        }
        if clock.now_ms() > within.as_millis() as u64 {
            return false;
        }
        actix_web::rt::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends an admin request; returns status and JSON body (`Null` when empty).
pub async fn admin(
    gw: &Gateway,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    let method = actix_web::http::Method::from_bytes(method.as_bytes()).unwrap();
    let mut req = client().request(method, gw.admin_url(path));
    if let Some(token) = token {
        req = req.insert_header(("authorization", format!("Bearer {token}")));
    }
    let mut res = match body {
        Some(b) => {
            req.insert_header(("content-type", "application/json"))
                .send_body(b.to_owned())
                .await
        }
        None => req.send().await,
    }
    .expect("admin listener answers");
    let bytes = res.body().await.unwrap();
    let json = if bytes.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap_or_else(|_| {
            serde_json::Value::String(String::from_utf8_lossy(&bytes).into_owned())
        })
    };
    (res.status().as_u16(), json)
}

/// `GET /ready` as JSON.
pub async fn ready(gw: &Gateway) -> serde_json::Value {
    admin(gw, "GET", "/ready", None, None).await.1
}

/// The value of one series in `/metrics` (0 when absent), e.g.
/// `tollgate_rule_reloads_total{result="error"}`.
pub async fn metric(gw: &Gateway, series: &str) -> f64 {
    let (_, text) = admin(gw, "GET", "/metrics", None, None).await;
    text.as_str()
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A gateway running as its own `tollgate serve` process (its own metrics
/// registry, as in production); killed on drop.
pub struct GatewayProcess {
    pub name: String,
    pub proxy: u16,
    pub admin: u16,
    /// Envoy's rate limit service, when served.
    pub rls: Option<u16>,
    /// Where its stderr (the log) goes.
    pub log: PathBuf,
    child: Child,
}

impl GatewayProcess {
    /// Writes `toml` (with `{proxy}` and `{admin}` set to port 0, so the
    /// gateway binds free ports itself, with no race) and starts
    /// `tollgate serve` on it; reads the bound ports from its log and waits
    /// until `/ready` answers 200.
    pub fn start(name: &str, dir: &TempDir, toml: &str) -> Self {
        let toml = toml.replace("{proxy}", "0").replace("{admin}", "0");
        let path = dir.file(&format!("{name}.toml"), &toml);
        let log_path = dir.0.join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["serve", "--config"])
            .arg(&path)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("the tollgate binary runs");
        let mut ports = None;
        let found = wait_until(Duration::from_secs(20), || {
            ports = serving_ports(&std::fs::read_to_string(&log_path).unwrap_or_default());
            ports.is_some()
        });
        let Some((proxy, admin, rls, _check)) = ports.filter(|_| found) else {
            let _ = child.kill();
            panic!("gateway {name} did not start; see {}", log_path.display());
        };
        let gateway = Self {
            name: name.to_owned(),
            proxy,
            admin,
            rls,
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

    /// `GET /ready` as JSON.
    pub fn ready(&self) -> serde_json::Value {
        serde_json::from_str(&self.admin_text("/ready")).unwrap_or_default()
    }

    /// Freezes the gateway (SIGSTOP): its sockets stay open, nothing answers.
    pub fn pause(&self) {
        signal(self.child.id(), "-STOP");
    }

    /// Thaws a paused gateway (SIGCONT).
    pub fn resume(&self) {
        signal(self.child.id(), "-CONT");
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

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A real Prometheus server scraping `targets` (admin port, region label)
/// every second; killed on drop.
pub struct PrometheusServer {
    pub port: u16,
    child: Option<Child>,
}

impl PrometheusServer {
    /// Starts on `port` (chosen beforehand, so gateways can be told where
    /// it will be).
    pub fn start_on(dir: &TempDir, targets: &[(u16, &str)], port: u16) -> Self {
        let mut config = String::from(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: tollgate\n    static_configs:\n",
        );
        for (port, region) in targets {
            config.push_str(&format!(
                "      - targets: [\"127.0.0.1:{port}\"]\n        labels:\n          region: {region}\n"
            ));
        }
        let config = dir.file("prometheus.yml", &config);
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.0.join("prometheus-data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run prometheus ({e}); install it with `apt-get install -y prometheus`"
                )
            });
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        assert!(
            wait_until(Duration::from_secs(20), || http_status(addr, "/-/ready")
                == Some(200)),
            "prometheus did not become ready"
        );
        Self {
            port,
            child: Some(child),
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops the server, as an outage would.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Runs an instant query; returns the JSON answer.
    pub async fn query(&self, promql: &str) -> serde_json::Value {
        client()
            .get(format!("{}/api/v1/query", self.url()))
            .query(&[("query", promql)])
            .unwrap()
            .send()
            .await
            .expect("prometheus answers")
            .json()
            .limit(16 * 1024 * 1024)
            .await
            .expect("prometheus answers JSON")
    }
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A `RateLimit-Policy` or `RateLimit` value read as an RFC 9651 List:
/// each member's policy name (a String item) and its parameters, which
/// must be integers, in order. Panics on anything else.
pub fn ratelimit_members(value: &str) -> Vec<(String, Vec<(String, i64)>)> {
    let list: sfv::List = sfv::Parser::new(value)
        .parse()
        .unwrap_or_else(|e| panic!("{value:?} is not a structured-field list: {e}"));
    list.into_iter()
        .map(|member| {
            let sfv::ListEntry::Item(item) = member else {
                panic!("{value:?}: an inner list where an item belongs");
            };
            let name = item
                .bare_item
                .as_string()
                .unwrap_or_else(|| panic!("{value:?}: the policy is not a String"))
                .as_str()
                .to_owned();
            let params = item
                .params
                .iter()
                .map(|(key, v)| {
                    let n = v
                        .as_integer()
                        .unwrap_or_else(|| panic!("{value:?}: {} is not an integer", key.as_str()));
                    (key.as_str().to_owned(), i64::from(n))
                })
                .collect();
            (name, params)
        })
        .collect()
}

/// `curl` with `args` against `url`: the HTTP version and status it saw,
/// then its output.
pub fn curl(args: &[&str], url: &str) -> (String, String) {
    let out = std::process::Command::new("curl")
        .args([
            "-s",
            "-w",
            "\n%{http_version} %{http_code}",
            "-H",
            "X-Api-Key: acme",
        ])
        .args(args)
        .arg(url)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run curl ({e}); install it with `apt-get install -y curl`")
        });
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, last) = text.rsplit_once('\n').unwrap_or(("", &text));
    (last.to_owned(), body.to_owned())
}

/// The gateway's `/metrics` text (a blocking read).
pub fn metrics_text(gw: &Gateway) -> String {
    raw_http(gw.admin, "GET /metrics HTTP/1.1\r\nHost: admin\r\n").body
}
