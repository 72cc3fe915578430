//! TLS on the proxy listener (HTTP/1.1 and HTTP/2 by ALPN, certificate
//! reload without dropping connections, the handshake deadline) and to
//! `https://` upstreams (verification, `upstream.ca_file`, SNI), with
//! certificates made by `openssl` and real clients (curl, rustls).

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::certs::{make_ca, make_leaf};
use common::{Gateway, KillOnDrop, Stack, TempDir, spawn_from, wait_until};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

/// `toml` with the listener's TLS files and `client.header_timeout_ms`
/// (which also ends idle kept-alive connections).
fn tls_server(toml: &str, cert: &Path, key: &Path, header_timeout_ms: u32) -> String {
    toml.replacen(
        "shutdown_timeout_seconds = 1\n",
        &format!(
            "shutdown_timeout_seconds = 1\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n\
             tls_reload_seconds = 1\n[client]\nheader_timeout_ms = {header_timeout_ms}\n",
            cert.display(),
            key.display()
        ),
        1,
    )
}

/// `curl` over TLS trusting `ca` with `args`, to `path` on `addr` named
/// `localhost`: the HTTP version and status, then the body.
fn curl(ca: &Path, args: &[&str], addr: SocketAddr, path: &str) -> (String, String) {
    let resolve = format!("localhost:{}:127.0.0.1", addr.port());
    let ca = ca.to_str().unwrap();
    let mut all = vec!["--cacert", ca, "--resolve", &resolve];
    all.extend_from_slice(args);
    common::curl(&all, &format!("https://localhost:{}{path}", addr.port()))
}

/// A kept-alive HTTP/1.1 connection over TLS, trusting `ca`.
struct TlsClient(rustls::StreamOwned<rustls::ClientConnection, TcpStream>);

impl TlsClient {
    fn connect(ca: &Path, addr: SocketAddr) -> Self {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(ca).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let name = ServerName::try_from("localhost").unwrap();
        let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let sock = TcpStream::connect(addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut stream = rustls::StreamOwned::new(conn, sock);
        while stream.conn.is_handshaking() {
            stream.conn.complete_io(&mut stream.sock).unwrap();
        }
        Self(stream)
    }

    /// GETs `path`: the status and body.
    fn get(&mut self, path: &str) -> (u16, String) {
        write!(
            self.0,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nX-Api-Key: acme\r\n\r\n"
        )
        .unwrap();
        let mut got = Vec::new();
        let mut byte = [0u8; 1];
        while !got.ends_with(b"\r\n\r\n") {
            assert_eq!(self.0.read(&mut byte).unwrap(), 1, "the connection ended");
            got.push(byte[0]);
        }
        let head = String::from_utf8(got).unwrap();
        let status = head[9..12].parse().unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().unwrap())
            })
            .expect("a content-length");
        let mut body = vec![0u8; length];
        self.0.read_exact(&mut body).unwrap();
        (status, String::from_utf8(body).unwrap())
    }

    /// The certificate the server presented.
    fn peer_cert(&self) -> Vec<u8> {
        self.0.conn.peer_certificates().unwrap()[0].to_vec()
    }
}

/// The first certificate in the PEM file `path`, as DER.
fn der(path: &Path) -> Vec<u8> {
    CertificateDer::from_pem_file(path).unwrap().to_vec()
}

#[test]
fn the_listener_speaks_tls_with_http2_and_http11_and_reloads_its_certificate() {
    let s = Stack::start("tls", "", |c, _| {
        c.extra = "[default_rule]\ncapacity = 100000\nrefill_per_second = 100000\n".into();
    });
    let dir = TempDir::new("tls-certs");
    let ca = make_ca(&dir.0);
    let (first_cert, first_key) = make_leaf(&dir.0, "first", "localhost");
    let (cert, key) = (dir.0.join("live.crt"), dir.0.join("live.key"));
    std::fs::copy(&first_cert, &cert).unwrap();
    std::fs::copy(&first_key, &key).unwrap();
    let gw = Gateway::start_toml(&tls_server(&s.config.toml(), &cert, &key, 30_000));

    let (seen, body) = curl(&ca, &["--http2"], gw.addr, "/thing");
    assert_eq!(seen, "2 200", "HTTP/2 by ALPN: {body}");
    let echoed: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(echoed["headers"]["x-forwarded-proto"], "https");
    assert_eq!(echoed["headers"]["x-api-key"], "acme");
    let (seen, body) = curl(&ca, &["--http1.1"], gw.addr, "/thing");
    assert_eq!(seen, "1.1 200", "{body}");
    let (seen, _) = curl(&ca, &["--http2", "-I"], gw.addr, "/thing");
    assert_eq!(seen, "2 200");
    // Cleartext on the TLS listener gets no HTTP answer.
    let plain = std::process::Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            &gw.url("/thing"),
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&plain.stdout), "000");

    // A connection open across the reload keeps working.
    let mut kept = TlsClient::connect(&ca, gw.addr);
    assert_eq!(kept.get("/a").0, 200);
    assert_eq!(kept.peer_cert(), der(&first_cert));

    // The new pair lands one file at a time (key first: for a moment the
    // files do not match), the certificate also half-written first.
    let (second_cert, second_key) = make_leaf(&dir.0, "second", "localhost");
    std::fs::copy(&second_key, &key).unwrap();
    let pem = std::fs::read(&second_cert).unwrap();
    std::fs::write(&cert, &pem[..pem.len() / 2]).unwrap();
    assert!(
        !wait_until(Duration::from_millis(2500), || {
            TlsClient::connect(&ca, gw.addr).get("/b").0 != 200 || kept.get("/k").0 != 200
        }),
        "new connections kept being served while the files did not load"
    );
    assert_eq!(
        TlsClient::connect(&ca, gw.addr).peer_cert(),
        der(&first_cert),
        "a pair that does not load is not installed"
    );
    std::fs::write(&cert, &pem).unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || {
            assert_eq!(kept.get("/k").0, 200);
            TlsClient::connect(&ca, gw.addr).peer_cert() == der(&second_cert)
        }),
        "new connections get the new certificate"
    );
    let (status, body) = kept.get("/c");
    assert_eq!(status, 200, "{body}");
    assert_eq!(kept.peer_cert(), der(&first_cert));
    let (seen, _) = curl(&ca, &["--http2"], gw.addr, "/thing");
    assert_eq!(seen, "2 200");
}

