//! gRPC unary calls on the listener's HTTP/2: reading one request message,
//! answering one message or a status.
//!
//! Owns the wire format (a 5-byte prefix: a compression flag and the
//! message's length), the status codes, and the bounds a hostile client
//! meets: one message per call, at most [`MAX_MESSAGE`] bytes, no
//! compression (none is advertised), and the body within the client read
//! timeout. A status travels in trailers after a message, or alone in the
//! response head ("trailers-only") when there is no message.

use std::fmt::Write as _;
use std::time::Duration;

use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};

use crate::proxy::body::{ProxyBody, SmallBodyError, read_small};
use crate::proxy::budget::Budget;

/// Largest request message accepted (a rate limit request is a few
/// hundred bytes).
pub(super) const MAX_MESSAGE: usize = 64 * 1024;

/// `application/grpc`.
const GRPC: HeaderValue = HeaderValue::from_static("application/grpc");
/// `grpc-status`.
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// `grpc-message`.
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");

/// The gRPC status codes this server answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Code {
    /// The request cannot be served as sent.
    InvalidArgument = 3,
    /// The client did not send its request in time.
    DeadlineExceeded = 4,
    /// The request message is too large.
    ResourceExhausted = 8,
    /// No such method here, or a feature not offered (compression).
    Unimplemented = 12,
}

/// A failed call: its code and a message for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Status {
    /// The code.
    pub(super) code: Code,
    /// What went wrong, in words.
    pub(super) message: String,
}

impl Status {
    /// A status of `code` saying `message`.
    pub(super) fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// The trailers-only response carrying this status.
    pub(super) fn response(&self) -> Response<ProxyBody> {
        let mut response = Response::new(ProxyBody::Whole(None));
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, GRPC);
        status_fields(headers, self.code as u8, &self.message);
        response
    }
}

/// Sets `grpc-status` and, when there is one, `grpc-message`
/// (percent-encoded, as the protocol asks).
fn status_fields(headers: &mut HeaderMap, code: u8, message: &str) {
    headers.insert(GRPC_STATUS, HeaderValue::from(u16::from(code)));
    if !message.is_empty()
        && let Ok(value) = HeaderValue::try_from(percent_encode(message))
    {
        headers.insert(GRPC_MESSAGE, value);
    }
}

/// `text` with every byte outside printable ASCII, and `%`, as `%XX`.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The answer to a call that succeeded: `message`, then status 0.
pub(super) fn respond<M: prost::Message>(message: &M) -> Response<ProxyBody> {
    let len = message.encoded_len();
    let mut framed = Vec::with_capacity(5 + len);
    framed.push(0);
    // A response is far below 4 GiB: its length fits the prefix.
    framed.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    message.encode_raw(&mut framed);
    let mut trailers = HeaderMap::new();
    status_fields(&mut trailers, 0, "");
    let mut response = Response::new(ProxyBody::Trailed(
        Some(Bytes::from(framed)),
        Some(trailers),
    ));
    response.headers_mut().insert(CONTENT_TYPE, GRPC);
    response
}

/// Reads the one message of a unary call to `path` within `timeout`,
/// holding its bytes of `budget`.
///
/// # Errors
/// A response to send instead: HTTP 415 when the request is not gRPC at
/// all, else a status (unknown method, compression, a message too large,
/// missing, followed by another or not decodable, or too slow).
pub(super) async fn read_unary<M: prost::Message + Default>(
    req: Request<Incoming>,
    path: &str,
    timeout: Duration,
    budget: &Budget,
) -> Result<M, Response<ProxyBody>> {
    let is_grpc = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"));
    if !is_grpc {
        let mut response = Response::new(ProxyBody::Whole(None));
        *response.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        return Err(response);
    }
    if req.method() != Method::POST || req.uri().path() != path {
        return Err(Status::new(
            Code::Unimplemented,
            format!("no method {} here (served: {path})", req.uri().path()),
        )
        .response());
    }
    let body = read_small(req.into_body(), 5 + MAX_MESSAGE, timeout, budget)
        .await
        .map_err(|e| {
            let status = match e {
                SmallBodyError::TooLarge => Status::new(Code::ResourceExhausted, too_large()),
                SmallBodyError::Broken => {
                    Status::new(Code::InvalidArgument, "the request broke off")
                }
                SmallBodyError::TimedOut => {
                    Status::new(Code::DeadlineExceeded, "the request did not arrive in time")
                }
            };
            status.response()
        })?;
    decode(&body).map_err(|status| status.response())
}

/// Why a message was refused for its size.
fn too_large() -> String {
    format!("the request message is larger than {MAX_MESSAGE} bytes")
}

/// The one message framed in `body`.
fn decode<M: prost::Message + Default>(body: &[u8]) -> Result<M, Status> {
    let invalid = |message: &str| Status::new(Code::InvalidArgument, message);
    let Some((prefix, message)) = body.split_first_chunk::<5>() else {
        return Err(invalid("no request message"));
    };
    if prefix[0] != 0 {
        return Err(Status::new(
            Code::Unimplemented,
            "compressed messages are not accepted",
        ));
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(Status::new(Code::ResourceExhausted, too_large()));
    }
    if message.len() != len {
        return Err(invalid("a unary call carries exactly one whole message"));
    }
    M::decode(message).map_err(|_| invalid("the request message is not the method's request"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Probe {
        #[prost(string, tag = "1")]
        name: String,
    }

    fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    #[test]
    fn one_plain_message_decodes_and_anything_else_is_refused() {
        let probe = Probe { name: "x".into() };
        let bytes = prost::Message::encode_to_vec(&probe);
        assert_eq!(decode::<Probe>(&framed(0, &bytes)), Ok(probe));
        let code = |body: &[u8]| decode::<Probe>(body).unwrap_err().code;
        assert_eq!(code(&framed(1, &bytes)), Code::Unimplemented);
        assert_eq!(code(&bytes[..0]), Code::InvalidArgument);
        let mut two = framed(0, &bytes);
        two.extend(framed(0, &bytes));
        assert_eq!(code(&two), Code::InvalidArgument);
        let mut short = framed(0, &bytes);
        short.pop();
        assert_eq!(code(&short), Code::InvalidArgument);
        let mut huge = vec![0u8];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(code(&huge), Code::ResourceExhausted);
        assert_eq!(code(&framed(0, &[0xff, 0xff])), Code::InvalidArgument);
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("a b%c\né"), "a b%25c%0A%C3%A9");
    }
}
