//! Early answers keep the client's connection: a request refused before
//! its body was read (401, 404, 405, 400, 429 on the proxy; 404 and 413
//! on the check listener; a refused write on the admin listener) leaves a kept-alive connection usable when the
//! body is small, or closes it gracefully with `Connection: close` when
//! it is not, so the client reads the answer rather than a reset. With
//! raw sockets that send the body in a second write, chunked bodies,
//! `Expect: 100-continue`, and real clients (Python's `http.client`,
//! curl `--next`). A client that shuts its side of the connection after
//! its requests still gets their answers.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

use common::Stack;

/// One answer read off a kept-alive socket.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// Header lines, names lower-cased.
    headers: Vec<(String, String)>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn closes(&self) -> bool {
        self.header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"))
    }
}

/// Reads one response (its head, then a body framed by Content-Length or
/// chunked) from `reader`; `None` when the connection gave none.
fn read_answer(reader: &mut BufReader<TcpStream>) -> Option<Answer> {
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let status = line.split(' ').nth(1)?.parse().ok()?;
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':')?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let answer = Answer { status, headers };
    if let Some(length) = answer.header("content-length") {
        let mut body = vec![0; length.parse().ok()?];
        reader.read_exact(&mut body).ok()?;
    } else if answer.header("transfer-encoding").is_some() {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size).ok()?;
            let size = usize::from_str_radix(size.trim(), 16).ok()?;
            let mut chunk = vec![0; size + 2];
            reader.read_exact(&mut chunk).ok()?;
            if size == 0 {
                break;
            }
        }
    }
    Some(answer)
}

/// A kept-alive connection to `addr`.
fn connect(addr: SocketAddr) -> (TcpStream, BufReader<TcpStream>) {
    let stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    stream.set_nodelay(true).unwrap();
    let reader = BufReader::new(stream.try_clone().unwrap());
    (stream, reader)
}

/// A stack whose tenant `spent` has a limit of 1 (spent by the caller), and
/// a route `orders` for POST only.
fn stack(tag: &str) -> Stack {
    Stack::start(
        tag,
        "[[rule]]\ntenant = \"spent\"\nroute = \"api\"\ncapacity = 1\nrefill_per_second = 1\n",
        |config, up| {
            config.routes = format!(
                "[[routes]]\nid = \"orders\"\nmethods = [\"POST\"]\npath_prefix = \"/orders\"\n\
                 upstream = \"{up}\"\n\
                 [[routes]]\nid = \"api\"\npath_prefix = \"/api\"\nupstream = \"{up}\"\n"
            );
            config.extra.push_str("[check]\nlisten = \"127.0.0.1:0\"\n");
        },
    )
}

/// The early answers of the proxy, as request heads (each line ending in
/// CRLF) and the status each gets.
fn refusals() -> Vec<(&'static str, String, u16)> {
    vec![
        (
            "no key",
            "POST /api/x HTTP/1.1\r\nHost: t\r\n".to_owned(),
            401,
        ),
        (
            "no route",
            "POST /nowhere HTTP/1.1\r\nHost: t\r\nX-Api-Key: ok\r\n".to_owned(),
            404,
        ),
        (
            "method",
            "TRACE /api/x HTTP/1.1\r\nHost: t\r\nX-Api-Key: ok\r\n".to_owned(),
            405,
        ),
        (
            "bad key",
            "POST /api/x HTTP/1.1\r\nHost: t\r\nX-Api-Key: {bad}\r\n".to_owned(),
            400,
        ),
        (
            "ambiguous path",
            "POST /api%2fx HTTP/1.1\r\nHost: t\r\nX-Api-Key: ok\r\n".to_owned(),
            400,
        ),
        (
            "over its limit",
            "POST /api/x HTTP/1.1\r\nHost: t\r\nX-Api-Key: spent\r\n".to_owned(),
            429,
        ),
    ]
}

/// The request that follows on the same connection, as a tenant of its
/// own (answered 200).
fn next(n: usize) -> Vec<u8> {
    format!("GET /api/next HTTP/1.1\r\nHost: t\r\nX-Api-Key: next-{n}\r\n\r\n").into_bytes()
}

/// Spends the `spent` tenant's one token.
fn spend(addr: SocketAddr) {
    let (mut stream, mut reader) = connect(addr);
    stream
        .write_all(b"GET /api/spend HTTP/1.1\r\nHost: t\r\nX-Api-Key: spent\r\n\r\n")
        .unwrap();
    assert_eq!(read_answer(&mut reader).unwrap().status, 200);
}

