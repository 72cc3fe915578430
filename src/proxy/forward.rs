//! Forwarding an admitted request to its upstream and streaming the answer.
//!
//! Owns the upstream HTTP client (one pooled `awc` client per worker, since
//! `awc` is single-threaded), hop-by-hop header removal in both directions,
//! `X-Forwarded-*`, and upstream timeouts. Bodies are streamed in both
//! directions, never buffered; a known `Content-Length` is kept.

use std::fmt::Write as _;
use std::net::IpAddr;

use actix_web::body::SizedStream;
use actix_web::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use actix_web::http::{Method, StatusCode};
use actix_web::{HttpRequest, HttpResponse, HttpResponseBuilder, web};
use awc::error::{ConnectError, SendRequestError};

use super::error::ProxyError;
use crate::config::{RouteSpec, UpstreamSettings};

/// Headers that describe one hop and are never forwarded.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// `X-Forwarded-For`.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// `X-Forwarded-Proto`.
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// `X-Forwarded-Host`.
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// One worker's pooled upstream client.
pub struct Forwarder {
    /// Keeps connections alive per upstream; follows no redirects and adds
    /// no headers of its own.
    client: awc::Client,
}

impl Forwarder {
    /// A client with the configured pool size and timeouts.
    pub fn new(settings: &UpstreamSettings) -> Self {
        let connector = awc::Connector::new()
            .timeout(settings.connect_timeout)
            .limit(settings.max_connections_per_worker);
        let client = awc::Client::builder()
            .connector(connector)
            .timeout(settings.timeout)
            .disable_redirects()
            .no_default_headers()
            .finish();
        Self { client }
    }

    /// Sends `req` with its streamed `payload` to `route`'s upstream and
    /// streams the answer back; `decorate` adds gateway headers.
    ///
    /// # Errors
    /// [`ProxyError::UpstreamUnreachable`] or [`ProxyError::UpstreamTimeout`].
    pub async fn forward(
        &self,
        req: &HttpRequest,
        payload: web::Payload,
        route: &RouteSpec,
        decorate: impl FnOnce(&mut HttpResponseBuilder),
    ) -> Result<HttpResponse, ProxyError> {
        let path = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
        let (origin, base) = (&route.upstream_origin, &route.upstream_base_path);
        let mut url = String::with_capacity(origin.len() + base.len() + path.len());
        url.push_str(origin);
        url.push_str(base);
        url.push_str(path);
        // no_decompress: pass bodies through untouched and add no
        // Accept-Encoding of our own.
        let mut upstream = self
            .client
            .request(req.method().clone(), url)
            .no_decompress();
        copy_end_to_end(req.headers(), upstream.headers_mut());
        add_forwarded(req, upstream.headers_mut());

        let send = match request_body_length(req.headers()) {
            BodyLength::None => upstream.send(),
            BodyLength::Sized(len) => upstream.send_body(SizedStream::new(len, payload)),
            BodyLength::Chunked => upstream.send_stream(payload),
        };
        let response = send.await.map_err(classify)?;

        let status = response.status();
        let mut builder = HttpResponse::build(status);
        let listed = connection_tokens(response.headers());
        for (name, value) in response.headers() {
            if !is_hop_by_hop(name, &listed) && name != header::CONTENT_LENGTH {
                builder.append_header((name.clone(), value.clone()));
            }
        }
        decorate(&mut builder);
        let bodiless = status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        // A HEAD answer keeps the upstream's Content-Length; actix writes
        // no body for HEAD, and the upstream sent none.
        Ok(match response_length(response.headers()) {
            _ if bodiless => builder.finish(),
            Some(len) => builder.body(SizedStream::new(len, response)),
            None if req.method() == Method::HEAD => builder.finish(),
            None => builder.streaming(response),
        })
    }
}

/// How the client framed its request body.
enum BodyLength {
    /// No body at all.
    None,
    /// `Content-Length` bytes.
    Sized(u64),
    /// Chunked transfer encoding: length unknown.
    Chunked,
}

