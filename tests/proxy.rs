//! Reverse proxying: what reaches the upstream, what comes back, streaming,
//! and upstream failures.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::io::{Read, Write};

use actix_web::web::Bytes;
use common::{
    Gateway, GatewayConfig, RedisServer, Stack, TempDir, client, eventually, get_as, header,
    refused_port,
};
use futures_util::StreamExt;

/// A gateway with routes to the mock upstream (`orders`, `slow`, `files`)
/// and one to a port where nothing listens (`down`).
fn setup(tag: &str, capacity: u32) -> Stack {
    Stack::start(tag, "", |c, up| {
        c.extra = format!("[default_rule]\ncapacity = {capacity}\nrefill_per_second = 100\n");
        c.routes = format!(
            "[[routes]]\nid = \"orders\"\npath_prefix = \"/orders\"\nupstream = \"{up}\"\n\
             [[routes]]\nid = \"slow\"\npath_prefix = \"/slow\"\nupstream = \"{up}\"\n\
             [[routes]]\nid = \"files\"\npath_prefix = \"/download\"\nupstream = \"{up}\"\n\
             [[routes]]\nid = \"down\"\npath_prefix = \"/down\"\nupstream = \"http://127.0.0.1:{}\"\n",
            refused_port()
        );
    })
}

#[actix_web::test]
async fn requests_reach_the_upstream_intact_minus_hop_by_hop_headers() {
    let s = setup("echo", 100);
    let mut res = client()
        .post(s.gw.url("/orders/7?expand=items&x=1"))
        .insert_header(("x-api-key", "shop-a"))
        .insert_header(("x-custom", "kept"))
        .insert_header(("x-forwarded-for", "203.0.113.9"))
        .send_body("hello")
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert!(header(&res, "x-ratelimit-remaining").is_some());
    assert_eq!(
        header(&res, "keep-alive"),
        None,
        "response hop-by-hop header leaked"
    );
    assert_eq!(
        header(&res, "proxy-authenticate"),
        None,
        "response hop-by-hop header leaked"
    );
    let echo: serde_json::Value = res.json().await.unwrap();
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["path"], "/orders/7");
    assert_eq!(echo["query"], "expand=items&x=1");
    assert_eq!(echo["body_bytes"], 5);
    let h = &echo["headers"];
    assert_eq!(h["x-custom"], "kept");
    assert_eq!(h["x-api-key"], "shop-a");
    assert_eq!(h["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["host"], s.up.addr.to_string());
}

#[actix_web::test]
async fn headers_named_in_connection_are_not_forwarded() {
    let s = setup("conn", 100);
    // A raw request: HTTP client libraries manage Connection themselves.
    let request = format!(
        "GET /orders/1 HTTP/1.1\r\nHost: {}\r\nX-Api-Key: raw\r\n\
         Connection: close, x-secret\r\nX-Secret: dropped\r\nTE: trailers\r\n\r\n",
        s.gw.addr
    );
    let mut stream = std::net::TcpStream::connect(s.gw.addr).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    let body = response.split("\r\n\r\n").nth(1).unwrap();
    let echo: serde_json::Value = serde_json::from_str(body).unwrap();
    let h = &echo["headers"];
    assert_eq!(h["x-api-key"], "raw");
    assert!(
        h.get("accept-encoding").is_none(),
        "the gateway adds no headers of its own: {h}"
    );
    assert!(h.get("x-secret").is_none(), "x-secret leaked: {h}");
    assert!(h.get("te").is_none(), "te leaked: {h}");
}

#[actix_web::test]
async fn large_bodies_stream_both_ways() {
    let s = setup("stream", 100);
    let c = client();
    // Upload, chunked, 8 MiB in 64 KiB pieces.
    let chunks = (0..128).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b'u'; 64 * 1024])));
    let mut up = c
        .put(s.gw.url("/orders/upload"))
        .insert_header(("x-api-key", "bulk"))
        .send_stream(futures_util::stream::iter(chunks))
        .await
        .unwrap();
    let echo: serde_json::Value = up.json().limit(1 << 20).await.unwrap();
    assert_eq!(echo["body_bytes"], 8 * 1024 * 1024);

    // Download 16 MiB, read as a stream.
    let mut down = get_as(&c, &s.gw.url("/download?bytes=16777216"), "bulk").await;
    assert_eq!(down.status(), 200);
    let mut total = 0usize;
    while let Some(chunk) = down.next().await {
        total += chunk.unwrap().len();
    }
    assert_eq!(total, 16 * 1024 * 1024);
}

