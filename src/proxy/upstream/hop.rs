//! Headers between the client's hop and the upstream's.
//!
//! Owns which headers travel end to end (hop-by-hop ones and those a
//! message's `Connection` header lists never do, in either direction),
//! `X-Forwarded-*`, and the identity the upstream receives: `X-Api-Key` is
//! always exactly the key that was limited, set by the gateway, so no
//! `Connection` header can remove it and no second spelling can ride
//! along. A request's headers are read as the client sent them and
//! written to the upstream with the gateway's own; a response's are
//! chosen field by field as its head is read.

use std::cell::RefCell;
use std::collections::HashSet;
use std::io::Write as _;
use std::net::IpAddr;

use hyper::header::{self as hy, HeaderMap, HeaderName, HeaderValue, InvalidHeaderName};

use crate::key::TenantId;

/// `X-Forwarded-For`.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// `X-Forwarded-Proto`.
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// `X-Forwarded-Host`.
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Where `name` (lower case) is among the headers that describe one hop
/// and are never forwarded, and `Content-Length` (the body carries its own
/// length): one `match` on its bytes, which the compiler turns into a
/// switch on the length and a comparison or two. `Connection` comes
/// first: what it lists goes too.
fn hop_by_hop_index(name: &[u8]) -> Option<usize> {
    match name {
        b"connection" => Some(0),
        b"keep-alive" => Some(1),
        b"proxy-connection" => Some(2),
        b"proxy-authenticate" => Some(3),
        b"proxy-authorization" => Some(4),
        b"te" => Some(5),
        b"trailer" => Some(6),
        b"transfer-encoding" => Some(7),
        b"upgrade" => Some(8),
        b"content-length" => Some(9),
        _ => None,
    }
}

/// The names [`hop_by_hop_index`] finds, each in its place.
const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

/// Bit `n` is set when a name in [`HOP_BY_HOP`] has `n` bytes.
const HOP_BY_HOP_LENGTHS: u32 = {
    let mut lengths = 0;
    let mut i = 0;
    while i < HOP_BY_HOP.len() {
        lengths |= 1 << HOP_BY_HOP[i].len();
        i += 1;
    }
    lengths
};

/// Where the header `name` (in any case) is among the hop-by-hop ones
/// ([`hop_by_hop_index`]). Most names have no hop-by-hop name's length,
/// and are told apart by it alone, without being copied and lowercased.
fn listed_index(name: &[u8]) -> Option<usize> {
    let length = u32::try_from(name.len()).ok()?;
    if HOP_BY_HOP_LENGTHS
        .checked_shr(length)
        .is_none_or(|bits| bits & 1 == 0)
    {
        return None;
    }
    // The longest hop-by-hop name, `proxy-authorization`, has 19 bytes.
    let mut lower = [0; 19];
    let lower = lower.get_mut(..name.len())?;
    lower.copy_from_slice(name);
    lower.make_ascii_lowercase();
    hop_by_hop_index(lower)
}

/// The comma-separated items of a field's `value`, trimmed.
pub(super) fn tokens(value: &[u8]) -> impl DoubleEndedIterator<Item = &[u8]> {
    value.split(|&b| b == b',').map(<[u8]>::trim_ascii)
}

/// The names, lower case, of the fields that a request's `Connection`
/// lists and that the request carries (hop-by-hop ones aside): read in one
/// pass over its tokens, so that a head of many fields and many tokens
/// costs their sum, never their product, and holds no more names than the
/// request has fields. `None` when it lists none, as most requests.
fn listed(headers: &HeaderMap) -> Option<HashSet<Box<[u8]>>> {
    let mut listed: Option<HashSet<Box<[u8]>>> = None;
    let mut lower = Vec::new();
    let connection = headers.iter().filter(|(name, _)| **name == hy::CONNECTION);
    for (_, value) in connection {
        for token in tokens(value.as_bytes()).filter(|t| names_end_to_end(t)) {
            lower.clear();
            lower.extend(token.iter().map(u8::to_ascii_lowercase));
            let present = std::str::from_utf8(&lower).is_ok_and(|name| headers.contains_key(name));
            if !present {
                continue;
            }
            let set = listed.get_or_insert_default();
            if !set.contains(lower.as_slice()) {
                set.insert(lower.as_slice().into());
            }
        }
    }
    listed
}

