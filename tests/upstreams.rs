//! Forwarding to upstreams nobody here wrote: a real nginx and a real
//! Caddy serving files, with curl as the client keeping its connection
//! alive. Each server answers as servers do in the field: bodies with a
//! length and compressed bodies in chunks, `HEAD`, `304 Not Modified`,
//! connections it closes after a few requests (nginx's
//! `keepalive_requests`), and rate-limit fields of its own. The server
//! echoes what it received, so the test sees the request the upstream
//! got: exactly the limited key, the client's address in
//! `X-Forwarded-For`, and no field that the client's `Connection` listed.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::peers::{Listening, peer};
use common::{Stack, TempDir, output_from};

/// Requests each client connection makes in a row.
const IN_A_ROW: usize = 12;

/// The served files: an incompressible binary and a compressible text,
/// both larger than one read of a socket.
fn serve_files(dir: &TempDir) -> (Vec<u8>, String) {
    let mut state = 0x2545_f491_u32;
    let binary: Vec<u8> = (0..300 * 1024)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state.to_le_bytes()[0]
        })
        .collect();
    std::fs::write(dir.0.join("big.bin"), &binary).unwrap();
    let text: String = (0..4000)
        .map(|i| format!("line {i} of a page that compresses well\n"))
        .collect();
    dir.file("page.txt", &text);
    (binary, text)
}

/// A real nginx serving `root`, closing each connection after three
/// requests, adding an `X-RateLimit-Remaining` of its own and echoing the
/// request's fields it was given.
fn start_nginx(root: &Path) -> Listening {
    output_from("nginx-light", Command::new("nginx").arg("-v"));
    Listening::start("nginx", Duration::from_secs(10), |port, dir| {
        let prefix = dir.0.display();
        let conf = dir.file(
            "nginx.conf",
            &format!(
                "daemon off;\nmaster_process off;\nerror_log {prefix}/error.log warn;\n\
                 pid {prefix}/nginx.pid;\nevents {{ worker_connections 64; }}\n\
                 http {{\n  access_log off;\n  client_body_temp_path {prefix};\n\
                   types {{ text/plain txt; application/octet-stream bin; }}\n\
                   gzip on;\n  gzip_min_length 0;\n  gzip_types text/plain;\n\
                   keepalive_requests 3;\n\
                   server {{\n    listen 127.0.0.1:{port};\n    root {};\n\
                     add_header X-RateLimit-Remaining 123456 always;\n\
                     add_header X-Seen-Key $http_x_api_key always;\n\
                     add_header X-Seen-For $http_x_forwarded_for always;\n\
                     add_header X-Seen-Secret $http_x_secret always;\n  }}\n}}\n",
                root.display()
            ),
        );
        let mut command = Command::new("nginx");
        command.args(["-p", &prefix.to_string(), "-c"]).arg(conf);
        command
    })
}

/// A real Caddy serving `root` with compression, adding an
/// `X-RateLimit-Remaining` of its own and echoing the request's fields it
/// was given.
fn start_caddy(root: &Path) -> Listening {
    let caddy = peer("caddy");
    Listening::start("caddy", Duration::from_secs(10), |port, dir| {
        let config = dir.file(
            "Caddyfile",
            &format!(
                "{{\n  admin off\n  auto_https off\n}}\n\
                 http://127.0.0.1:{port} {{\n  bind 127.0.0.1\n  root * {}\n  encode gzip\n\
                   header X-RateLimit-Remaining 123456\n\
                   header X-Seen-Key {{header.X-Api-Key}}\n\
                   header X-Seen-For {{header.X-Forwarded-For}}\n\
                   header X-Seen-Secret {{header.X-Secret}}\n  file_server\n}}\n",
                root.display()
            ),
        );
        let mut command = Command::new(&caddy);
        command
            .args(["run", "--adapter", "caddyfile", "--config"])
            .arg(config)
            .env("HOME", &dir.0)
            .env("XDG_DATA_HOME", &dir.0)
            .env("XDG_CONFIG_HOME", &dir.0);
        command
    })
}

/// A gateway whose one route forwards everything to `upstream`, with a
/// limit no request here reaches; deciding through Redis, or alone when
/// `local_only` (its requests then go upstream in the worker's next turn).
fn gateway_before(tag: &str, upstream: SocketAddr, local_only: bool) -> Stack {
    let rules = "[[rule]]\ntenant = \"acme\"\nroute = \"files\"\ncapacity = 1000\n\
                 refill_per_second = 1000\n";
    Stack::start(tag, rules, |c, _| {
        if local_only {
            c.redis_url.clear();
        }
        c.routes = format!(
            "[[routes]]\nid = \"files\"\npath_prefix = \"/\"\nupstream = \"http://{upstream}\"\n"
        );
    })
}

/// One curl run as tenant `acme` fetching each `(args, url)` in turn on
/// one connection: per fetch its status, the bytes it received and the
/// connections it opened, then everything else it printed.
fn curl_in_a_row(fetches: &[(&[&str], String)]) -> (Vec<(u16, usize, u32)>, String) {
    let mut command = Command::new("curl");
    for (i, (args, url)) in fetches.iter().enumerate() {
        if i > 0 {
            command.arg("--next");
        }
        command
            .args(["-s", "-H", "X-Api-Key: acme", "-w"])
            .arg("\n@@ %{http_code} %{size_download} %{num_connects}\n")
            .args(*args)
            .arg(url);
    }
    let out = output_from("curl", &mut command);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut rest = String::new();
    let mut each = Vec::new();
    for line in text.lines() {
        match line.strip_prefix("@@ ") {
            Some(stats) => {
                let n: Vec<&str> = stats.split(' ').collect();
                each.push((
                    n[0].parse().unwrap(),
                    n[1].parse().unwrap(),
                    n[2].parse().unwrap(),
                ));
            }
            None => {
                rest.push_str(line);
                rest.push('\n');
            }
        }
    }
    assert_eq!(each.len(), fetches.len(), "curl made every fetch: {text}");
    (each, rest)
}