/// An upstream on a raw socket that answers every request on a kept
/// connection with `Content-Length: 10` and the body `helloworld`, sent as
/// the path asks: `/whole` with the head in one write, `/after` the head
/// first and the body 100 ms later, `/split` the head with `hello` and
/// `world` 100 ms later.
fn pausing_upstream() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { break };
            std::thread::spawn(move || {
                let mut buf = [0u8; 8192];
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let request = String::from_utf8_lossy(&buf[..n]).into_owned();
                    let head = "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n";
                    let (first, rest): (String, &[u8]) = if request.contains(" /whole ") {
                        (format!("{head}helloworld"), b"")
                    } else if request.contains(" /after ") {
                        (head.to_owned(), b"helloworld")
                    } else {
                        (format!("{head}hello"), b"world")
                    };
                    let sent = stream.write_all(first.as_bytes()).and_then(|()| {
                        if rest.is_empty() {
                            return Ok(());
                        }
                        std::thread::sleep(std::time::Duration::from_millis(100));
                        stream.write_all(rest)
                    });
                    if sent.is_err() {
                        break;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

#[actix_web::test]
async fn bodies_arriving_with_their_head_or_after_it_reach_the_client_whole() {
    let up = pausing_upstream();
    let s = Stack::start("arrival", "", |c, _| {
        c.extra = "[default_rule]\ncapacity = 100\nrefill_per_second = 100\n".into();
        c.routes =
            format!("[[routes]]\nid = \"pausing\"\npath_prefix = \"/\"\nupstream = \"{up}\"\n");
    });
    let c = client();
    // Twice each, so that every way is also served on a reused connection.
    for path in ["/whole", "/after", "/split", "/whole", "/split", "/after"] {
        let mut res = get_as(&c, &s.gw.url(path), "arrival").await;
        assert_eq!(res.status(), 200, "{path}");
        assert_eq!(
            header(&res, "content-length").as_deref(),
            Some("10"),
            "{path}"
        );
        assert!(header(&res, "x-ratelimit-remaining").is_some(), "{path}");
        assert_eq!(res.body().await.unwrap(), "helloworld", "{path}");
    }
}

#[actix_web::test]
async fn no_route_is_404_and_costs_no_tokens() {
    let s = setup("noroute", 100);
    let mut res = get_as(&client(), &s.gw.url("/nothing/here"), "shop-a").await;
    assert_eq!(res.status(), 404);
    let body: serde_json::Value = res.json().await.unwrap();
    assert_eq!(body["error"], "no_route");
    assert_eq!(s.redis.cmd(&["KEYS", "rl2:*"]).trim(), "*0");
}

#[actix_web::test]
async fn unreachable_upstream_is_502_and_slow_upstream_is_504() {
    let s = setup("fail", 100);
    let c = client();
    let mut down = get_as(&c, &s.gw.url("/down"), "shop-a").await;
    assert_eq!(down.status(), 502);
    assert!(
        header(&down, "x-ratelimit-remaining").is_some(),
        "went through the limiter"
    );
    let body: serde_json::Value = down.json().await.unwrap();
    assert_eq!(body["error"], "upstream_unreachable");

    // The upstream timeout is 1 s in test configs.
    let mut slow = get_as(&c, &s.gw.url("/slow?ms=3000"), "shop-a").await;
    assert_eq!(slow.status(), 504);
    let body: serde_json::Value = slow.json().await.unwrap();
    assert_eq!(body["error"], "upstream_timeout");
}

/// A bare HTTP/1.1 upstream that counts the connections it accepts and
/// answers every request with `200 ok`; with `close_after_each`, it closes
/// the connection after each response without announcing it, as upstreams
/// with short keep-alive timeouts do.
struct CountingUpstream {
    addr: std::net::SocketAddr,
    /// Connections that carried at least one request (the gateway's
    /// start-up probe of its upstreams connects and sends nothing).
    used: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl CountingUpstream {
    fn start(close_after_each: bool) -> Self {
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let used = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = used.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let counter = counter.clone();
                std::thread::spawn(move || {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    let mut used = false;
                    loop {
                        let Ok(n) = stream.read(&mut chunk) else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        if !used {
                            used = true;
                            counter.fetch_add(1, Ordering::SeqCst);
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        // Bodiless requests only: one head, one answer.
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if stream.write_all(answer).is_err() || close_after_each {
                                return;
                            }
                        }
                    }
                });
            }
        });
        Self { addr, used }
    }

    fn used(&self) -> usize {
        self.used.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Runs `n` sequential GETs through a gateway in front of `up`, `pause`
/// apart, with `upstream_config` as its `[upstream]` lines; all must be
/// answered by the upstream.
async fn requests_through(
    up: &CountingUpstream,
    tag: &str,
    n: usize,
    upstream_config: &str,
    pause: std::time::Duration,
) {
    let redis = RedisServer::start();
    let dir = TempDir::new(tag);
    let mut config = GatewayConfig::new(
        &redis.url(),
        dir.file("rules.toml", ""),
        &format!("http://{}", up.addr),
    );
    config.extra = "[default_rule]\ncapacity = 1000\nrefill_per_second = 100\n".to_owned();
    config.upstream_extra = upstream_config.to_owned();
    let gw = Gateway::start(&config);
    let c = client();
    for i in 0..n {
        if i > 0 {
            actix_web::rt::time::sleep(pause).await;
        }
        let mut res = get_as(&c, &gw.url("/ping"), "pool").await;
        assert_eq!(res.status(), 200, "request {i}");
        assert_eq!(res.body().await.unwrap(), "ok", "request {i}");
    }
}

/// Twenty requests back to back, default upstream settings.
async fn twenty_requests_through(up: &CountingUpstream, tag: &str) {
    requests_through(up, tag, 20, "", std::time::Duration::ZERO).await;
}

#[actix_web::test]
async fn upstream_connections_are_kept_and_reused() {
    let up = CountingUpstream::start(false);
    twenty_requests_through(&up, "reuse").await;
    // One client connection lands on one worker, which keeps one
    // upstream connection for all of its requests.
    assert_eq!(up.used(), 1);
}

#[actix_web::test]
async fn an_upstream_closing_kept_connections_fails_no_request() {
    let up = CountingUpstream::start(true);
    twenty_requests_through(&up, "closing").await;
    assert_eq!(up.used(), 20, "each request needed a new connection");
}

/// A request that waited for one of its worker's upstream connection
/// slots, all held by another upstream's slow exchanges, judges an idle
/// connection's age after the wait: waiting about a second under a 300 ms
/// idle timeout, the connection is not used again.
#[actix_web::test]
async fn an_idle_connection_is_judged_after_the_wait_for_a_connection_slot() {
    let counted = CountingUpstream::start(false);
    let rules = ["a", "b", "c"]
        .map(|t| format!("[[rule]]\ntenant = \"{t}\"\nroute = \"*\"\ncapacity = 100\nrefill_per_second = 100\n"))
        .concat();
    let s = Stack::start("idle-after-wait", &rules, |c, up| {
        c.workers = 1;
        c.upstream_timeout_ms = 10_000;
        c.upstream_extra = "max_connections_per_worker = 2\nmax_connections_per_tenant = 1\n\
                            max_connections_without_rule = 1\nidle_timeout_ms = 300"
            .into();
        c.routes = format!(
            "[[routes]]\nid = \"counted\"\npath_prefix = \"/counted\"\nupstream = \"http://{}\"\n\
             [[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"{up}\"\n",
            counted.addr
        );
    });
    let c = client();
    let res = get_as(&c, &s.gw.url("/counted"), "c").await;
    assert_eq!(res.status(), 200);
    // Both slots taken by slow exchanges with the other upstream.
    let slow: Vec<_> = ["a", "b"]
        .map(|t| {
            let url = s.gw.url("/slow?ms=1000");
            actix_web::rt::spawn(async move { get_as(&client(), &url, t).await.status() })
        })
        .into();
    let held = eventually(std::time::Duration::from_secs(5), || async {
        s.up.slow_now() == 2
    });
    assert!(held.await, "the slow exchanges never reached the upstream");
    let res = get_as(&c, &s.gw.url("/counted"), "c").await;
    assert_eq!(res.status(), 200);
    for status in futures_util::future::join_all(slow).await {
        assert_eq!(status.unwrap(), 200);
    }
    assert_eq!(
        counted.used(),
        2,
        "the connection idle past its timeout was used again"
    );
}

#[actix_web::test]
async fn connections_idle_past_their_timeout_are_not_used_again() {
    let up = CountingUpstream::start(false);
    requests_through(
        &up,
        "idle",
        3,
        "idle_timeout_ms = 50",
        std::time::Duration::from_millis(300),
    )
    .await;
    assert_eq!(up.used(), 3, "each pause outlasted the idle timeout");
}