/// Takes out of a response's end-to-end `headers` every field that its
/// `connection` values list: one lookup per token.
pub(super) fn drop_listed<'a>(headers: &mut HeaderMap, connection: impl Iterator<Item = &'a [u8]>) {
    for value in connection {
        for token in tokens(value) {
            // A token that is no field name finds nothing.
            if let Ok(name) = std::str::from_utf8(token) {
                headers.remove(name);
            }
        }
    }
}

/// What the gateway tells the upstream about a request besides the
/// client's end-to-end headers.
pub(super) struct Forwarded<'a> {
    /// The client's address, and whether it came over TLS.
    pub(super) peer: (IpAddr, bool),
    /// The key that was limited: the upstream's `X-Api-Key`.
    pub(super) tenant: &'a TenantId,
    /// The request's authority (an HTTP/2 request's host), named in
    /// `X-Forwarded-Host` when the client sent no `Host`.
    pub(super) authority: Option<&'a str>,
    /// The upstream's `Host`.
    pub(super) host: &'a HeaderValue,
    /// Whether to ask for trailers (`TE: trailers`): a route that settles
    /// usage reads them, and servers that honour TE send none otherwise.
    pub(super) trailers: bool,
}

impl Forwarded<'_> {
    /// Room for the header lines [`write_fields`] adds to the client's.
    pub(super) fn added_len(&self) -> usize {
        // The fixed text of the lines, an IPv6 address at its longest,
        // and the values of the variable length.
        const FIXED: usize = 160;
        FIXED + self.tenant.as_str().len() + self.host.len() + self.authority.map_or(0, str::len)
    }
}

