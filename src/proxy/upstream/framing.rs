//! HTTP/1.1 on the wire toward an upstream: the request head as written,
//! the response head as parsed, and the framing of both bodies.
//!
//! Pure work on buffers, no I/O: the caller reads and writes. A response
//! head is parsed in place and its header values share the bytes it
//! arrived in; informational answers (`100 Continue`, `103 Early Hints`)
//! are skipped, `101` is refused (the gateway never asks for an upgrade),
//! and a body's framing follows RFC 9112 §6.3: none for a HEAD request or
//! a 1xx, 204 or 304, else chunked when `Transfer-Encoding` ends in it,
//! else `Content-Length` (every copy the same number), else until the
//! upstream closes. A connection is kept only when nothing in the answer
//! says otherwise. Of the answer's fields, only those that travel on to
//! the client are kept (see `hop`); the framing fields are read as they
//! arrived.

use std::io::Write as _;
use std::mem::MaybeUninit;

use bytes::{Buf as _, Bytes, BytesMut};
use hyper::header::{HeaderMap, HeaderValue};
use hyper::{Method, StatusCode, Version};

use super::hop;

/// Most header lines a response head or trailer section may hold.
const MAX_HEADERS: usize = 100;

/// Room in an answer's header map for the fields the gateway adds to it
/// (the rate-limit ones, `Retry-After`, a HEAD answer's `Content-Length`),
/// so that the map is not grown and rebuilt for them.
const ADDED_FIELDS: usize = 6;

/// Why bytes from an upstream are not HTTP/1.1 the gateway accepts.
#[derive(Debug, thiserror::Error)]
pub(super) enum FramingError {
    /// The response head does not parse.
    #[error("malformed response head: {0}")]
    Head(httparse::Error),
    /// The response head or a chunk's size line is longer than allowed.
    #[error("response head too large")]
    TooLarge,
    /// `Content-Length` is not one number.
    #[error("invalid content-length")]
    Length,
    /// A chunk of a chunked body is malformed.
    #[error("malformed chunked body")]
    Chunk,
    /// The trailer section does not parse.
    #[error("malformed trailers")]
    Trailers,
    /// The upstream switched protocols, which was never asked for.
    #[error("unexpected 101 Switching Protocols")]
    Upgrade,
    /// The request target holds bytes a request line cannot carry.
    #[error("request target not sendable")]
    Target,
}

/// How a request body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RequestFraming {
    /// No body and no length said.
    Bodiless,
    /// `Content-Length: n`.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

impl RequestFraming {
    /// The framing of a body of `exact` bytes when known, sent with
    /// `method`: an empty body says `Content-Length: 0` only where a body
    /// is expected (POST, PUT, PATCH).
    pub(super) fn of(exact: Option<u64>, method: &Method) -> Self {
        match exact {
            Some(0) if !matches!(*method, Method::POST | Method::PUT | Method::PATCH) => {
                Self::Bodiless
            }
            Some(n) => Self::Length(n),
            None => Self::Chunked,
        }
    }
}

/// Writes the request line of `method` `target`, the header lines that
/// `fields` writes, and the framing header into `out`.
///
/// # Errors
/// [`FramingError::Target`] when `target` holds a byte outside visible
/// ASCII (a space, a control character), which would end the request line.
pub(super) fn write_head(
    out: &mut Vec<u8>,
    method: &Method,
    target: &str,
    fields: impl FnOnce(&mut Vec<u8>),
    framing: RequestFraming,
) -> Result<(), FramingError> {
    if target.is_empty() || !target.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(FramingError::Target);
    }
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    fields(out);
    match framing {
        RequestFraming::Bodiless => {}
        RequestFraming::Length(n) => {
            hop::write_field(
                out,
                b"content-length",
                itoa::Buffer::new().format(n).as_bytes(),
            );
        }
        RequestFraming::Chunked => hop::write_field(out, b"transfer-encoding", b"chunked"),
    }
    out.extend_from_slice(b"\r\n");
    Ok(())
}

