//! Headers between the client's hop and the upstream's.
//!
//! Owns which headers travel end to end (hop-by-hop ones and those a
//! message's `Connection` header lists never do, in either direction),
//! `X-Forwarded-*`, and the identity the upstream receives: `X-Api-Key` is
//! always exactly the key that was limited, set by the gateway, so no
//! `Connection` header can remove it and no second spelling can ride
//! along. A request's headers are edited in place and travel on with it;
//! a response's are chosen field by field as its head is read.

use std::fmt::Write as _;
use std::net::IpAddr;

use hyper::header::{self as hy, HeaderMap, HeaderName, HeaderValue};

use crate::key::TenantId;

/// Headers that describe one hop and are never forwarded (lower case, as
/// header names are stored), and `Content-Length` (the body carries its
/// own length). `Connection` comes first: what it lists goes too.
static HOP_BY_HOP: [HeaderName; 10] = [
    hy::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    hy::PROXY_AUTHENTICATE,
    hy::PROXY_AUTHORIZATION,
    hy::TE,
    hy::TRAILER,
    hy::TRANSFER_ENCODING,
    hy::UPGRADE,
    hy::CONTENT_LENGTH,
];

/// `X-Forwarded-For`.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// `X-Forwarded-Proto`.
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// `X-Forwarded-Host`.
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Where `name` (lower case) is in [`HOP_BY_HOP`]: one `match` on its text, which
/// the compiler turns into a switch on the length and a comparison or
/// two, where comparing it with each entry costs ten name comparisons.
fn hop_by_hop_index(name: &str) -> Option<usize> {
    match name {
        "connection" => Some(0),
        "keep-alive" => Some(1),
        "proxy-connection" => Some(2),
        "proxy-authenticate" => Some(3),
        "proxy-authorization" => Some(4),
        "te" => Some(5),
        "trailer" => Some(6),
        "transfer-encoding" => Some(7),
        "upgrade" => Some(8),
        "content-length" => Some(9),
        _ => None,
    }
}

/// Removes what describes one hop: the headers of [`HOP_BY_HOP`] and the
/// ones the message's `Connection` header lists. One pass over the names
/// present finds them: most messages hold one or two of them, and a
/// lookup of each name that might be there costs more than the pass. The
/// tokens `Connection` lists are looked up as text: most name a
/// hop-by-hop header (`keep-alive`) or none (`close`), and only a name
/// that is present is made into one.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let mut present = [false; HOP_BY_HOP.len()];
    for name in headers.keys() {
        if let Some(i) = hop_by_hop_index(name.as_str()) {
            present[i] = true;
        }
    }
    if present[0] {
        let listed: Vec<HeaderName> = headers
            .get_all(hy::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|list| list.split(','))
            .map(str::trim)
            .filter(|token| listed_index(token).is_none() && headers.contains_key(*token))
            .filter_map(|token| HeaderName::from_bytes(token.as_bytes()).ok())
            .collect();
        for name in listed {
            headers.remove(name);
        }
    }
    for (name, present) in HOP_BY_HOP.iter().zip(present) {
        if present {
            headers.remove(name);
        }
    }
}

/// Where the header `token` names (in any case) is in [`HOP_BY_HOP`].
fn listed_index(token: &str) -> Option<usize> {
    // The longest hop-by-hop name, `proxy-authorization`, has 19 bytes.
    let mut lower = [0; 19];
    let lower = lower.get_mut(..token.len())?;
    lower.copy_from_slice(token.as_bytes());
    lower.make_ascii_lowercase();
    hop_by_hop_index(std::str::from_utf8(lower).ok()?)
}