#[test]
fn a_refused_request_whose_body_comes_in_a_second_write_keeps_the_connection() {
    let s = stack("early-second-write");
    spend(s.gw.addr);
    for (n, (what, head, status)) in refusals().into_iter().enumerate() {
        for chunked in [false, true] {
            let (mut stream, mut reader) = connect(s.gw.addr);
            let body = "x".repeat(1000);
            let framing = if chunked {
                "Transfer-Encoding: chunked\r\n".to_owned()
            } else {
                format!("Content-Length: {}\r\n", body.len())
            };
            stream
                .write_all(format!("{head}{framing}\r\n").as_bytes())
                .unwrap();
            std::thread::sleep(Duration::from_millis(30));
            let payload = if chunked {
                format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len())
            } else {
                body
            };
            stream.write_all(payload.as_bytes()).unwrap();
            let first = read_answer(&mut reader).unwrap_or_else(|| panic!("{what}: no answer"));
            assert_eq!(first.status, status, "{what}");
            assert!(
                !first.closes(),
                "{what}: a small body is read, the connection kept"
            );
            stream
                .write_all(&next(2 * n + usize::from(chunked)))
                .unwrap();
            let next = read_answer(&mut reader)
                .unwrap_or_else(|| panic!("{what} (chunked: {chunked}): the next request failed"));
            assert_eq!(next.status, 200, "{what}");
        }
    }
}

#[test]
fn a_refused_request_with_a_large_body_is_answered_then_closed_gracefully() {
    let s = stack("early-large");
    // 512 KiB, more than is read to keep a connection, sent while the
    // answer is read: the gateway answers with Connection: close and reads
    // what keeps coming, so the answer is not destroyed by a reset.
    let (mut stream, mut reader) = connect(s.gw.addr);
    let size = 512 * 1024;
    stream
        .write_all(
            format!("POST /api/x HTTP/1.1\r\nHost: t\r\nContent-Length: {size}\r\n\r\n").as_bytes(),
        )
        .unwrap();
    let writer = {
        let mut stream = stream.try_clone().unwrap();
        std::thread::spawn(move || {
            let chunk = vec![b'x'; 64 * 1024];
            let mut sent = 0;
            while sent < size {
                if stream.write_all(&chunk).is_err() {
                    break;
                }
                sent += chunk.len();
            }
            sent
        })
    };
    let answer = read_answer(&mut reader).expect("the answer, not a reset");
    assert_eq!(answer.status, 401);
    assert!(answer.closes(), "{answer:?}");
    let sent = writer.join().unwrap();
    assert!(
        sent > 64 * 1024,
        "the client could keep writing while lingering"
    );
    // Then the gateway closes: end of stream, not a reset.
    let mut rest = Vec::new();
    assert!(reader.read_to_end(&mut rest).is_ok(), "closed with a FIN");
}

#[test]
fn expect_100_continue_gets_the_final_answer_without_a_100() {
    let s = stack("early-expect");
    let (mut stream, mut reader) = connect(s.gw.addr);
    stream
        .write_all(b"POST /api/x HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\nExpect: 100-continue\r\n\r\n")
        .unwrap();
    let answer = read_answer(&mut reader).unwrap();
    assert_eq!(answer.status, 401, "the final answer, never 100");
    assert!(answer.closes(), "the body never came: the connection ends");
}

#[test]
fn the_check_listener_keeps_or_closes_its_connections_the_same_way() {
    let s = stack("early-check");
    let addr = s.gw.check.unwrap();
    // A path it does not serve, with a small body: kept.
    let (mut stream, mut reader) = connect(addr);
    stream
        .write_all(b"POST /nowhere HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    stream.write_all(b"0123456789").unwrap();
    assert_eq!(read_answer(&mut reader).unwrap().status, 404);
    let check = br#"{"tenant":"c","route":"api"}"#;
    stream
        .write_all(
            format!(
                "POST /v1/check HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
                check.len()
            )
            .as_bytes(),
        )
        .unwrap();
    stream.write_all(check).unwrap();
    assert_eq!(read_answer(&mut reader).unwrap().status, 200);
    // A body over the check's bound: 413, then closed.
    let (mut stream, mut reader) = connect(addr);
    let big = "x".repeat(100_000);
    stream
        .write_all(
            format!(
                "POST /v1/check HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{big}",
                big.len()
            )
            .as_bytes(),
        )
        .unwrap();
    let answer = read_answer(&mut reader).unwrap();
    assert_eq!(answer.status, 413);
    assert!(answer.closes());
}

/// Regression: a client that shut its side of the connection once its
/// requests were sent (as `nc -N` and some HTTP/1.0 clients do) got no
/// answer: the end of its stream, read while the request was served, was
/// taken for the client going away.
#[test]
fn a_client_that_shuts_its_side_after_its_requests_gets_their_answers() {
    let s = stack("half-close");
    let check = br#"{"tenant":"hc-check","route":"api"}"#;
    let listeners = [
        (
            s.gw.addr,
            "GET /api/a HTTP/1.1\r\nHost: t\r\nX-Api-Key: hc\r\n\r\n".to_owned(),
        ),
        (
            s.gw.check.unwrap(),
            format!(
                "POST /v1/check HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{}",
                check.len(),
                String::from_utf8_lossy(check)
            ),
        ),
    ];
    for (addr, request) in listeners {
        let (mut stream, mut reader) = connect(addr);
        // Two requests in one write, then the client's end of the stream.
        stream.write_all(request.repeat(2).as_bytes()).unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        for n in 0..2 {
            let answer = read_answer(&mut reader)
                .unwrap_or_else(|| panic!("{addr}: no answer to request {n}"));
            assert_eq!(answer.status, 200, "{addr}: request {n}: {answer:?}");
        }
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "{addr}: then the connection ends");
    }
}

