//! The one place where failures become HTTP responses.
//!
//! Every client-visible error has a status, a short stable `error` code and
//! a fixed human message in a small JSON body. Internal error text (Redis,
//! socket or parser messages) is logged, never sent to clients.

use hyper::header::{ALLOW, CACHE_CONTROL, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Response, StatusCode};

use super::body::ProxyBody;
use crate::key::IdError;
use crate::path::PathError;

/// The methods a 405 names: every standard method but `CONNECT` and
/// `TRACE` (routes may accept fewer).
const PROXIED_METHODS: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS";

/// Why the gateway answered instead of the upstream.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// `CONNECT` or `TRACE`, which are never proxied.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The path is ambiguous or malformed.
    #[error("invalid path: {0}")]
    BadPath(#[source] PathError),
    /// No route matches the method and path.
    #[error("no route matches")]
    NoRoute,
    /// The request has no `X-Api-Key` header.
    #[error("missing api key")]
    MissingKey,
    /// The `X-Api-Key` header is not a valid tenant id.
    #[error("malformed api key: {0}")]
    BadKey(#[source] IdError),
    /// The key is not text (non-UTF-8 bytes).
    #[error("api key is not text")]
    BadKeyEncoding,
    /// More than one key: repeated headers, a list, or another spelling of
    /// the header name.
    #[error("more than one api key")]
    SeveralKeys,
    /// The reservation header is repeated or not a whole number.
    #[error("invalid reservation")]
    BadReservation,
    /// The tenant is over its limit.
    #[error("rate limited")]
    RateLimited,
    /// The tenant (or the default-rule group) has as many requests in
    /// flight as it may.
    #[error("too many requests in flight")]
    TooManyInFlight,
    /// The client sent its request body too slowly.
    #[error("client too slow")]
    ClientTimeout,
    /// The client's request body broke off.
    #[error("client request body broken")]
    ClientAborted,
    /// The upstream refused the connection or could not be reached.
    #[error("upstream unreachable")]
    UpstreamUnreachable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Connecting to or hearing from the upstream took too long.
    #[error("upstream timed out")]
    UpstreamTimeout,
}

impl ProxyError {
    /// The HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::NoRoute => StatusCode::NOT_FOUND,
            Self::MissingKey => StatusCode::UNAUTHORIZED,
            Self::BadPath(_)
            | Self::BadKey(_)
            | Self::BadKeyEncoding
            | Self::SeveralKeys
            | Self::BadReservation
            | Self::ClientAborted => StatusCode::BAD_REQUEST,
            Self::RateLimited | Self::TooManyInFlight => StatusCode::TOO_MANY_REQUESTS,
            Self::ClientTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::UpstreamUnreachable(_) => StatusCode::BAD_GATEWAY,
            Self::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// Short, stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            Self::MethodNotAllowed => "method_not_allowed",
            Self::BadPath(_) => "invalid_path",
            Self::NoRoute => "no_route",
            Self::MissingKey => "missing_api_key",
            Self::BadKey(_) | Self::BadKeyEncoding => "invalid_api_key",
            Self::SeveralKeys => "ambiguous_api_key",
            Self::BadReservation => "invalid_reservation",
            Self::RateLimited => "rate_limited",
            Self::TooManyInFlight => "too_many_in_flight",
            Self::ClientTimeout => "client_timeout",
            Self::ClientAborted => "client_aborted",
            Self::UpstreamUnreachable(_) => "upstream_unreachable",
            Self::UpstreamTimeout => "upstream_timeout",
        }
    }

    /// Fixed human-readable explanation.
    fn message(&self) -> &'static str {
        match self {
            Self::MethodNotAllowed => "CONNECT and TRACE are not proxied.",
            Self::BadPath(PathError::EncodedSlash) => {
                "The path may not contain an encoded slash or backslash (%2F, %5C)."
            }
            Self::BadPath(PathError::Backslash) => "The path may not contain a backslash.",
            Self::BadPath(PathError::MatrixParameter) => {
                "The path may not contain ';' (matrix parameters)."
            }
            Self::BadPath(PathError::BadEscape) => {
                "The path holds a '%' not followed by two hex digits."
            }
            Self::BadPath(PathError::NotAbsolute) => "The request target must be an absolute path.",
            Self::NoRoute => "No route matches this method and path.",
            Self::MissingKey => "The X-Api-Key header is required.",
            Self::BadKey(IdError::Empty) => "The X-Api-Key header is empty.",
            Self::BadKey(IdError::TooLong) => "The X-Api-Key header is longer than 64 bytes.",
            Self::BadKey(
                IdError::BadChar | IdError::RouteColon | IdError::NameChar | IdError::NameStart,
            )
            | Self::BadKeyEncoding => {
                "The X-Api-Key header may only contain letters, digits and . _ : -"
            }
            Self::SeveralKeys => "Send exactly one X-Api-Key header holding one key.",
            Self::BadReservation => "The reservation header, when sent, must be one whole number.",
            Self::RateLimited => "Too many requests for this API key and route; see Retry-After.",
            Self::TooManyInFlight => {
                "Too many requests of this API key are in flight; retry when one has finished."
            }
            Self::ClientTimeout => "The request body arrived too slowly.",
            Self::ClientAborted => "The request body broke off.",
            Self::UpstreamUnreachable(_) => "The upstream service could not be reached.",
            Self::UpstreamTimeout => "The upstream service did not answer in time.",
        }
    }

    /// The complete response for this error: its status, a small JSON
    /// body, and `Allow` or `Retry-After` where the error calls for one.
    pub(super) fn response(&self) -> Response<ProxyBody> {
        let mut response = error_response(self.status(), self.code(), self.message());
        let headers = response.headers_mut();
        match self {
            Self::MethodNotAllowed => {
                headers.insert(ALLOW, HeaderValue::from_static(PROXIED_METHODS));
            }
            Self::TooManyInFlight => {
                headers.insert(RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        response
    }
}

/// The body of an error answer.
#[derive(serde::Serialize)]
struct ErrorBody<'a> {
    /// Stable code.
    error: &'a str,
    /// Human explanation.
    message: &'a str,
}

/// The JSON error answer every HTTP listener but the admin one sends:
/// `{"error": code, "message": message}` with `status`.
pub(super) fn error_response(status: StatusCode, code: &str, message: &str) -> Response<ProxyBody> {
    json_response(
        status,
        &ErrorBody {
            error: code,
            message,
        },
    )
}

/// A JSON answer of `body` with `status`, never cached. `body` is written
/// straight into the answer's one buffer (a refusal is on the hot path of
/// a flood).
pub(super) fn json_response(
    status: StatusCode,
    body: &impl serde::Serialize,
) -> Response<ProxyBody> {
    let mut text = Vec::with_capacity(128);
    // A struct of strings, numbers and booleans always serialises.
    if serde_json::to_writer(&mut text, body).is_err() {
        text.clear();
    }
    text.push(b'\n');
    let mut response = Response::new(ProxyBody::whole(text.into()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_json_with_a_stable_code_and_no_internal_text() {
        for err in [
            ProxyError::MethodNotAllowed,
            ProxyError::BadPath(PathError::EncodedSlash),
            ProxyError::NoRoute,
            ProxyError::MissingKey,
            ProxyError::BadKey(IdError::BadChar),
            ProxyError::SeveralKeys,
            ProxyError::RateLimited,
            ProxyError::TooManyInFlight,
            ProxyError::ClientTimeout,
            ProxyError::UpstreamTimeout,
        ] {
            let res = err.response();
            assert_eq!(res.status(), err.status());
            let ProxyBody::Whole(Some(body)) = res.into_body() else {
                panic!("{err:?} answers with a body in one piece");
            };
            let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(parsed["error"], err.code());
            assert_eq!(parsed["message"], err.message());
        }
        assert_eq!(ProxyError::MissingKey.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(
            ProxyError::BadKey(IdError::Empty).status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            ProxyError::UpstreamTimeout.status(),
            StatusCode::GATEWAY_TIMEOUT
        );
    }
}
