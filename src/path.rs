//! Request-path normalisation: what a route matches is what the upstream
//! gets.
//!
//! Owns the one spelling of a request path that routing, limiting and
//! forwarding all use. Upstreams (nginx, application servers) resolve
//! `/%6frders`, `//orders`, `/./orders` or `/x/../orders` to `/orders`; if
//! the gateway matched the raw text instead, a client could pick the
//! spelling that lands on a generous route and reach the tight one's
//! resource. So the path is normalised first, and the normalised form is
//! both matched and sent upstream:
//!
//! 1. percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) are
//!    decoded; every other escape is kept, with upper-case hex digits;
//! 2. empty segments (repeated slashes) are dropped;
//! 3. dot segments are removed as RFC 3986 §5.2.4 says (`..` above the
//!    root stays at the root).
//!
//! What cannot be made unambiguous is refused: an encoded slash (`%2F`) or
//! backslash (`%5C`), a raw backslash, a matrix parameter (`;`, which
//! servlet containers strip from segments), a malformed escape, and a path
//! that is not absolute. The query string is never touched.
//!
//! Invariant: [`normalize`] is idempotent, and a path it returns unchanged
//! (borrowed) needs no allocation: the common case costs one scan. Route
//! prefixes in the config must already be in normal form.

use std::borrow::Cow;

/// Why a request path was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// `%2F` or `%5C`: a slash that upstreams may or may not decode.
    #[error("encoded slash or backslash")]
    EncodedSlash,
    /// A raw `\`, which some servers read as `/`.
    #[error("backslash")]
    Backslash,
    /// A `;` (matrix or path parameter), which some servers strip.
    #[error("matrix parameter")]
    MatrixParameter,
    /// A `%` not followed by two hex digits.
    #[error("malformed percent-encoding")]
    BadEscape,
    /// The path does not start with `/`.
    #[error("not an absolute path")]
    NotAbsolute,
}

/// The normalised form of `raw` (a request target's path, without query).
///
/// # Errors
/// [`PathError`] when the path is ambiguous or malformed.
pub fn normalize(raw: &str) -> Result<Cow<'_, str>, PathError> {
    let bytes = raw.as_bytes();
    if raw.is_empty() {
        return Ok(Cow::Borrowed("/"));
    }
    if bytes[0] != b'/' {
        return Err(PathError::NotAbsolute);
    }
    if is_plain(bytes) {
        return Ok(Cow::Borrowed(raw));
    }
    let decoded = decode(bytes)?;
    Ok(Cow::Owned(remove_dot_segments(&decoded)))
}

/// Whether `path` is already normal and unambiguous: no escape, no
/// backslash, no `;`, no empty segment and no segment starting with `.`
/// (a superset of the dot segments; those take the slow path and come out
/// unchanged).
fn is_plain(path: &[u8]) -> bool {
    let mut previous = 0u8;
    for &b in path {
        match b {
            b'%' | b'\\' | b';' => return false,
            b'/' | b'.' if previous == b'/' => return false,
            _ => {}
        }
        previous = b;
    }
    true
}

