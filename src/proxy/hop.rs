//! Headers between the client's hop and the upstream's.
//!
//! Owns which headers travel end to end (hop-by-hop ones and those a
//! message's `Connection` header lists never do, in either direction),
//! `X-Forwarded-*`, and the identity the upstream receives: `X-Api-Key` is
//! always exactly the key that was limited, set by the gateway, so no
//! `Connection` header can remove it and no second spelling can ride
//! along.
//!
//! actix-web speaks `http` 0.2 types and hyper `http` 1.x ones, so names
//! and values cross over as bytes.

use std::fmt::Write as _;
use std::net::IpAddr;

use actix_web::HttpRequest;
use actix_web::http::header as ax;
use hyper::header as hy;

use crate::key::TenantId;

/// Headers that describe one hop and are never forwarded (lower case, as
/// both header libraries store names).
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// `X-Forwarded-For` as the client sent it (looked up by name, not by a
/// string, which actix-web would turn into a new header name every time).
const CLIENT_X_FORWARDED_FOR: ax::HeaderName = ax::HeaderName::from_static("x-forwarded-for");
/// `X-Forwarded-For`.
const X_FORWARDED_FOR: hy::HeaderName = hy::HeaderName::from_static("x-forwarded-for");
/// `X-Forwarded-Proto`.
const X_FORWARDED_PROTO: hy::HeaderName = hy::HeaderName::from_static("x-forwarded-proto");
/// `X-Forwarded-Host`.
const X_FORWARDED_HOST: hy::HeaderName = hy::HeaderName::from_static("x-forwarded-host");
/// `X-Api-Key`, as sent upstream.
const UPSTREAM_API_KEY: hy::HeaderName = hy::HeaderName::from_static("x-api-key");

