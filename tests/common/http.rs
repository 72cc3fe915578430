//! HTTP clients for the tests: raw requests on a socket, awc helpers,
//! curl, and reading the RateLimit fields.

use std::collections::BTreeMap;
use std::io::{Read, Write};
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

/// [`get`] of `url` as `tenant`, `n` times one after another: each
/// status and `X-RateLimit-Remaining`.
pub async fn answers(url: &str, tenant: &str, n: usize) -> Vec<(u16, Option<String>)> {
    let mut seen = Vec::new();
    for _ in 0..n {
        seen.push(get(url, Some(tenant)).await);
    }
    seen
}

/// `GET url` as `tenant` (its `X-Api-Key`) on `c`, a client kept across
/// requests or a fresh one; the gateway must answer.
pub async fn get_as(
    c: &awc::Client,
    url: &str,
    tenant: &str,
) -> awc::ClientResponse<
    impl futures_util::Stream<Item = Result<actix_web::web::Bytes, awc::error::PayloadError>>
    + Unpin
    + use<>,
> {
    c.get(url)
        .insert_header(("x-api-key", tenant))
        .send()
        .await
        .expect("gateway answers")
}

/// The status of a GET of `url` as `tenant` on a client kept across
/// requests (so the connection is reused); `None` when nothing answered.
pub async fn status_as(c: &awc::Client, url: &str, tenant: &str) -> Option<u16> {
    let res = c.get(url).insert_header(("x-api-key", tenant)).send().await;
    res.ok().map(|r| r.status().as_u16())
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
    let out = output_from(
        "curl",
        Command::new("curl")
            .args([
                "-s",
                "-w",
                "\n%{http_version} %{http_code}",
                "-H",
                "X-Api-Key: acme",
            ])
            .args(args)
            .arg(url),
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, last) = text.rsplit_once('\n').unwrap_or(("", &text));
    (last.to_owned(), body.to_owned())
}

/// Status of a plain blocking `GET path` (no client library, for use
/// outside a runtime).
pub fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
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
