//! The proxy listener itself: what a connection may take (the header
//! deadline, a malformed request), answers without a body (HEAD), and
//! graceful shutdown. Clients are raw sockets.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use tollgate::clock::{Clock, SystemClock};

use common::{Stack, raw_http, wait_until};

/// Reads from `stream` until the gateway closes it; returns what arrived.
fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut got = Vec::new();
    match stream.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the gateway kept the connection open: {e}"),
    }
    got
}

#[test]
fn a_request_head_that_does_not_arrive_in_time_loses_its_connection() {
    let s = Stack::start("header-deadline", "", |c, _| {
        c.extra.push_str("[client]\nheader_timeout_ms = 300\n");
    });
    // Half a request line and a header, then nothing.
    let mut slow = TcpStream::connect(s.gw.addr).unwrap();
    let clock = SystemClock::new();
    let started = clock.now_ms();
    slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
    let got = read_until_closed(&mut slow);
    let waited_ms = clock.now_ms() - started;
    assert!(got.is_empty(), "{:?}", String::from_utf8_lossy(&got));
    assert!(waited_ms >= 250, "closed after {waited_ms} ms");
    assert!(waited_ms < 3000, "closed after {waited_ms} ms");

    // A kept-alive connection gets the same deadline for its next request.
    let mut idle = TcpStream::connect(s.gw.addr).unwrap();
    idle.write_all(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Api-Key: acme\r\n\r\n")
        .unwrap();
    let answer = String::from_utf8_lossy(&read_until_closed(&mut idle)).into_owned();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // The gateway still serves.
    assert_eq!(
        raw_http(s.gw.addr, "GET /x HTTP/1.1\r\nX-Api-Key: acme\r\n").status,
        200
    );
}

#[test]
fn a_client_that_sends_nothing_is_closed_on_every_listener() {
    let s = Stack::start("silent", "", |c, _| {
        c.extra.push_str(
            "[client]\nheader_timeout_ms = 300\n[rls]\nlisten = \"127.0.0.1:0\"\n\
             [check]\nlisten = \"127.0.0.1:0\"\n",
        );
    });
    // h2c on the proxy: the protocol is chosen from the first bytes, so a
    // client that sends none, or half the HTTP/2 preface, is not under
    // HTTP/1's header deadline until the first-request deadline ends it.
    let toml = s.config.toml().replacen(
        "shutdown_timeout_seconds = 1\n",
        "shutdown_timeout_seconds = 1\nh2c = true\n",
        1,
    );
    let h2c = common::Gateway::start_toml(&toml);
    let clock = SystemClock::new();
    for (name, addr, sends) in [
        ("HTTP/1.1 proxy", s.gw.addr, &b""[..]),
        ("rls", s.gw.rls.unwrap(), b""),
        ("check", s.gw.check.unwrap(), b""),
        ("h2c proxy", h2c.addr, b""),
        ("h2c proxy, half a preface", h2c.addr, b"PRI * HTTP/2.0\r\n"),
        // (The whole preface makes an HTTP/2 connection, with an idle
        // timeout of its own and a GOAWAY at its end: tests/http2.rs.)
    ] {
        let started = clock.now_ms();
        let mut silent = TcpStream::connect(addr).unwrap();
        silent.write_all(sends).unwrap();
        read_until_closed(&mut silent);
        let waited_ms = clock.now_ms() - started;
        assert!(waited_ms < 3000, "{name}: closed after {waited_ms} ms");
    }
}

#[test]
fn a_malformed_request_is_answered_400_and_costs_nothing() {
    let s = Stack::start("malformed", "", |_, _| {});
    let mut bad = TcpStream::connect(s.gw.addr).unwrap();
    bad.write_all(b"GET / HTTP/1.1\r\nX-Api-Key: acme\r\nno colon here\r\n\r\n")
        .unwrap();
    let answer = String::from_utf8_lossy(&read_until_closed(&mut bad)).into_owned();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    // The default rule holds 2 tokens: both are still there.
    for _ in 0..2 {
        let ok = raw_http(s.gw.addr, "GET /x HTTP/1.1\r\nX-Api-Key: acme\r\n");
        assert_eq!(ok.status, 200);
    }
}

#[test]
fn a_head_answer_keeps_the_upstreams_length_and_has_no_body() {
    let s = Stack::start("head", "", |c, _| {
        c.extra = "[default_rule]\ncapacity = 10\nrefill_per_second = 10\n".into();
    });
    let get = raw_http(s.gw.addr, "GET /thing HTTP/1.1\r\nX-Api-Key: acme\r\n");
    let head = raw_http(s.gw.addr, "HEAD /thing HTTP/1.1\r\nX-Api-Key: acme\r\n");
    assert_eq!(head.status, 200);
    assert_eq!(head.body, "", "a HEAD answer has no body");
    let length: usize = head.header("content-length").unwrap().parse().unwrap();
    assert!(length > 0);
    // The mock's JSON echoes the method, one letter shorter for GET.
    assert_eq!(length, get.body.len() + 1);
    assert_eq!(head.header("x-ratelimit-limit"), Some("10"));
}

#[test]
fn shutdown_lets_a_request_in_flight_finish_and_accepts_no_more() {
    let (upstream, held, release) = holding_upstream();
    let mut s = Stack::start("drain", "", |c, _| {
        c.routes =
            format!("[[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"{upstream}\"\n");
    });
    let addr = s.gw.addr;
    // Idle on a kept-alive connection when shutdown begins.
    let mut idle = TcpStream::connect(addr).unwrap();
    idle.write_all(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Api-Key: idle\r\n\r\n")
        .unwrap();
    let mut first = [0u8; 12];
    idle.read_exact(&mut first).unwrap();
    assert_eq!(&first[9..12], b"200");

    let in_flight =
        thread::spawn(move || raw_http(addr, "GET /hold HTTP/1.1\r\nX-Api-Key: busy\r\n"));
    // The request is at the upstream, waiting for its answer.
    held.recv_timeout(Duration::from_secs(5)).unwrap();
    s.gw.begin_stop();
    let clock = SystemClock::new();
    let stopping = clock.now_ms();

    assert!(
        wait_until(Duration::from_secs(1), || TcpStream::connect(addr).is_err()),
        "the listener still accepts after shutdown began"
    );
    release.send(()).unwrap();
    let answer = in_flight.join().unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body, "held");
    let rest = read_until_closed(&mut idle);
    assert!(
        !rest.is_empty(),
        "the idle connection got its whole answer first"
    );
    // Well before the 5 s header deadline would have closed it.
    let closed_ms = clock.now_ms() - stopping;
    assert!(
        closed_ms < 2000,
        "idle connection closed after {closed_ms} ms"
    );
}

/// An upstream on a raw socket that answers every request at once but
/// `/hold`: that one it reports on the first receiver returned, and answers
/// only once told on the sender.
fn holding_upstream() -> (String, mpsc::Receiver<()>, mpsc::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (held_tx, held) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let release_rx = std::sync::Arc::new(std::sync::Mutex::new(release_rx));
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let (held_tx, release_rx) = (held_tx.clone(), release_rx.clone());
            thread::spawn(move || {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while stream.read(&mut byte).is_ok_and(|n| n == 1) {
                    head.push(byte[0]);
                    if !head.ends_with(b"\r\n\r\n") {
                        continue;
                    }
                    let body: &[u8] = if head.starts_with(b"GET /hold") {
                        let _ = held_tx.send(());
                        let _ = release_rx.lock().unwrap().recv();
                        b"held"
                    } else {
                        b"ok"
                    };
                    head.clear();
                    let answer =
                        format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                    if stream.write_all(answer.as_bytes()).is_err()
                        || stream.write_all(body).is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (url, held, release)
}

#[test]
fn with_h2c_the_listener_speaks_http2_and_still_http11() {
    let s = Stack::start("h2c", "", |c, _| {
        c.extra = "[default_rule]\ncapacity = 10\nrefill_per_second = 10\n".into();
    });
    let toml = s.config.toml().replacen(
        "shutdown_timeout_seconds = 1\n",
        "shutdown_timeout_seconds = 1\nh2c = true\n",
        1,
    );
    let gw = common::Gateway::start_toml(&toml);
    let url = gw.url("/thing?q=1");
    let (seen, body) = common::curl(&["--http2-prior-knowledge"], &url);
    assert_eq!(seen, "2 200", "{body}");
    let echoed: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(echoed["path"], "/thing");
    assert_eq!(echoed["headers"]["x-api-key"], "acme");
    // The upstream is spoken to in HTTP/1.1 and hears the client's host.
    assert_eq!(
        echoed["headers"]["x-forwarded-host"],
        format!("{}", gw.addr)
    );
    let (seen, _) = common::curl(&["--http2-prior-knowledge", "-I"], &url);
    assert_eq!(seen, "2 200");
    let (seen, _) = common::curl(&[], &url);
    assert_eq!(seen, "1.1 200", "HTTP/1.1 on the same listener");
    // Without h2c the preface gets no answer.
    let (seen, _) = common::curl(&["--http2-prior-knowledge"], &s.gw.url("/thing"));
    assert_ne!(seen, "2 200");
}