/// Runs `script` with python3; its stdout.
fn python(script: &str) -> String {
    common::stdout_from("python3", Command::new("python3").args(["-c", script]))
}

#[test]
fn real_clients_keep_their_connection_across_refusals() {
    let s = stack("early-clients");
    spend(s.gw.addr);
    // Python's http.client on one kept-alive connection: 60 POSTs, each
    // refused early (no key, no route, over the limit), then one allowed.
    let port = s.gw.addr.port();
    let answers = python(&format!(
        r#"
import http.client
c = http.client.HTTPConnection("127.0.0.1", {port}, timeout=5)
seen = []
for i in range(60):
    headers = [{{}}, {{"X-Api-Key": "ok"}}, {{"X-Api-Key": "spent"}}][i % 3]
    path = ["/api/a", "/nowhere", "/api/a"][i % 3]
    c.request("POST", path, body=b"y" * 2000, headers=headers)
    r = c.getresponse()
    r.read()
    seen.append(str(r.status))
c.request("GET", "/api/last", headers={{"X-Api-Key": "last"}})
r = c.getresponse()
r.read()
seen.append(str(r.status))
print(" ".join(seen))
"#
    ));
    let statuses: Vec<&str> = answers.split_whitespace().collect();
    assert_eq!(statuses.len(), 61, "{answers}");
    for (i, status) in statuses[..60].iter().enumerate() {
        assert_eq!(*status, ["401", "404", "429"][i % 3], "{answers}");
    }
    assert_eq!(statuses[60], "200");
    // curl, reusing its connection for the next URL after a refused POST.
    let dir = &s.dir;
    let body = dir.file("body.bin", &"z".repeat(20_000));
    let url = |path: &str| format!("http://127.0.0.1:{port}{path}");
    let out = common::output_from(
        "curl",
        Command::new("curl")
            .args([
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code} %{num_connects}\n",
            ])
            .args(["-X", "POST", "--data-binary"])
            .arg(format!("@{}", body.display()))
            .arg(url("/api/a"))
            .args([
                "--next",
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code} %{num_connects}\n",
            ])
            .args(["-H", "X-Api-Key: curl"])
            .arg(url("/api/b")),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        ["401 1", "200 0"],
        "{text}"
    );
}

#[test]
fn the_admin_listener_keeps_its_connection_after_a_refused_write() {
    let s = stack("early-admin");
    let (mut stream, mut reader) = connect(s.gw.admin);
    for _ in 0..3 {
        stream
            .write_all(b"PUT /admin/rules/a/api HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
            .unwrap();
        std::thread::sleep(Duration::from_millis(30));
        stream.write_all(&[b' '; 1000]).unwrap();
        let refused = read_answer(&mut reader).expect("an answer");
        // Rules come from a file here: writes answer 409.
        assert_eq!(refused.status, 409, "{refused:?}");
        assert!(!refused.closes(), "{refused:?}");
        stream
            .write_all(b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        let live = read_answer(&mut reader).expect("the next request on the same connection");
        assert_eq!(live.status, 200);
    }
}

#[actix_web::test]
async fn on_http2_a_refused_stream_ends_and_the_connection_stays() {
    let s = stack("early-h2");
    let toml = s.config.toml().replacen(
        "shutdown_timeout_seconds = 1\n",
        "shutdown_timeout_seconds = 1\nh2c = true\n",
        1,
    );
    let gw = common::Gateway::start_toml(&toml);
    // hyper's HTTP/2 client on one connection (prior knowledge).
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let driven = actix_web::rt::spawn(conn);
    let request = |method: &str, path: &str, key: Option<&str>, body: String| {
        let mut builder = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", gw.addr));
        if let Some(key) = key {
            builder = builder.header("x-api-key", key);
        }
        builder.body(body).unwrap()
    };
    for round in 0..3 {
        let refused = send
            .send_request(request("POST", "/api/a", None, "z".repeat(200_000)))
            .await
            .unwrap();
        assert_eq!(refused.status(), 401);
        send.ready().await.expect("the connection is still up");
        let allowed = send
            .send_request(request(
                "GET",
                "/api/b",
                Some(&format!("h2-{round}")),
                String::new(),
            ))
            .await
            .unwrap();
        assert_eq!(allowed.status(), 200);
    }
    assert!(!driven.is_finished(), "one connection served every stream");
}
