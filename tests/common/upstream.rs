//! Mock upstreams: one that answers as the tests ask (echo, slow, a
//! download, a status) and counts the slow requests it works on, one
//! that streams without end, and one on Python's own HTTP server that
//! reports what each answer cost (`tests/fixtures/usage_upstream.py`).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
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

/// A mock upstream on a free port, in its own thread and runtime.
///
/// - `/slow?ms=N` answers after N ms;
/// - `/download?bytes=N` streams N bytes in 64 KiB chunks;
/// - `/status/N` answers with status N;
/// - anything else echoes the request as JSON (method, path, query,
///   headers, body length).
pub struct Upstream {
    pub addr: SocketAddr,
    /// `/slow` requests being worked on.
    slow: Arc<InFlight>,
}

/// Requests being worked on, and the most at once.
#[derive(Default)]
struct InFlight {
    now: AtomicU32,
    most: AtomicU32,
}

/// One request counted in an [`InFlight`] until dropped (its handler
/// finished, or was dropped when its connection closed).
struct Working(Arc<InFlight>);

impl Working {
    fn new(counts: &Arc<InFlight>) -> Self {
        let now = counts.now.fetch_add(1, Ordering::SeqCst) + 1;
        counts.most.fetch_max(now, Ordering::SeqCst);
        Self(counts.clone())
    }
}

impl Drop for Working {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Upstream {
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("port for the mock upstream");
        let addr = listener.local_addr().unwrap();
        let slow = Arc::new(InFlight::default());
        let counts = web::Data::from(slow.clone());
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                HttpServer::new(move || {
                    App::new()
                        .app_data(counts.clone())
                        .default_service(web::to(mock))
                })
                .workers(1)
                .disable_signals()
                .listen(listener)
                .expect("mock upstream listens")
                .run()
                .await
                .expect("mock upstream runs");
            });
        });
        Self { addr, slow }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The most `/slow` requests the upstream has worked on at once.
    pub fn most_slow_at_once(&self) -> u32 {
        self.slow.most.load(Ordering::SeqCst)
    }

    /// `/slow` requests the upstream is working on now.
    pub fn slow_now(&self) -> u32 {
        self.slow.now.load(Ordering::SeqCst)
    }
}

fn query_number(req: &HttpRequest, name: &str) -> u64 {
    req.query_string()
        .split('&')
        .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn mock(req: HttpRequest, mut body: web::Payload, slow: web::Data<InFlight>) -> HttpResponse {
    let path = req.path().to_owned();
    if path == "/slow" {
        let _working = Working::new(&slow.into_inner());
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
                    let mut head = [0u8; 4096];
                    // A connection that sends nothing (the gateway's
                    // start-up probe) is not counted.
                    if !matches!(stream.read(&mut head), Ok(n) if n > 0) {
                        return;
                    }
                    o.fetch_add(1, Ordering::SeqCst);
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

    /// Connections that sent a request so far.
    pub fn opened(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Connections the reader has closed so far.
    pub fn closed(&self) -> usize {
        self.closed.load(Ordering::SeqCst)
    }
}

/// `tests/fixtures/usage_upstream.py` on the port it printed; killed on
/// drop.
pub struct UsageUpstream {
    pub port: u16,
    _child: KillOnDrop,
}

impl UsageUpstream {
    /// Starts it (Debian's `python3`).
    pub fn start() -> Self {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/usage_upstream.py"
        );
        let mut child = KillOnDrop(spawn_from(
            "python3",
            Command::new("python3")
                .arg(script)
                .stdout(Stdio::piped())
                .stderr(Stdio::null()),
        ));
        let mut line = String::new();
        BufReader::new(child.0.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{line:?}: {e}"));
        Self {
            port,
            _child: child,
        }
    }

    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}