/// Writes what precedes a chunk of `len` bytes (not zero) of a chunked
/// body: the end of the chunk before it, unless it is the `first`, and
/// its size line.
pub(super) fn chunk_start(out: &mut Vec<u8>, len: usize, first: bool) {
    if !first {
        out.extend_from_slice(b"\r\n");
    }
    // unwrap: writing into a Vec cannot fail.
    write!(out, "{len:x}\r\n").expect("writing into a Vec");
}

/// Writes the end of a chunked body: the end of its last chunk, unless it
/// had none (`first`), and the last chunk with no trailers.
pub(super) fn chunked_end(out: &mut Vec<u8>, first: bool) {
    if !first {
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
}

/// How a response body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// None: a HEAD answer, a 1xx, 204 or 304.
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// Chunks, then trailers.
    Chunked,
    /// Everything until the upstream closes the connection.
    Close,
}

/// A response head as parsed.
#[derive(Debug)]
pub(super) struct Head {
    /// The status.
    pub(super) status: StatusCode,
    /// The headers, values sharing the bytes the head arrived in.
    pub(super) headers: HeaderMap,
    /// How the body is framed.
    pub(super) framing: Framing,
    /// Whether the connection may carry another request once the body
    /// has been read.
    pub(super) keep_alive: bool,
    /// The body length `Content-Length` declared, unless a
    /// `Transfer-Encoding` overrode it (a HEAD answer's is kept).
    pub(super) length: Option<u64>,
}

/// Parses the response head at the start of `buf`, skipping
/// informational answers, for a request that was a HEAD when `head_request`,
/// and takes its bytes out of `buf`; `None` while it is incomplete
/// (informational answers already taken out).
///
/// # Errors
/// When the head is malformed, longer than `max` bytes while incomplete,
/// a `101`, or has an unusable `Content-Length`.
pub(super) fn parse_head(
    buf: &mut BytesMut,
    head_request: bool,
    max: usize,
) -> Result<Option<Head>, FramingError> {
    loop {
        // Left uninitialised: the parser writes the lines it finds, and
        // filling a hundred slots first would cost a head more than
        // parsing it.
        let mut slots = [const { MaybeUninit::uninit() }; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut []);
        let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut response,
            buf,
            &mut slots,
        );
        let len = match parsed {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if buf.len() >= max => {
                return Err(FramingError::TooLarge);
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(FramingError::Head(e)),
        };
        // unwrap: a complete response has a code, which httparse keeps
        // to three digits.
        let code = response.code.expect("a complete head has a status");
        let status =
            StatusCode::from_u16(code).map_err(|_| FramingError::Head(httparse::Error::Status))?;
        if status == StatusCode::SWITCHING_PROTOCOLS {
            return Err(FramingError::Upgrade);
        }
        if status.is_informational() {
            buf.advance(len);
            continue;
        }
        let version = if response.version == Some(0) {
            Version::HTTP_10
        } else {
            Version::HTTP_11
        };
        // The framing fields are read as they arrived; only the fields
        // that travel on are kept, each value where it lies in the head,
        // to share its bytes once the head is out of `buf`.
        let base = buf.as_ptr() as usize;
        let mut fields = Fields::default();
        for header in response.headers.iter() {
            fields.note(header)?;
        }
        // Most answers' `Connection` lists only `keep-alive` or `close`;
        // when it lists more, its values are kept to take out the fields
        // they name.
        let mut spans = Vec::with_capacity(response.headers.len());
        let mut connection = Vec::new();
        for header in response.headers.iter() {
            let start = header.value.as_ptr() as usize - base;
            let end = start + header.value.len();
            if !hop::travels(header.name) {
                if fields.lists_fields && header.name.eq_ignore_ascii_case("connection") {
                    connection.push(start..end);
                }
                continue;
            }
            let name = hop::field_name(header.name.as_bytes())
                .map_err(|_| FramingError::Head(httparse::Error::HeaderName))?;
            spans.push((name, start, end));
        }
        let bytes = buf.split_to(len).freeze();
        let mut headers = HeaderMap::with_capacity(spans.len() + ADDED_FIELDS);
        for (name, start, end) in spans {
            let value = HeaderValue::from_maybe_shared(bytes.slice(start..end))
                .map_err(|_| FramingError::Head(httparse::Error::HeaderValue))?;
            headers.append(name, value);
        }
        hop::drop_listed(
            &mut headers,
            connection.into_iter().map(|span| &bytes[span]),
        );
        return Ok(Some(fields.head(status, version, headers, head_request)));
    }
}