/// Turns a client's request headers into the upstream's: hop-level ones
/// go, `X-Api-Key` becomes exactly `tenant`, `X-Forwarded-For` gains the
/// `peer`, `X-Forwarded-Host` takes the client's `Host` (which goes: the
/// caller sets the upstream's), or else the request's `authority` (an
/// HTTP/2 request's host), and `X-Forwarded-Proto` is `https` when the
/// client came over TLS (`tls`), else `http`.
pub(super) fn forwarded_headers(
    headers: &mut HeaderMap,
    (peer, tls): (IpAddr, bool),
    tenant: &TenantId,
    authority: Option<&str>,
) {
    strip_hop_by_hop(headers);
    // Every earlier hop, from however many header lines, then the peer.
    // Without earlier hops (the usual case) the buffer is the peer's exact
    // size, so it becomes the value as it is.
    let mut chain = String::new();
    for hop in headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
    {
        chain.push_str(hop);
        chain.push_str(", ");
    }
    chain.reserve_exact(ip_text_len(peer));
    push_ip(&mut chain, peer);
    if let Ok(value) = HeaderValue::try_from(chain) {
        headers.insert(X_FORWARDED_FOR, value);
    }
    let proto = if tls { "https" } else { "http" };
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    let host = headers
        .remove(hy::HOST)
        .or_else(|| authority.and_then(|a| HeaderValue::from_str(a).ok()));
    match host {
        Some(host) => headers.insert(X_FORWARDED_HOST, host),
        None => headers.remove(X_FORWARDED_HOST),
    };
    // The client's one key, when it is the limited one byte for byte,
    // stays as it is; otherwise it becomes that one. A validated tenant id
    // is a valid header value.
    let mut keys = headers.get_all(crate::proxy::API_KEY).iter();
    let kept = keys
        .next()
        .is_some_and(|key| key.as_bytes() == tenant.as_str().as_bytes())
        && keys.next().is_none();
    if !kept && let Ok(key) = HeaderValue::from_str(tenant.as_str()) {
        headers.insert(crate::proxy::API_KEY, key);
    }
}