/// The value of the header `name` in a head that curl dumped.
fn dumped<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Everything a client should see through the gateway at `gw` in front
/// of a server of `files`.
fn forwards_what_the_server_says(gw: SocketAddr, dir: &TempDir, files: &(Vec<u8>, String)) {
    let (binary, text) = files;
    let url = |path: &str| format!("http://{gw}{path}");

    // Bodies with a length, one connection from the client, the
    // server closing its side every few requests.
    let outputs: Vec<String> = (0..IN_A_ROW)
        .map(|i| dir.0.join(format!("big-{i}")).display().to_string())
        .collect();
    let fetches: Vec<_> = outputs
        .iter()
        .map(|out| (["-o", out.as_str()], url("/big.bin")))
        .collect();
    let fetches: Vec<(&[&str], String)> = fetches
        .iter()
        .map(|(args, url)| (&args[..], url.clone()))
        .collect();
    let (each, _) = curl_in_a_row(&fetches);
    for (i, (fetch, out)) in each.iter().zip(&outputs).enumerate() {
        let connects = u32::from(i == 0);
        assert_eq!(*fetch, (200, binary.len(), connects), "fetch {i}");
        assert!(std::fs::read(out).unwrap() == *binary, "body {i}");
    }

    // A compressed body in chunks, decoded by curl as sent.
    let (each, head_and_body) = curl_in_a_row(&[(&["--compressed", "-D", "-"], url("/page.txt"))]);
    assert_eq!(each[0].0, 200);
    let (head, body) = head_and_body.split_once("\n\n").unwrap();
    assert_eq!(dumped(head, "content-encoding"), Some("gzip"), "{head}");
    assert_eq!(dumped(head, "transfer-encoding"), Some("chunked"), "{head}");
    assert_eq!(dumped(head, "content-length"), None, "{head}");
    assert_eq!(body.trim_end(), text.trim_end());

    // The request the server got, and the gateway's fields over the
    // server's own.
    let secret = ["-o", "/dev/null", "-D", "-", "-H", "Connection: X-Secret"];
    let secret = [&secret[..], &["-H", "X-Secret: hidden"]].concat();
    let (_, head) = curl_in_a_row(&[(&secret, url("/page.txt"))]);
    assert_eq!(dumped(&head, "x-seen-key"), Some("acme"), "{head}");
    assert_eq!(dumped(&head, "x-seen-for"), Some("127.0.0.1"), "{head}");
    assert!(
        dumped(&head, "x-seen-secret").is_none_or(str::is_empty),
        "a field Connection lists stays on the client's hop: {head}"
    );
    let remaining: Vec<&str> = head
        .lines()
        .filter(|l| l.to_ascii_lowercase().starts_with("x-ratelimit-remaining:"))
        .collect();
    assert_eq!(remaining.len(), 1, "{head}");
    assert_ne!(
        dumped(&head, "x-ratelimit-remaining"),
        Some("123456"),
        "{head}"
    );
    assert!(dumped(&head, "ratelimit").is_some(), "{head}");

    // HEAD, a validator's 304, then a body again, on one connection.
    let quiet: &[&str] = &["-o", "/dev/null"];
    let (_, head) = curl_in_a_row(&[(&["-o", "/dev/null", "-D", "-"], url("/big.bin"))]);
    let etag = format!("If-None-Match: {}", dumped(&head, "etag").unwrap());
    let (each, _) = curl_in_a_row(&[
        (&["-o", "/dev/null", "-I"], url("/big.bin")),
        (&["-o", "/dev/null", "-H", &etag], url("/big.bin")),
        (quiet, url("/big.bin")),
    ]);
    assert_eq!(
        each,
        vec![(200, 0, 1), (304, 0, 0), (200, binary.len(), 0)],
        "HEAD, 304 and a body on one connection"
    );
}

/// Serves the files with the server `start` starts, puts a gateway in
/// front of it (local-only when `local_only`) and checks what a client
/// sees.
fn through_a_gateway(tag: &str, start: impl FnOnce(&Path) -> Listening, local_only: bool) {
    let dir = TempDir::new(tag);
    let files = serve_files(&dir);
    let server = start(&dir.0);
    let stack = gateway_before(tag, server.addr, local_only);
    forwards_what_the_server_says(stack.gw.addr, &dir, &files);
}

#[test]
fn a_real_nginx_upstream_is_forwarded_as_it_answers() {
    through_a_gateway("up-nginx", start_nginx, false);
}

/// The same through a local-only gateway, whose requests wait a turn of
/// its worker after their decision before they go upstream.
#[test]
fn a_real_nginx_upstream_is_forwarded_by_a_local_only_gateway() {
    through_a_gateway("up-nginx-local", start_nginx, true);
}

#[test]
fn a_real_caddy_upstream_is_forwarded_as_it_answers() {
    through_a_gateway("up-caddy", start_caddy, false);
}
