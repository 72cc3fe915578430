//! No client holds shared resources hostage: slow readers and uploaders
//! are cut off and release their upstream connection, a slow upload is
//! never blamed on the upstream, and neither one tenant nor a flood of
//! fresh keys can take every upstream connection. Clients are raw sockets.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

use tollgate::clock::{Clock, SystemClock};

use common::{EndlessUpstream, Stack, raw_http, wait_until};

/// Writes a request head with `key` and returns the open socket.
fn open_request(addr: SocketAddr, head: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(head.as_bytes()).unwrap();
    stream
}

/// The status of the answer on `stream`.
fn read_status(stream: &mut TcpStream) -> u16 {
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).unwrap();
    std::str::from_utf8(&head[9..12]).unwrap().parse().unwrap()
}

/// Whether the kernel holds an established TCP connection from local port
/// `local` to remote port `remote` on 127.0.0.1 (`/proc/net/tcp`).
fn established(local: u16, remote: u16) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next().unwrap(), 16).unwrap();
        port(fields[1]) == local && port(fields[2]) == remote && fields[3] == "01"
    })
}

#[test]
fn a_client_that_stops_reading_loses_its_upstream_connection_and_its_own() {
    let endless = EndlessUpstream::start();
    let s = Stack::start("slow-reader", "", |c, up| {
        c.extra = "[default_rule]\ncapacity = 100\nrefill_per_second = 100\n\
                   [client]\nwrite_timeout_ms = 300\nmin_bytes_per_second = 0\n"
            .into();
        c.routes = format!(
            "[[routes]]\nid = \"big\"\npath_prefix = \"/big\"\nupstream = \"{}\"\n\
             [[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"{up}\"\n",
            endless.url()
        );
    });
    // Reads the head, then nothing more, keeping the socket open.
    let mut stalled = open_request(
        s.gw.addr,
        "GET /big HTTP/1.1\r\nHost: gw\r\nX-Api-Key: reader\r\n\r\n",
    );
    assert_eq!(read_status(&mut stalled), 200);
    assert!(wait_until(Duration::from_secs(3), || endless.opened() == 1));
    assert!(
        wait_until(Duration::from_secs(10), || endless.closed() == 1),
        "the gateway kept the upstream connection of a client that stopped reading"
    );
    // The gateway has let go of our connection too (it is no longer
    // established on its side), though we never read.
    let ours = stalled.local_addr().unwrap().port();
    assert!(
        wait_until(Duration::from_secs(5), || !established(
            s.gw.addr.port(),
            ours
        )),
        "the gateway kept the connection of a client that stopped reading"
    );
    let res = raw_http(
        s.gw.addr,
        "GET /ok HTTP/1.1\r\nHost: gw\r\nX-Api-Key: other\r\n",
    );
    assert_eq!(res.status, 200);
    drop(stalled);
}

/// A gateway with `upstream.timeout_ms = upstream_timeout_ms` and the
/// `[client]` keys `client`, generous limits.
fn uploads_at(tag: &str, upstream_timeout_ms: u64, client: &str) -> Stack {
    Stack::start(tag, "", |c, _| {
        c.upstream_timeout_ms = upstream_timeout_ms;
        c.extra = format!(
            "[default_rule]\ncapacity = 100\nrefill_per_second = 100\n[client]\n{client}\n"
        );
    })
}

#[test]
fn a_slow_uploader_gets_408_and_is_not_blamed_on_the_upstream() {
    let s = uploads_at(
        "slow-uploader",
        1000,
        "read_timeout_ms = 500\nmin_bytes_per_second = 1024",
    );
    let mut stream = open_request(
        s.gw.addr,
        "POST /upload HTTP/1.1\r\nHost: gw\r\nX-Api-Key: trickle\r\nContent-Length: 1000\r\n\r\n",
    );
    let clock = SystemClock::new();
    let (done, finished) = mpsc::channel();
    let mut writer = stream.try_clone().unwrap();
    std::thread::spawn(move || {
        // One byte every 100 ms, until the gateway gives up on us.
        while finished.try_recv().is_err() && writer.write_all(b"x").is_ok() {
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let _ = done.send(());
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"error\":\"client_timeout\""), "{answer}");
    let elapsed_ms = clock.now_ms();
    assert!(elapsed_ms < 3000, "cut off after {elapsed_ms} ms");
}

#[test]
fn an_upload_longer_than_the_upstream_timeout_but_within_pace_is_served() {
    let s = uploads_at(
        "steady-uploader",
        300,
        "read_timeout_ms = 1000\nmin_bytes_per_second = 0",
    );
    let mut stream = open_request(
        s.gw.addr,
        "POST /upload HTTP/1.1\r\nHost: gw\r\nX-Api-Key: steady\r\nContent-Length: 600\r\n\r\n",
    );
    // 900 ms of upload, three times the upstream timeout.
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(150));
        stream.write_all(&[b'y'; 100]).unwrap();
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"body_bytes\":600"), "{answer}");
}

/// Sends `count` concurrent `GET target` requests, one per key from
/// `key(i)`, and returns a receiver of their statuses in order of arrival.
fn concurrent(
    addr: SocketAddr,
    target: &str,
    count: usize,
    key: impl Fn(usize) -> String,
) -> mpsc::Receiver<u16> {
    let (tx, rx) = mpsc::channel();
    for i in 0..count {
        let tx = tx.clone();
        let head = format!(
            "GET {target} HTTP/1.1\r\nHost: gw\r\nX-Api-Key: {}\r\n",
            key(i)
        );
        std::thread::spawn(move || {
            let _ = tx.send(raw_http(addr, &head).status);
        });
    }
    rx
}