/// The header names a message's `Connection` header lists (hop-by-hop for
/// that message), read once per message from its `Connection` values.
fn connection_tokens<'a, V>(values: impl Iterator<Item = &'a V>) -> Vec<&'a str>
where
    V: AsRef<[u8]> + 'a,
{
    values
        .filter_map(|v| std::str::from_utf8(v.as_ref()).ok())
        .flat_map(|list| list.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

/// Whether the (lower-case) header `name` travels end to end: neither a
/// fixed hop-by-hop header nor one of the message's `listed`
/// [`connection_tokens`].
fn is_end_to_end(name: &str, listed: &[&str]) -> bool {
    !HOP_BY_HOP.contains(&name) && !listed.iter().any(|t| t.eq_ignore_ascii_case(name))
}

/// Copies the client's end-to-end headers and sets `X-Api-Key` to
/// `tenant`. `Host` is left to the caller (the upstream's authority),
/// `Content-Length` to the body, and the client's own `X-Api-Key` is
/// replaced, never copied.
pub(super) fn copy_request_headers(
    from: &ax::HeaderMap,
    tenant: &TenantId,
    to: &mut hy::HeaderMap,
) {
    let listed = connection_tokens(from.get_all(ax::CONNECTION));
    for (name, value) in from {
        if is_end_to_end(name.as_str(), &listed)
            && name != ax::HOST
            && name != ax::CONTENT_LENGTH
            && name != super::API_KEY
            && let (Ok(name), Ok(value)) = (
                hy::HeaderName::from_bytes(name.as_str().as_bytes()),
                hy::HeaderValue::from_bytes(value.as_bytes()),
            )
        {
            to.append(name, value);
        }
    }
    // A validated tenant id is a valid header value.
    if let Ok(key) = hy::HeaderValue::from_str(tenant.as_str()) {
        to.insert(UPSTREAM_API_KEY, key);
    }
}

/// Copies the upstream's end-to-end response headers (without
/// `Content-Length`, which the body carries) with `add`.
pub(super) fn copy_response_headers(
    from: &hy::HeaderMap,
    mut add: impl FnMut(ax::HeaderName, ax::HeaderValue),
) {
    let listed = connection_tokens(from.get_all(hy::CONNECTION).iter());
    for (name, value) in from {
        if is_end_to_end(name.as_str(), &listed)
            && name != hy::CONTENT_LENGTH
            && let (Ok(name), Ok(value)) = (
                ax::HeaderName::from_bytes(name.as_str().as_bytes()),
                ax::HeaderValue::from_bytes(value.as_bytes()),
            )
        {
            add(name, value);
        }
    }
}

/// Adds `X-Forwarded-For` (appending the peer), `-Proto` and `-Host`.
pub(super) fn add_forwarded(req: &HttpRequest, to: &mut hy::HeaderMap) {
    if let Some(peer) = req.peer_addr() {
        // Every earlier hop, from however many header lines, then the peer.
        let mut chain = String::with_capacity(48);
        for earlier in req
            .headers()
            .get_all(&CLIENT_X_FORWARDED_FOR)
            .filter_map(|v| v.to_str().ok())
        {
            chain.push_str(earlier);
            chain.push_str(", ");
        }
        push_ip(&mut chain, peer.ip());
        if let Ok(value) = hy::HeaderValue::try_from(chain) {
            to.insert(X_FORWARDED_FOR, value);
        }
    }
    to.insert(X_FORWARDED_PROTO, hy::HeaderValue::from_static("http"));
    if let Some(host) = req.headers().get(ax::HOST)
        && let Ok(host) = hy::HeaderValue::from_bytes(host.as_bytes())
    {
        to.insert(X_FORWARDED_HOST, host);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn client_headers(pairs: &[(&'static str, &'static str)]) -> ax::HeaderMap {
        let mut from = ax::HeaderMap::new();
        for (name, value) in pairs {
            from.append(
                ax::HeaderName::from_static(name),
                ax::HeaderValue::from_static(value),
            );
        }
        from
    }

    fn forwarded(from: &ax::HeaderMap, tenant: &str) -> hy::HeaderMap {
        let mut to = hy::HeaderMap::new();
        copy_request_headers(from, &TenantId::parse(tenant).unwrap(), &mut to);
        to
    }

    #[test]
    fn hop_by_hop_headers_and_connection_listed_ones_are_dropped() {
        let from = client_headers(&[
            ("connection", "keep-alive, x-secret"),
            ("x-secret", "1"),
            ("transfer-encoding", "chunked"),
            ("host", "gateway"),
            ("x-api-key", "t"),
            ("accept", "*/*"),
        ]);
        let to = forwarded(&from, "t");
        let mut names: Vec<_> = to.keys().map(|k| k.as_str().to_owned()).collect();
        names.sort();
        assert_eq!(names, vec!["accept", "x-api-key"]);
    }

    #[test]
    fn the_upstream_gets_exactly_the_limited_key_whatever_connection_lists() {
        let from = client_headers(&[
            ("connection", "x-api-key"),
            ("x-api-key", "alice"),
            ("x-api-key", "bob"),
        ]);
        let to = forwarded(&from, "alice");
        let keys: Vec<_> = to.get_all("x-api-key").iter().collect();
        assert_eq!(keys, vec!["alice"]);
    }

    #[test]
    fn response_headers_lose_hop_by_hop_ones_and_content_length() {
        let mut from = hy::HeaderMap::new();
        from.insert(hy::CONNECTION, hy::HeaderValue::from_static("x-hop"));
        from.insert("x-hop", hy::HeaderValue::from_static("1"));
        from.insert(hy::CONTENT_LENGTH, hy::HeaderValue::from_static("3"));
        from.insert(hy::CONTENT_TYPE, hy::HeaderValue::from_static("text/plain"));
        let mut names = Vec::new();
        copy_response_headers(&from, |name, _| names.push(name.as_str().to_owned()));
        assert_eq!(names, vec!["content-type"]);
    }
}
