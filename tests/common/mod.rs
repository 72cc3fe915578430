//! Test support: throwaway Redis servers, a mock upstream, and gateways
//! started in-process on free ports.
//!
//! Every helper cleans up after itself on drop. A missing service binary
//! fails the test with an install hint; nothing is skipped silently.

#![allow(dead_code, unreachable_pub)] // Each test file uses a different subset.

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

/// A `redis-server` on a free port, killed on drop.
pub struct RedisServer {
    pub port: u16,
    child: Child,
}

impl RedisServer {
    /// Starts a server that keeps nothing on disk.
    ///
    /// # Panics
    /// When `redis-server` is not installed or does not come up.
    pub fn start() -> Self {
        for _ in 0..3 {
            let port = free_port();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "cannot run redis-server ({e}); install it with `apt-get install -y redis-server`"
                    )
                });
            let mut server = Self { port, child };
            if wait_until(Duration::from_secs(5), || server.ping()) {
                return server;
            }
            let _ = server.child.kill();
        }
        panic!("redis-server did not answer PING on a free port after 3 attempts");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Whether the server answers PING right now.
    pub fn ping(&self) -> bool {
        redis_cli(self.port, &["PING"]).is_some_and(|r| r.contains("PONG"))
    }

    /// Runs one command and returns the raw RESP reply.
    pub fn cmd(&self, args: &[&str]) -> String {
        redis_cli(self.port, args).expect("redis answers")
    }

    /// An async connection for assertions.
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
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(pid: u32, sig: &str) {
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

/// Builds gateway configs for tests; both listeners bind port 0.
pub struct GatewayConfig {
    pub redis_url: String,
    pub rules_file: PathBuf,
    pub extra: String,
    pub routes: String,
}

impl GatewayConfig {
    /// One catch-all route `api` to `upstream`, default rule 2 tokens at 1/s.
    pub fn new(redis_url: &str, rules_file: PathBuf, upstream: &str) -> Self {
        Self {
            redis_url: redis_url.to_owned(),
            rules_file,
            extra: "[default_rule]\ncapacity = 2\nrefill_per_second = 1\n".to_owned(),
            routes: format!(
                "[[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"{upstream}\"\n"
            ),
        }
    }

    pub fn toml(&self) -> String {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nworkers = 2\n\
             shutdown_timeout_seconds = 1\n\
             [redis]\nurl = \"{}\"\ntimeout_ms = 1000\n\
             [rules]\nfile = \"{}\"\n\
             [upstream]\nconnect_timeout_ms = 500\ntimeout_ms = 1000\n\
             {}\n{}",
            self.redis_url,
            self.rules_file.display(),
            self.extra,
            self.routes
        )
    }
}

/// A gateway running in its own thread and actix System; stopped on drop.
pub struct Gateway {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Gateway {
    pub fn start(config: &GatewayConfig) -> Self {
        Self::start_toml(&config.toml())
    }

    pub fn start_toml(toml: &str) -> Self {
        let config = config::load(toml, &BTreeMap::new())
            .unwrap_or_else(|e| panic!("test config is invalid: {e}\n{toml}"));
        app::check(&config).unwrap_or_else(|p| panic!("test rules are invalid: {p:?}"));
        let listeners = Listeners::bind(&config.server).expect("ports for the gateway");
        let addr = listeners.proxy_addr().unwrap();
        let admin = listeners.admin_addr().unwrap();
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
        Self {
            addr,
            admin,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }
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