/// Writes the header lines of the upstream's request into `out`: the
/// client's `headers` that travel end to end (not hop-by-hop ones, nor
/// those its `Connection` lists), then the upstream's `Host`,
/// `X-Forwarded-For` with every earlier hop and the peer,
/// `X-Forwarded-Proto` (`https` when the client came over TLS),
/// `X-Forwarded-Host` with the client's `Host` (or the request's
/// authority; none when it has neither), exactly the limited key as
/// `X-Api-Key`, and `TE: trailers` when asked. Whatever the client sent
/// under the gateway's own names is replaced, so no `Connection` header
/// can remove the key and no second spelling can ride along. The
/// client's headers are read, never edited: one pass, no lookups.
pub(super) fn write_fields(out: &mut Vec<u8>, headers: &HeaderMap, forwarded: &Forwarded<'_>) {
    let listed = listed(headers);
    let travels = |name: &HeaderName| {
        hop_by_hop_index(name.as_str().as_bytes()).is_none()
            && !listed
                .as_ref()
                .is_some_and(|listed| listed.contains(name.as_str().as_bytes()))
    };
    let mut client_host = None;
    for (name, value) in headers {
        if !travels(name) {
            continue;
        }
        if *name == hy::HOST {
            client_host.get_or_insert(value.as_bytes());
        } else if *name != X_FORWARDED_FOR
            && *name != X_FORWARDED_PROTO
            && *name != X_FORWARDED_HOST
            && *name != crate::proxy::API_KEY
        {
            write_field(out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    write_field(out, b"host", forwarded.host.as_bytes());
    // Every earlier hop, from however many header lines, then the peer.
    out.extend_from_slice(b"x-forwarded-for: ");
    if travels(&X_FORWARDED_FOR) {
        let hops = headers.iter().filter(|(name, _)| **name == X_FORWARDED_FOR);
        for (_, hop) in hops {
            if hop.to_str().is_ok() {
                out.extend_from_slice(hop.as_bytes());
                out.extend_from_slice(b", ");
            }
        }
    }
    let (peer, tls) = forwarded.peer;
    push_ip(out, peer);
    out.extend_from_slice(b"\r\n");
    let proto: &[u8] = if tls { b"https" } else { b"http" };
    write_field(out, b"x-forwarded-proto", proto);
    let authority = forwarded
        .authority
        .map(str::as_bytes)
        .filter(|a| HeaderValue::from_bytes(a).is_ok());
    if let Some(host) = client_host.or(authority) {
        write_field(out, b"x-forwarded-host", host);
    }
    // A validated tenant id is a valid header value.
    write_field(out, b"x-api-key", forwarded.tenant.as_str().as_bytes());
    if forwarded.trailers {
        write_field(out, b"te", b"trailers");
    }
}

/// Writes one header line.
pub(super) fn write_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// How many field names of upstream answers a worker keeps converted.
const NAMES_KEPT: usize = 16;

/// The longest field name kept; a longer one is converted each time.
const NAME_KEPT_MAX: usize = 64;

thread_local! {
    /// The field names this thread converted last.
    static NAMES: RefCell<Names> = RefCell::default();
}

/// Field names as upstreams spelled them, each with its [`HeaderName`].
/// Upstreams send the same few names in the same case answer after
/// answer, so most are found here rather than lowercased and matched
/// against the standard names again. A fixed set of short names, replaced
/// in turn: an upstream that sends ever new or long names costs a lookup
/// each, and never more than the set's few KiB.
#[derive(Default)]
struct Names {
    /// The names kept, as they arrived.
    kept: [Option<(Box<[u8]>, HeaderName)>; NAMES_KEPT],
    /// The entry the next new name replaces.
    next: usize,
}

/// The [`HeaderName`] of a field name as an upstream's answer spelled it
/// (in any case).
///
/// # Errors
/// When `raw` is no field name.
pub(super) fn field_name(raw: &[u8]) -> Result<HeaderName, InvalidHeaderName> {
    NAMES.with_borrow_mut(|names| {
        let mut kept = names.kept.iter().flatten();
        if let Some((_, name)) = kept.find(|(spelled, _)| **spelled == *raw) {
            return Ok(name.clone());
        }
        let name = HeaderName::from_bytes(raw)?;
        if raw.len() <= NAME_KEPT_MAX {
            names.kept[names.next] = Some((raw.into(), name.clone()));
            names.next = (names.next + 1) % NAMES_KEPT;
        }
        Ok(name)
    })
}

/// Whether a response field named `name` (in any case) may travel on to
/// the client: it is not hop-by-hop. What its `Connection` lists is taken
/// out afterwards ([`drop_listed`]).
pub(super) fn travels(name: &str) -> bool {
    listed_index(name.as_bytes()).is_none()
}

/// Whether a `Connection` token may name a field that is not hop-by-hop
/// anyway (most list only `keep-alive`).
pub(super) fn names_end_to_end(token: &[u8]) -> bool {
    listed_index(token).is_none()
}

/// Appends `ip` in its usual text form (IPv4 without the formatter, which
/// costs more than the rest of the header work of a request).
fn push_ip(out: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            let mut digits = itoa::Buffer::new();
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                out.extend_from_slice(digits.format(octet).as_bytes());
            }
        }
        IpAddr::V6(v6) => {
            // unwrap-free: writing into a Vec cannot fail.
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

    /// The header lines the upstream receives for a client's `headers`
    /// limited as `tenant`, from an HTTP/2 request's `authority`, as
    /// (name, value) pairs in order.
    fn written(
        headers: &HeaderMap,
        tenant: &str,
        authority: Option<&str>,
    ) -> Vec<(String, String)> {
        let tenant = TenantId::parse(tenant).unwrap();
        let host = HeaderValue::from_static("upstream:9000");
        let forwarded = Forwarded {
            peer: (IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7)), false),
            tenant: &tenant,
            authority,
            host: &host,
            trailers: false,
        };
        let mut out = Vec::new();
        write_fields(&mut out, headers, &forwarded);
        assert!(out.len() <= forwarded.added_len() + head_lines(headers));
        String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|line| {
                let (name, value) = line.split_once(": ").unwrap();
                (name.to_owned(), value.to_owned())
            })
            .collect()
    }

    /// The length of `headers` written as header lines.
    fn head_lines(headers: &HeaderMap) -> usize {
        headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 4)
            .sum()
    }

    fn forwarded(pairs: &[(&'static str, &'static str)], tenant: &str) -> Vec<(String, String)> {
        written(&client_headers(pairs), tenant, None)
    }

    fn values<'a>(lines: &'a [(String, String)], name: &str) -> Vec<&'a str> {
        lines
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    #[test]
    fn field_names_are_converted_alike_whether_kept_or_not() {
        let spellings = ["Content-Type", "content-type", "X-Request-Id", "ETag"];
        // Twice over: converted, then found among the kept.
        for raw in spellings.iter().chain(&spellings) {
            let expected = HeaderName::from_bytes(raw.as_bytes()).unwrap();
            assert_eq!(field_name(raw.as_bytes()).unwrap(), expected, "{raw}");
        }
        assert!(field_name(b"bad name").is_err());
        assert!(field_name(b"").is_err());
        // A long name is converted, not kept.
        let long = "x".repeat(NAME_KEPT_MAX + 1);
        assert_eq!(field_name(long.as_bytes()).unwrap().as_str(), long);
        let kept_long = NAMES.with_borrow(|names| {
            names
                .kept
                .iter()
                .flatten()
                .any(|(raw, _)| raw.len() > NAME_KEPT_MAX)
        });
        assert!(!kept_long);
        // Far more names than are kept: each still right, the set bounded.
        for i in 0..3 * NAMES_KEPT {
            let raw = format!("X-Field-{i}");
            let expected = HeaderName::from_bytes(raw.as_bytes()).unwrap();
            assert_eq!(field_name(raw.as_bytes()).unwrap(), expected);
        }
        let kept = NAMES.with_borrow(|names| names.kept.iter().flatten().count());
        assert_eq!(kept, NAMES_KEPT);
        assert!(NAMES.with_borrow(|names| {
            names
                .kept
                .iter()
                .flatten()
                .all(|(raw, _)| raw.starts_with(b"X-Field-"))
        }));
    }

    #[test]
    fn every_hop_by_hop_name_is_found_in_its_place_and_no_other() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_index(name.as_bytes()), Some(i), "{name}");
            let upper = name.to_ascii_uppercase();
            assert_eq!(listed_index(upper.as_bytes()), Some(i), "{upper}");
        }
        let long = "x-".repeat(40);
        let others = ["host", "x-api-key", "content-type", "trailers", "upgrades"];
        // Of a hop-by-hop name's length, and longer than the length mask.
        for name in others
            .into_iter()
            .chain(["user-agent", "Keep-Alivf", &long])
        {
            assert_eq!(hop_by_hop_index(name.as_bytes()), None, "{name}");
            assert_eq!(listed_index(name.as_bytes()), None, "{name}");
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
        let names: Vec<_> = to.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "accept",
                "host",
                "x-forwarded-for",
                "x-forwarded-proto",
                "x-forwarded-host",
                "x-api-key",
            ]
        );
        assert_eq!(values(&to, "host"), vec!["upstream:9000"]);
        assert_eq!(values(&to, "x-forwarded-host"), vec!["gateway"]);
        assert_eq!(values(&to, "x-forwarded-proto"), vec!["http"]);
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
        let to = written(&from, "t", None);
        let names: Vec<_> = to.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "content-type",
                "host",
                "x-forwarded-for",
                "x-forwarded-proto",
                "x-api-key"
            ]
        );
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
        assert_eq!(values(&to, "x-api-key"), vec!["alice"]);
        let to = forwarded(&[("x-api-key", "Alice")], "alice");
        assert_eq!(values(&to, "x-api-key"), vec!["alice"]);
    }

    #[test]
    fn an_address_is_written_as_its_usual_text() {
        for ip in [
            "0.0.0.0",
            "9.10.99.100",
            "255.255.255.255",
            "::1",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            let mut text = Vec::new();
            push_ip(&mut text, ip);
            assert_eq!(text, ip.to_string().as_bytes());
        }
    }

    #[test]
    fn the_peer_is_appended_to_every_earlier_hop_and_claims_are_replaced() {
        let to = forwarded(
            &[
                ("x-forwarded-for", "1.1.1.1"),
                ("x-forwarded-for", "2.2.2.2, 3.3.3.3"),
                ("x-forwarded-host", "spoofed"),
                ("x-forwarded-proto", "https"),
            ],
            "t",
        );
        assert_eq!(
            values(&to, "x-forwarded-for"),
            vec!["1.1.1.1, 2.2.2.2, 3.3.3.3, 10.0.0.7"]
        );
        assert!(
            values(&to, "x-forwarded-host").is_empty(),
            "no Host, no claim"
        );
        assert_eq!(values(&to, "x-forwarded-proto"), vec!["http"]);
        // Earlier hops that Connection lists are dropped with it.
        let to = forwarded(
            &[
                ("connection", "X-Forwarded-For"),
                ("x-forwarded-for", "1.1.1.1"),
            ],
            "t",
        );
        assert_eq!(values(&to, "x-forwarded-for"), vec!["10.0.0.7"]);
    }

    #[test]
    fn an_http2_request_names_its_authority_as_the_forwarded_host() {
        let to = written(&HeaderMap::new(), "t", Some("api.example:8443"));
        assert_eq!(values(&to, "x-forwarded-host"), vec!["api.example:8443"]);
    }

    #[test]
    fn response_fields_lose_hop_by_hop_ones_and_content_length() {
        let fields = [
            ("Connection", "keep-alive, X-Hop"),
            ("x-hop", "1"),
            ("Content-Length", "3"),
            ("Keep-Alive", "timeout=5"),
            ("Content-Type", "text/plain"),
            ("Connection", " x-other ,bad token!,"),
            ("X-Other", "2"),
        ];
        let mut kept = HeaderMap::new();
        for (name, value) in fields.iter().filter(|(name, _)| travels(name)) {
            let name = HeaderName::from_bytes(name.as_bytes()).unwrap();
            kept.append(name, HeaderValue::from_static(value));
        }
        let connection = fields
            .iter()
            .filter(|(name, _)| name.eq_ignore_ascii_case("connection"))
            .map(|(_, value)| value.as_bytes());
        drop_listed(&mut kept, connection);
        let names: Vec<_> = kept.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, vec!["content-type"]);
        assert!(names_end_to_end(b"x-hop"));
        assert!(!names_end_to_end(b"Keep-Alive"));
    }

    /// A head of many fields whose `Connection` lists many names (each of
    /// them over and over, in any case) loses exactly the listed fields;
    /// the names are collected once, not compared field by token.
    #[test]
    fn a_head_of_many_fields_and_many_connection_tokens_drops_exactly_the_listed() {
        let mut from = HeaderMap::new();
        for i in 0..100 {
            let name = HeaderName::from_bytes(format!("x-n{i}").as_bytes()).unwrap();
            from.append(name, HeaderValue::from_static("v"));
        }
        let every_even: Vec<String> = (0..100).step_by(2).map(|i| format!("X-N{i}")).collect();
        let listing = vec![every_even.join(","); 200].join(", ");
        from.append(hy::CONNECTION, HeaderValue::from_str(&listing).unwrap());
        let to = written(&from, "t", None);
        let kept: Vec<_> = to
            .iter()
            .filter_map(|(name, _)| name.strip_prefix("x-n"))
            .map(|i| i.parse::<u32>().unwrap())
            .collect();
        assert_eq!(kept, (1..100).step_by(2).collect::<Vec<_>>());
        assert_eq!(listed(&from).map(|set| set.len()), Some(50));
        // Names the request does not carry are not kept.
        let absent = HeaderValue::from_static("x-absent, x-n1");
        let mut only = HeaderMap::new();
        only.append(hy::CONNECTION, absent);
        assert!(listed(&only).is_none());
    }
}