/// The next `n` statuses `statuses` receives, each within `within`.
fn next_statuses(statuses: &mpsc::Receiver<u16>, n: usize, within: Duration) -> Vec<u16> {
    (0..n)
        .map(|_| statuses.recv_timeout(within).unwrap())
        .collect()
}

/// `GET /slow?ms=0` (answered by the upstream at once) as `tenant`.
fn quick_get(addr: SocketAddr, tenant: &str) -> common::RawResponse {
    raw_http(
        addr,
        &format!("GET /slow?ms=0 HTTP/1.1\r\nHost: gw\r\nX-Api-Key: {tenant}\r\n"),
    )
}

/// `acme`, a tenant with a rule, is served within a second.
fn acme_is_served_at_once(addr: SocketAddr) {
    let clock = SystemClock::new();
    let res = quick_get(addr, "acme");
    assert_eq!(res.status, 200);
    assert!(clock.now_ms() < 1000, "served after {} ms", clock.now_ms());
}

/// A one-worker gateway whose upstream answers `/slow?ms=N` after N ms.
fn bounded_stack(tag: &str, upstream_extra: &str) -> Stack {
    let rules = "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\ncapacity = 100\nrefill_per_second = 100\n\
                 [[rule]]\ntenant = \"beta\"\nroute = \"api\"\ncapacity = 100\nrefill_per_second = 100\n";
    Stack::start(tag, rules, |c, _| {
        c.workers = 1;
        c.upstream_timeout_ms = 10_000;
        c.upstream_extra = upstream_extra.into();
        c.extra = "[default_rule]\ncapacity = 100\nrefill_per_second = 100\n".into();
    })
}

#[test]
fn fresh_keys_cannot_take_every_upstream_connection() {
    let s = bounded_stack("fresh-keys", "max_connections_without_rule = 3");
    let flood = concurrent(s.gw.addr, "/slow?ms=2000", 6, |i| format!("fresh{i}"));
    // Three are refused at once, before any decision.
    let refused = next_statuses(&flood, 3, Duration::from_secs(5));
    assert_eq!(refused, vec![429, 429, 429]);
    // While the other three hold their connections, a tenant with a rule
    // is served at once.
    acme_is_served_at_once(s.gw.addr);
    let served = next_statuses(&flood, 3, Duration::from_secs(10));
    assert_eq!(served, vec![200, 200, 200]);
}

#[test]
fn one_tenant_cannot_take_every_upstream_connection() {
    let s = bounded_stack("one-tenant", "max_connections_per_tenant = 2");
    let busy = concurrent(s.gw.addr, "/slow?ms=2000", 3, |_| "acme".to_owned());
    let first = busy.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(first, 429, "the third request of acme is refused at once");
    assert_eq!(quick_get(s.gw.addr, "beta").status, 200);
    let refused = quick_get(s.gw.addr, "acme");
    assert_eq!(refused.status, 429);
    assert_eq!(refused.json()["error"], "too_many_in_flight");
    assert_eq!(refused.header("retry-after"), Some("1"));
    for _ in 0..2 {
        assert_eq!(busy.recv_timeout(Duration::from_secs(10)).unwrap(), 200);
    }
}

#[test]
fn a_small_pool_keeps_half_its_connections_for_tenants_with_a_rule() {
    // Eight upstream connections and the default in-flight bounds (64 per
    // tenant, 128 without a rule), which are larger than the pool: each
    // is held to half of it.
    let s = bounded_stack("small-pool", "max_connections_per_worker = 8");
    let flood = concurrent(s.gw.addr, "/slow?ms=3000", 40, |i| format!("fresh{i}"));
    let refused = next_statuses(&flood, 36, Duration::from_secs(5));
    assert!(refused.iter().all(|&s| s == 429), "{refused:?}");
    acme_is_served_at_once(s.gw.addr);
    let served = next_statuses(&flood, 4, Duration::from_secs(10));
    assert_eq!(served, vec![200; 4]);
}

/// Regression: a client that closed its socket before the answer came
/// freed its in-flight slot while the upstream kept working on the
/// request, so batches of abandoned requests held several times the cap
/// at the upstream.
#[test]
fn abandoned_requests_keep_their_slots_until_the_upstream_answers() {
    let s = bounded_stack(
        "abandoned",
        "max_connections_per_tenant = 2\nmax_connections_without_rule = 3",
    );
    for batch in 0..5 {
        // Six requests of acme (cap 2) and six with fresh keys (cap 3),
        // each socket closed 300 ms after its request went out.
        let sockets: Vec<TcpStream> = (0..12)
            .map(|i| {
                let key = if i % 2 == 0 {
                    "acme".to_owned()
                } else {
                    format!("fresh-{batch}-{i}")
                };
                let mut socket = TcpStream::connect(s.gw.addr).unwrap();
                write!(
                    socket,
                    "GET /slow?ms=1500 HTTP/1.1\r\nHost: gw\r\nX-Api-Key: {key}\r\n\r\n"
                )
                .unwrap();
                socket
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        drop(sockets);
    }
    let most = s.up.most_slow_at_once();
    assert!(
        (2..=5).contains(&most),
        "the upstream worked on {most} requests at once; the caps allow 2 + 3"
    );
    // Once the upstream has answered them, the slots are free again.
    assert!(
        wait_until(Duration::from_secs(5), || s.up.slow_now() == 0),
        "the upstream still works on {} requests",
        s.up.slow_now()
    );
    assert_eq!(quick_get(s.gw.addr, "acme").status, 200);
}