/// Whether a response field named `name` (in any case) travels on to the
/// client, `fields` being all of the response's fields as they arrived:
/// not when it is hop-by-hop, nor when a `Connection` field lists it.
pub(super) fn travels(name: &str, fields: &[httparse::Header<'_>]) -> bool {
    listed_index(name).is_none()
        && !fields
            .iter()
            .filter(|field| field.name.eq_ignore_ascii_case("connection"))
            .filter_map(|field| std::str::from_utf8(field.value).ok())
            .flat_map(|list| list.split(','))
            .any(|token| token.trim().eq_ignore_ascii_case(name))
}

/// The length of `ip`'s text as [`push_ip`] writes it (for IPv6, at
/// most that).
fn ip_text_len(ip: IpAddr) -> usize {
    match ip {
        IpAddr::V4(v4) => {
            let digits = |o: u8| 1 + usize::from(o >= 10) + usize::from(o >= 100);
            3 + v4.octets().into_iter().map(digits).sum::<usize>()
        }
        IpAddr::V6(_) => 39,
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
    use std::net::Ipv4Addr;

    use super::*;

    fn client_headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut from = HeaderMap::new();
        for (name, value) in pairs {
            from.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        from
    }

    fn forwarded(pairs: &[(&'static str, &'static str)], tenant: &str) -> HeaderMap {
        let mut headers = client_headers(pairs);
        let peer = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7));
        forwarded_headers(
            &mut headers,
            (peer, false),
            &TenantId::parse(tenant).unwrap(),
            None,
        );
        headers
    }

    #[test]
    fn every_hop_by_hop_name_is_found_in_its_place_and_no_other() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_index(name.as_str()), Some(i), "{name}");
            let upper = name.as_str().to_ascii_uppercase();
            assert_eq!(listed_index(&upper), Some(i), "{upper}");
        }
        for name in ["host", "x-api-key", "content-type", "trailers", "upgrades"] {
            assert_eq!(hop_by_hop_index(name), None, "{name}");
            assert_eq!(listed_index(name), None, "{name}");
        }
    }

    #[test]
    fn hop_by_hop_headers_and_connection_listed_ones_are_dropped() {
        let to = forwarded(
            &[
                ("connection", "keep-alive, x-secret"),
                ("x-secret", "1"),
                ("transfer-encoding", "chunked"),
                ("content-length", "3"),
                ("host", "gateway"),
                ("x-api-key", "t"),
                ("accept", "*/*"),
            ],
            "t",
        );
        let mut names: Vec<_> = to.keys().map(|k| k.as_str().to_owned()).collect();
        names.sort();
        assert_eq!(
            names,
            vec![
                "accept",
                "x-api-key",
                "x-forwarded-for",
                "x-forwarded-host",
                "x-forwarded-proto"
            ]
        );
        assert_eq!(to["x-forwarded-host"], "gateway");
    }

    #[test]
    fn connection_tokens_are_names_in_any_case_over_every_line() {
        let mut from = HeaderMap::new();
        from.append(
            hy::CONNECTION,
            HeaderValue::from_static("Keep-Alive, X-Secret"),
        );
        from.append(
            hy::CONNECTION,
            HeaderValue::from_static(" x-other ,bad token!,"),
        );
        from.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        from.insert("x-secret", HeaderValue::from_static("1"));
        from.insert("x-other", HeaderValue::from_static("2"));
        from.insert(hy::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        strip_hop_by_hop(&mut from);
        let names: Vec<_> = from.keys().map(|k| k.as_str().to_owned()).collect();
        assert_eq!(names, vec!["content-type"]);
    }

    #[test]
    fn the_upstream_gets_exactly_the_limited_key_whatever_connection_lists() {
        let to = forwarded(
            &[
                ("connection", "x-api-key"),
                ("x-api-key", "alice"),
                ("x-api-key", "bob"),
            ],
            "alice",
        );
        let keys: Vec<_> = to.get_all("x-api-key").iter().collect();
        assert_eq!(keys, vec!["alice"]);
    }

    #[test]
    fn a_key_is_kept_only_when_it_is_the_limited_one_byte_for_byte() {
        let to = forwarded(&[("x-api-key", "Alice")], "alice");
        let keys: Vec<_> = to.get_all("x-api-key").iter().collect();
        assert_eq!(keys, vec!["alice"]);
        let to = forwarded(&[("x-api-key", "alice")], "alice");
        let keys: Vec<_> = to.get_all("x-api-key").iter().collect();
        assert_eq!(keys, vec!["alice"]);
    }

    #[test]
    fn an_address_text_is_as_long_as_said() {
        for ip in [
            "0.0.0.0",
            "9.10.99.100",
            "255.255.255.255",
            "::1",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            let mut text = String::new();
            push_ip(&mut text, ip);
            assert_eq!(text, ip.to_string());
            match ip {
                IpAddr::V4(_) => assert_eq!(ip_text_len(ip), text.len(), "{ip}"),
                IpAddr::V6(_) => assert!(ip_text_len(ip) >= text.len(), "{ip}"),
            }
        }
    }

    #[test]
    fn the_peer_is_appended_to_every_earlier_hop() {
        let to = forwarded(
            &[
                ("x-forwarded-for", "1.1.1.1"),
                ("x-forwarded-for", "2.2.2.2, 3.3.3.3"),
                ("x-forwarded-host", "spoofed"),
            ],
            "t",
        );
        assert_eq!(to["x-forwarded-for"], "1.1.1.1, 2.2.2.2, 3.3.3.3, 10.0.0.7");
        assert!(!to.contains_key("x-forwarded-host"), "no Host, no claim");
    }

    #[test]
    fn response_fields_lose_hop_by_hop_ones_and_content_length() {
        let field = |name, value: &'static str| httparse::Header {
            name,
            value: value.as_bytes(),
        };
        let fields = [
            field("Connection", "keep-alive, X-Hop"),
            field("x-hop", "1"),
            field("Content-Length", "3"),
            field("Keep-Alive", "timeout=5"),
            field("Content-Type", "text/plain"),
            field("Connection", " x-other "),
            field("X-Other", "2"),
        ];
        let kept: Vec<_> = fields
            .iter()
            .filter(|f| travels(f.name, &fields))
            .map(|f| f.name)
            .collect();
        assert_eq!(kept, vec!["Content-Type"]);
    }
}