#[test]
fn a_client_that_stalls_its_handshake_is_closed() {
    let s = Stack::start("tls-stall", "", |_, _| {});
    let dir = TempDir::new("tls-stall-certs");
    make_ca(&dir.0);
    let (cert, key) = make_leaf(&dir.0, "leaf", "localhost");
    let gw = Gateway::start_toml(&tls_server(&s.config.toml(), &cert, &key, 500));
    let mut silent = TcpStream::connect(gw.addr).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 16];
    // header_timeout_ms = 500: closed long before the 5 s read timeout.
    assert_eq!(silent.read(&mut buf).expect("closed, not timed out"), 0);

    // Done with the handshake, then silent: the first request's deadline.
    let ca = dir.0.join("ca.crt");
    let mut quiet = TlsClient::connect(&ca, gw.addr);
    let mut byte = [0u8; 1];
    match quiet.0.read(&mut byte) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
        other => panic!("the connection stayed open: {other:?}"),
    }
}

/// `openssl s_server -www` on a free port: `default` for clients that
/// send no SNI (or another name), `named` for those that ask for
/// `localhost`.
struct TlsUpstream {
    _child: KillOnDrop,
    port: u16,
}

impl TlsUpstream {
    fn start(dir: &Path, default: (&Path, &Path), named: (&Path, &Path)) -> Self {
        // Port 0: s_server binds a free port itself and prints it, so no
        // other process can take it in between.
        let mut child = spawn_from(
            "openssl",
            Command::new("openssl")
                .args(["s_server", "-www", "-accept", "127.0.0.1:0"])
                .arg("-cert")
                .arg(default.0)
                .arg("-key")
                .arg(default.1)
                .args(["-servername", "localhost", "-cert2"])
                .arg(named.0)
                .arg("-key2")
                .arg(named.1)
                .current_dir(dir)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null()),
        );
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let port = lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|line| line.strip_prefix("ACCEPT 127.0.0.1:")?.trim().parse().ok())
            .expect("openssl s_server says where it listens");
        // What it prints per connection is read, so it never blocks on a
        // full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Self {
            _child: KillOnDrop(child),
            port,
        }
    }
}

#[test]
fn https_upstreams_are_verified_by_name_sent_by_sni() {
    let dir = TempDir::new("tls-upstream");
    let ca = make_ca(&dir.0);
    let (good, good_key) = make_leaf(&dir.0, "good", "localhost");
    let (other, other_key) = make_leaf(&dir.0, "other", "other.example");
    let up = TlsUpstream::start(&dir.0, (&other, &other_key), (&good, &good_key));
    let route = |host: &str| {
        format!(
            "[[routes]]\nid = \"api\"\npath_prefix = \"/\"\nupstream = \"https://{host}:{}\"\n",
            up.port
        )
    };
    let get = |gw: &Gateway| {
        let res = common::raw_http(
            gw.addr,
            "GET / HTTP/1.1\r\nHost: a\r\nX-Api-Key: acme\r\nConnection: close\r\n\r\n",
        );
        (res.status, res.body)
    };

    // Trusting the test CA, with SNI naming `localhost`: the server picks
    // the certificate for that name, and it verifies.
    let s = Stack::start("tls-up", "", |c, _| {
        c.routes = route("localhost");
        c.upstream_extra = format!("ca_file = \"{}\"\n", ca.display());
    });
    let (status, body) = get(&s.gw);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("s_server"), "the upstream's page: {body}");

    // The system's roots do not hold the test CA: refused, 502.
    let s = Stack::start("tls-up-system", "", |c, _| c.routes = route("localhost"));
    assert_eq!(get(&s.gw).0, 502);

    // By address there is no SNI: the server's default certificate (for
    // another name) does not verify for 127.0.0.1's name either.
    let s = Stack::start("tls-up-ip", "", |c, _| {
        c.routes = route("127.0.0.1");
        c.upstream_extra = format!("ca_file = \"{}\"\n", ca.display());
    });
    assert_eq!(get(&s.gw).0, 502);
}