/// What a response head's framing fields say.
#[derive(Debug, Default)]
struct Fields {
    /// The length every `Content-Length` states, if one does.
    length: Option<u64>,
    /// Whether a `Transfer-Encoding` came.
    transfer_encoding: bool,
    /// Whether the last coding of the last `Transfer-Encoding` is
    /// `chunked`.
    chunked: bool,
    /// Whether `Connection` lists `close`.
    close: bool,
    /// Whether `Connection` lists `keep-alive`.
    keep_alive: bool,
    /// Whether `Connection` lists anything that may name an end-to-end
    /// field.
    lists_fields: bool,
}

impl Fields {
    /// Takes in `field`, when it is one of the framing fields.
    ///
    /// # Errors
    /// [`FramingError::Length`] for a `Content-Length` that is not a
    /// number or differs from an earlier one.
    fn note(&mut self, field: &httparse::Header<'_>) -> Result<(), FramingError> {
        let name = field.name;
        if name.eq_ignore_ascii_case("content-length") {
            for item in hop::tokens(field.value) {
                let n = decimal(item).ok_or(FramingError::Length)?;
                if self.length.is_some_and(|l| l != n) {
                    return Err(FramingError::Length);
                }
                self.length = Some(n);
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            self.transfer_encoding = true;
            self.chunked = hop::tokens(field.value)
                .next_back()
                .is_some_and(|coding| coding.eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case("connection") {
            for token in hop::tokens(field.value) {
                let close = token.eq_ignore_ascii_case(b"close");
                self.close |= close;
                self.keep_alive |= token.eq_ignore_ascii_case(b"keep-alive");
                self.lists_fields |= !close && hop::names_end_to_end(token);
            }
        }
        Ok(())
    }

    /// The head of an answer with `status`, `version` and the end-to-end
    /// `headers`, to a HEAD request when `head_request`: its framing, and
    /// whether its connection may be kept.
    fn head(
        self,
        status: StatusCode,
        version: Version,
        headers: HeaderMap,
        head_request: bool,
    ) -> Head {
        let mut keep_alive = if version == Version::HTTP_10 {
            self.keep_alive
        } else {
            !self.close
        };
        let framing = if head_request
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
        {
            Framing::Empty
        } else if self.transfer_encoding {
            // A length beside it is ignored, and the connection not reused
            // (RFC 9112 §6.3).
            keep_alive &= self.length.is_none() && self.chunked;
            if self.chunked {
                Framing::Chunked
            } else {
                Framing::Close
            }
        } else if let Some(length) = self.length {
            Framing::Length(length)
        } else {
            keep_alive = false;
            Framing::Close
        };
        Head {
            status,
            headers,
            framing,
            keep_alive,
            length: self.length.filter(|_| !self.transfer_encoding),
        }
    }
}

/// The number `item` states in decimal digits, if that is all it is and
/// it fits.
fn decimal(item: &[u8]) -> Option<u64> {
    if item.is_empty() {
        return None;
    }
    item.iter().try_fold(0u64, |n, &b| {
        let digit = b.checked_sub(b'0').filter(|d| *d <= 9)?;
        n.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// What a chunked body yields next.
#[derive(Debug)]
pub(super) enum Piece {
    /// Data.
    Data(Bytes),
    /// The trailer section, when it has fields.
    Trailers(HeaderMap),
    /// The end of the body.
    End,
}

/// Where a chunked body's decoding stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Before a size line.
    Size,
    /// Inside a chunk, with this many bytes left.
    Data(u64),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// After the last chunk, before the trailer section.
    Trailers,
    /// After the trailer section.
    Done,
}

/// Decodes a chunked body from the bytes read so far.
#[derive(Debug)]
pub(super) struct Chunked {
    /// Where decoding stands.
    at: Chunk,
}

impl Chunked {
    /// A body whose first size line is next.
    pub(super) fn new() -> Self {
        Self { at: Chunk::Size }
    }

    /// The next piece from `buf` (its bytes taken out), `None` when more
    /// must be read first.
    ///
    /// # Errors
    /// For a malformed size line, chunk end or trailer section.
    pub(super) fn next(&mut self, buf: &mut BytesMut) -> Result<Option<Piece>, FramingError> {
        loop {
            match self.at {
                Chunk::Size => match httparse::parse_chunk_size(buf) {
                    Ok(httparse::Status::Complete((len, size))) => {
                        buf.advance(len);
                        self.at = if size == 0 {
                            Chunk::Trailers
                        } else {
                            Chunk::Data(size)
                        };
                    }
                    Ok(httparse::Status::Partial) => return Ok(None),
                    Err(_) => return Err(FramingError::Chunk),
                },
                Chunk::Data(left) => {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    let take = left.min(buf.len() as u64);
                    self.at = if take == left {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(left - take)
                    };
                    // `take` is at most `buf.len()`, so it fits a usize.
                    let data = buf.split_to(take as usize).freeze();
                    return Ok(Some(Piece::Data(data)));
                }
                Chunk::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(None);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(FramingError::Chunk);
                    }
                    buf.advance(2);
                    self.at = Chunk::Size;
                }
                Chunk::Trailers => return self.trailers(buf),
                Chunk::Done => return Ok(Some(Piece::End)),
            }
        }
    }

    /// The trailer section at the start of `buf`, or the end of the body
    /// when it is empty.
    fn trailers(&mut self, buf: &mut BytesMut) -> Result<Option<Piece>, FramingError> {
        if buf.len() < 2 {
            return Ok(None);
        }
        if buf.starts_with(b"\r\n") {
            buf.advance(2);
            self.at = Chunk::Done;
            return Ok(Some(Piece::End));
        }
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        match httparse::parse_headers(buf, &mut slots) {
            Ok(httparse::Status::Complete((len, fields))) => {
                let mut trailers = HeaderMap::with_capacity(fields.len());
                for field in fields {
                    let name = hop::field_name(field.name.as_bytes())
                        .map_err(|_| FramingError::Trailers)?;
                    let value =
                        HeaderValue::from_bytes(field.value).map_err(|_| FramingError::Trailers)?;
                    trailers.append(name, value);
                }
                buf.advance(len);
                self.at = Chunk::Done;
                Ok(Some(Piece::Trailers(trailers)))
            }
            Ok(httparse::Status::Partial) => Ok(None),
            Err(_) => Err(FramingError::Trailers),
        }
    }
}

#[cfg(test)]
mod tests {
    use hyper::header::HeaderName;

    use super::*;

    fn parsed(text: &str) -> Result<Option<Head>, FramingError> {
        parse_head(&mut BytesMut::from(text), false, 1024)
    }

    fn framing(text: &str) -> (Framing, bool) {
        let head = parsed(text).unwrap().unwrap();
        (head.framing, head.keep_alive)
    }

    #[test]
    fn a_request_head_carries_its_line_headers_and_framing() {
        let fields = |out: &mut Vec<u8>| {
            hop::write_field(out, b"host", b"up:9000");
            hop::write_field(out, b"x-a", b"1");
        };
        let mut out = Vec::new();
        write_head(
            &mut out,
            &Method::POST,
            "/p?q=1",
            fields,
            RequestFraming::Length(5),
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /p?q=1 HTTP/1.1\r\nhost: up:9000\r\nx-a: 1\r\ncontent-length: 5\r\n\r\n"
        );
    }

    #[test]
    fn a_target_with_a_space_or_control_byte_is_not_written() {
        for target in ["/a b", "/a\r\nx: y", ""] {
            let mut out = Vec::new();
            let written = write_head(
                &mut out,
                &Method::GET,
                target,
                |_| {},
                RequestFraming::Bodiless,
            );
            assert!(matches!(written, Err(FramingError::Target)), "{target:?}");
        }
    }

    #[test]
    fn an_empty_body_says_its_length_only_where_a_body_is_expected() {
        assert_eq!(
            RequestFraming::of(Some(0), &Method::GET),
            RequestFraming::Bodiless
        );
        assert_eq!(
            RequestFraming::of(Some(0), &Method::POST),
            RequestFraming::Length(0)
        );
        assert_eq!(
            RequestFraming::of(None, &Method::GET),
            RequestFraming::Chunked
        );
    }

    #[test]
    fn chunks_are_framed_with_their_hex_size_and_ended_by_a_zero_chunk() {
        let mut out = Vec::new();
        chunk_start(&mut out, 26, true);
        out.extend_from_slice(b"abcdefghijklmnopqrstuvwxyz");
        chunk_start(&mut out, 1, false);
        out.push(b'!');
        chunked_end(&mut out, false);
        let mut decoded = BytesMut::from(&out[..]);
        let mut chunked = Chunked::new();
        let mut body = Vec::new();
        let end = loop {
            match chunked.next(&mut decoded).unwrap() {
                Some(Piece::Data(d)) => body.extend_from_slice(&d),
                other => break other,
            }
        };
        assert_eq!(body, b"abcdefghijklmnopqrstuvwxyz!");
        assert!(matches!(end, Some(Piece::End)) && decoded.is_empty());
        let mut empty = Vec::new();
        chunked_end(&mut empty, true);
        assert_eq!(empty, b"0\r\n\r\n");
    }

    #[test]
    fn a_head_is_parsed_when_whole_and_its_values_are_kept() {
        let mut buf = BytesMut::from("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: b\r\n");
        assert!(parse_head(&mut buf, false, 1024).unwrap().is_none());
        buf.extend_from_slice(b"\r\nok");
        let head = parse_head(&mut buf, false, 1024).unwrap().unwrap();
        assert_eq!(head.status, StatusCode::OK);
        assert_eq!(head.headers["x-a"], "b");
        assert_eq!(head.headers.len(), 1, "hop-by-hop fields stay behind");
        assert_eq!(head.framing, Framing::Length(2));
        assert!(head.keep_alive);
        assert_eq!(&buf[..], b"ok", "the body stays in the buffer");
    }

    #[test]
    fn fields_that_connection_names_stay_behind_whatever_else_it_lists() {
        for connection in ["X-Hop", "close, x-hop", "Keep-Alive,X-HOP "] {
            let text = format!(
                "HTTP/1.1 200 OK\r\nConnection: {connection}\r\nX-Hop: 1\r\nX-End: 2\r\nContent-Length: 0\r\n\r\n"
            );
            let head = parsed(&text).unwrap().unwrap();
            let names: Vec<_> = head.headers.keys().map(HeaderName::as_str).collect();
            assert_eq!(names, vec!["x-end"], "{connection:?}");
        }
        let head = parsed("HTTP/1.1 200 OK\r\nConnection: close\r\nX-End: 2\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(head.headers.len(), 1);
        assert!(!head.keep_alive);
    }

    #[test]
    fn informational_answers_are_skipped_and_101_is_refused() {
        let mut buf = BytesMut::from(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n",
        );
        let head = parse_head(&mut buf, false, 1024).unwrap().unwrap();
        assert_eq!(head.status, StatusCode::CREATED);
        assert!(buf.is_empty());
        assert!(matches!(
            parsed("HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"),
            Err(FramingError::Upgrade)
        ));
    }

    #[test]
    fn an_incomplete_head_past_the_limit_is_refused() {
        let long = format!("HTTP/1.1 200 OK\r\nX: {}", "a".repeat(2000));
        assert!(matches!(parsed(&long), Err(FramingError::TooLarge)));
        assert!(matches!(
            parsed("HTTP/1.1 2x0 OK\r\n\r\n"),
            Err(FramingError::Head(_))
        ));
    }

    #[test]
    fn the_framing_follows_rfc_9112() {
        let cases = [
            ("Content-Length: 3\r\n", Framing::Length(3), true),
            (
                "Content-Length: 3, 3\r\nContent-Length: 3\r\n",
                Framing::Length(3),
                true,
            ),
            (
                "Transfer-Encoding: gzip, Chunked\r\n",
                Framing::Chunked,
                true,
            ),
            (
                "Transfer-Encoding: chunked\r\nContent-Length: 9\r\n",
                Framing::Chunked,
                false,
            ),
            ("Transfer-Encoding: gzip\r\n", Framing::Close, false),
            ("", Framing::Close, false),
            (
                "Connection: Keep-Alive, Close\r\nContent-Length: 0\r\n",
                Framing::Length(0),
                false,
            ),
        ];
        for (fields, expected, keep_alive) in cases {
            let text = format!("HTTP/1.1 200 OK\r\n{fields}\r\n");
            assert_eq!(framing(&text), (expected, keep_alive), "{fields:?}");
        }
        let others = [
            (
                "HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n",
                Framing::Empty,
                true,
            ),
            (
                "HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",
                Framing::Length(0),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n",
                Framing::Length(0),
                true,
            ),
        ];
        for (text, expected, keep_alive) in others {
            assert_eq!(framing(text), (expected, keep_alive), "{text:?}");
        }
        let to_head = parse_head(
            &mut BytesMut::from("HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n"),
            true,
            1024,
        )
        .unwrap()
        .unwrap();
        assert_eq!(to_head.framing, Framing::Empty);
    }

    #[test]
    fn lengths_that_are_not_one_number_are_refused() {
        for bad in [
            "-1",
            "1 2",
            "",
            "3, 4",
            "0x10",
            "+5",
            "18446744073709551616",
        ] {
            let text = format!("HTTP/1.1 200 OK\r\nContent-Length: {bad}\r\n\r\n");
            assert!(
                matches!(parsed(&text), Err(FramingError::Length)),
                "{bad:?}"
            );
        }
        assert!(matches!(
            parsed("HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"),
            Err(FramingError::Length)
        ));
    }

    /// Feeds `wire` to a chunked decoder `step` bytes at a time.
    fn decode(wire: &[u8], step: usize) -> Result<(Vec<u8>, Option<HeaderMap>), FramingError> {
        let mut chunked = Chunked::new();
        let mut buf = BytesMut::new();
        let (mut body, mut trailers) = (Vec::new(), None);
        let mut fed = 0;
        loop {
            match chunked.next(&mut buf)? {
                Some(Piece::Data(d)) => body.extend_from_slice(&d),
                Some(Piece::Trailers(t)) => trailers = Some(t),
                Some(Piece::End) => return Ok((body, trailers)),
                None if fed == wire.len() => return Err(FramingError::Chunk),
                None => {
                    let end = (fed + step).min(wire.len());
                    buf.extend_from_slice(&wire[fed..end]);
                    fed = end;
                }
            }
        }
    }

    #[test]
    fn a_chunked_body_decodes_the_same_however_it_is_split() {
        let wire = b"5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Usage: 42\r\nX-B: c\r\n\r\n";
        for step in [1, 2, 3, 7, wire.len()] {
            let (body, trailers) = decode(wire, step).unwrap();
            assert_eq!(body, b"helloabcdefghijklmnopqrstuvwxyz", "step {step}");
            let trailers = trailers.expect("trailers");
            assert_eq!(trailers["x-usage"], "42");
            assert_eq!(trailers["x-b"], "c");
        }
        let (body, trailers) = decode(b"0\r\n\r\n", 1).unwrap();
        assert!(body.is_empty() && trailers.is_none());
    }

    #[test]
    fn malformed_chunks_are_refused() {
        for wire in [
            &b"5\r\nhelloXX0\r\n\r\n"[..],
            b"g\r\n",
            b"11111111111111111\r\n",
            b"0\r\nbad trailer\r\n\r\n",
        ] {
            assert!(
                decode(wire, 1).is_err(),
                "{:?}",
                String::from_utf8_lossy(wire)
            );
        }
    }
}