/// Decodes escaped unreserved characters and refuses the ambiguous ones;
/// other escapes are kept with upper-case hex digits.
fn decode(path: &[u8]) -> Result<Vec<u8>, PathError> {
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        match path[i] {
            b'%' => {
                let (hi, lo) = match (path.get(i + 1), path.get(i + 2)) {
                    (Some(&hi), Some(&lo)) => (hex(hi)?, hex(lo)?),
                    _ => return Err(PathError::BadEscape),
                };
                let byte = hi << 4 | lo;
                match byte {
                    b'/' | b'\\' => return Err(PathError::EncodedSlash),
                    b if is_unreserved(b) => out.push(b),
                    _ => out.extend_from_slice(&[b'%', HEX[usize::from(hi)], HEX[usize::from(lo)]]),
                }
                i += 3;
            }
            b'\\' => return Err(PathError::Backslash),
            b';' => return Err(PathError::MatrixParameter),
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    Ok(out)
}

/// Upper-case hex digits, by value.
const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// The value of one hex digit.
fn hex(digit: u8) -> Result<u8, PathError> {
    match digit {
        b'0'..=b'9' => Ok(digit - b'0'),
        b'a'..=b'f' => Ok(digit - b'a' + 10),
        b'A'..=b'F' => Ok(digit - b'A' + 10),
        _ => Err(PathError::BadEscape),
    }
}

/// RFC 3986 unreserved characters, which mean the same encoded or not.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Drops empty and `.` segments and resolves `..` (never above the root);
/// a path whose last segment was empty, `.` or `..` keeps its trailing
/// slash.
fn remove_dot_segments(path: &[u8]) -> String {
    let mut kept: Vec<&[u8]> = Vec::new();
    let mut trailing_slash = false;
    // `path` starts with '/': the first split item is the empty string.
    for segment in path.split(|&b| b == b'/').skip(1) {
        trailing_slash = matches!(segment, b"" | b"." | b"..");
        match segment {
            b"" | b"." => {}
            b".." => {
                kept.pop();
            }
            s => kept.push(s),
        }
    }
    let mut out = Vec::with_capacity(path.len());
    for segment in &kept {
        out.push(b'/');
        out.extend_from_slice(segment);
    }
    if out.is_empty() || trailing_slash {
        out.push(b'/');
    }
    // Only ASCII bytes were decoded or removed, at ASCII boundaries, so the
    // bytes of the original `&str` stay valid UTF-8.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn n(raw: &str) -> Result<String, PathError> {
        normalize(raw).map(Cow::into_owned)
    }

    #[test]
    fn spellings_of_one_resource_normalise_to_it() {
        for raw in [
            "/orders",
            "/%6frders",
            "/%6Frders",
            "//orders",
            "/./orders",
            "/x/../orders",
            "/x/y/../../orders",
            "/../orders",
            "/%2e%2e/orders",
            "/%2E/orders",
            "///orders",
            "/orders/.",
            "/orders/x/..",
        ] {
            let got = n(raw).unwrap();
            assert!(
                got == "/orders" || got == "/orders/",
                "{raw:?} became {got:?}"
            );
        }
    }

    #[test]
    fn plain_paths_are_borrowed_unchanged() {
        for raw in ["/", "/orders", "/orders/", "/a/b.c/d", "/a.b/c~d_e-f"] {
            assert!(
                matches!(normalize(raw), Ok(Cow::Borrowed(p)) if p == raw),
                "{raw:?}"
            );
        }
        assert_eq!(n("").unwrap(), "/");
    }

    #[test]
    fn trailing_slashes_and_dot_files_are_kept() {
        for (raw, normal) in [
            ("/orders/", "/orders/"),
            ("/a/./", "/a/"),
            ("/a/b/..", "/a/"),
            ("/.well-known/x", "/.well-known/x"),
            ("/a/..b/c", "/a/..b/c"),
            ("/..", "/"),
        ] {
            assert_eq!(n(raw).unwrap(), normal, "{raw}");
        }
    }

    #[test]
    fn reserved_escapes_stay_encoded_in_upper_case() {
        for (raw, normal) in [
            ("/a%3fb", "/a%3Fb"),
            ("/a%20b", "/a%20b"),
            ("/%252e%252e/x", "/%252e%252e/x"),
            ("/caf%C3%A9", "/caf%C3%A9"),
        ] {
            assert_eq!(n(raw).unwrap(), normal, "{raw}");
        }
    }

    #[test]
    fn ambiguous_paths_are_refused() {
        assert_eq!(n("/a%2fb"), Err(PathError::EncodedSlash));
        assert_eq!(n("/a%2Fb"), Err(PathError::EncodedSlash));
        assert_eq!(n("/a%5cb"), Err(PathError::EncodedSlash));
        assert_eq!(n("/a\\b"), Err(PathError::Backslash));
        assert_eq!(n("/orders;x"), Err(PathError::MatrixParameter));
        assert_eq!(n("/orders;jsessionid=1/7"), Err(PathError::MatrixParameter));
        assert_eq!(n("/a%zz"), Err(PathError::BadEscape));
        assert_eq!(n("/a%4"), Err(PathError::BadEscape));
        assert_eq!(n("*"), Err(PathError::NotAbsolute));
        assert_eq!(n("orders"), Err(PathError::NotAbsolute));
    }

    proptest! {
        #[test]
        fn normalising_is_idempotent_and_leaves_nothing_ambiguous(
            raw in "/[a-z./%;~0-9A-F]{0,24}"
        ) {
            if let Ok(once) = normalize(&raw) {
                let twice = normalize(&once).unwrap();
                prop_assert_eq!(&twice, &once);
                prop_assert!(!once.contains("//"));
                prop_assert!(once.split('/').all(|s| s != "." && s != ".."));
            }
        }
    }
}