fn request_body_length(headers: &HeaderMap) -> BodyLength {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        BodyLength::Chunked
    } else {
        match content_length(headers) {
            Some(len) => BodyLength::Sized(len),
            None => BodyLength::None,
        }
    }
}

fn response_length(headers: &HeaderMap) -> Option<u64> {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        None
    } else {
        content_length(headers)
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The header names a message's `Connection` header lists (hop-by-hop for
/// that message), read once per message.
fn connection_tokens(headers: &HeaderMap) -> Vec<&str> {
    headers
        .get_all(header::CONNECTION)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|list| list.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

/// Whether `name` applies to one hop only: a fixed hop-by-hop header or one
/// of the message's `listed` [`connection_tokens`].
fn is_hop_by_hop(name: &HeaderName, listed: &[&str]) -> bool {
    HOP_BY_HOP.contains(name) || listed.iter().any(|t| t.eq_ignore_ascii_case(name.as_str()))
}

/// Copies the client's end-to-end headers. `Host` is left to the client
/// library (the upstream's authority) and `Content-Length` to the body.
fn copy_end_to_end(from: &HeaderMap, to: &mut HeaderMap) {
    let listed = connection_tokens(from);
    for (name, value) in from {
        if !is_hop_by_hop(name, &listed) && name != header::HOST && name != header::CONTENT_LENGTH {
            to.append(name.clone(), value.clone());
        }
    }
}

/// Adds `X-Forwarded-For` (appending the peer), `-Proto` and `-Host`.
fn add_forwarded(req: &HttpRequest, to: &mut HeaderMap) {
    if let Some(peer) = req.peer_addr() {
        // Every earlier hop, from however many header lines, then the peer.
        let mut chain = String::with_capacity(48);
        for earlier in req
            .headers()
            .get_all(&X_FORWARDED_FOR)
            .filter_map(|v| v.to_str().ok())
        {
            chain.push_str(earlier);
            chain.push_str(", ");
        }
        push_ip(&mut chain, peer.ip());
        if let Ok(value) = HeaderValue::try_from(chain) {
            to.insert(X_FORWARDED_FOR, value);
        }
    }
    to.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    if let Some(host) = req.headers().get(header::HOST) {
        to.insert(X_FORWARDED_HOST, host.clone());
    }
}

/// Appends `ip` in its usual text form (IPv4 without the formatter, which
/// costs more than the rest of the header work of a request).
fn push_ip(out: &mut String, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            let mut digits = itoa::Buffer::new();
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                out.push_str(digits.format(octet));
            }
        }
        IpAddr::V6(v6) => {
            // unwrap-free: writing into a String cannot fail.
            let _ = write!(out, "{v6}");
        }
    }
}

/// Maps a client failure to 502 or 504.
fn classify(e: SendRequestError) -> ProxyError {
    match e {
        SendRequestError::Timeout | SendRequestError::Connect(ConnectError::Timeout) => {
            ProxyError::UpstreamTimeout
        }
        other => {
            tracing::debug!(error = %other, "Upstream request failed.");
            ProxyError::UpstreamUnreachable(other)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_connection_listed_ones_are_dropped() {
        let mut from = HeaderMap::new();
        from.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        from.insert(
            HeaderName::from_static("x-secret"),
            HeaderValue::from_static("1"),
        );
        from.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        from.insert(header::HOST, HeaderValue::from_static("gateway"));
        from.insert(
            HeaderName::from_static("x-api-key"),
            HeaderValue::from_static("t"),
        );
        from.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
        let mut to = HeaderMap::new();
        copy_end_to_end(&from, &mut to);
        let mut names: Vec<_> = to.keys().map(|k| k.as_str().to_owned()).collect();
        names.sort();
        assert_eq!(names, vec!["accept", "x-api-key"]);
    }
}
