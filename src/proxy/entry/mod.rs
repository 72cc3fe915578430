//! The entry points a request comes in by, and what they share: the
//! proxy ([`proxy`]: route, identify, limit, forward), Envoy's rate limit
//! service ([`rls`], over gRPC: [`grpc`]) and the HTTP check ([`check`]);
//! each connection's requests are its listening socket's
//! [`Entry`](crate::telemetry::Entry). Identifying the tenant (step 2 of
//! each) is here, once, and so is checking the name a gateway gives a
//! request whose concurrency slot it will release later ([`request_id`]).

mod check;
mod grpc;
mod proxy;
mod rls;

use std::convert::Infallible;
use std::rc::Rc;

use hyper::body::Incoming;
use hyper::header::HeaderMap;
use hyper::{Request, Response};

use super::body::ProxyBody;
use super::client::Client;
use super::error::ProxyError;
use super::{API_KEY, ProxyState, Worker};
use crate::key::TenantId;
use crate::telemetry::{Entry, Outcome};

/// Answers one request from `client` that came in through `entry`: the
/// connection's service, owning its handles so that no future wraps this
/// one to hold them.
pub(super) async fn handle(
    entry: Entry,
    req: Request<Incoming>,
    client: Rc<Client>,
    worker: Rc<Worker>,
) -> Result<Response<ProxyBody>, Infallible> {
    Ok(match entry {
        Entry::Proxy => proxy::handle(req, &client, &worker).await,
        Entry::Rls => rls::handle(req, &client, &worker).await,
        Entry::Check => check::handle(req, &client, &worker).await,
    })
}

/// The tenant of `headers` ([`identify`]); a missing or malformed key is
/// counted for `entry` on route index `route`.
fn identify_counted(
    headers: &HeaderMap,
    state: &ProxyState,
    entry: Entry,
    route: usize,
) -> Result<TenantId, ProxyError> {
    identify(headers).map_err(|e| {
        let outcome = if matches!(e, ProxyError::MissingKey) {
            Outcome::Unauthorized
        } else {
            Outcome::BadKey
        };
        state.requests.count(entry, None, route, outcome);
        e
    })
}

/// Longest request id (Envoy's `x-request-id` is a 36-byte UUID).
const MAX_REQUEST_ID: usize = 256;

/// A request id as a gateway names it (RLS's `rls.request_id_key`
/// entry, the check's `request_id`): 1 to [`MAX_REQUEST_ID`] bytes.
///
/// # Errors
/// What is wrong, naming the field `field`.
fn request_id<'a>(field: &str, id: &'a str) -> Result<&'a str, String> {
    if id.is_empty() || id.len() > MAX_REQUEST_ID {
        return Err(format!(
            "{field:?} must be 1 to {MAX_REQUEST_ID} bytes long"
        ));
    }
    Ok(id)
}

/// Reads and validates the tenant: exactly one `X-Api-Key` header holding
/// one key, and no other spelling of the header name (`X_Api_Key`, which
/// CGI-style servers read as the same header).
fn identify(headers: &HeaderMap) -> Result<TenantId, ProxyError> {
    // One pass over the fields, no lookup: most requests carry a few.
    let mut key = None;
    for (name, value) in headers {
        let several = if *name == API_KEY {
            key.replace(value).is_some()
        } else {
            is_key_alias(name.as_str())
        };
        if several {
            return Err(ProxyError::SeveralKeys);
        }
    }
    let raw = key.ok_or(ProxyError::MissingKey)?;
    let text = raw.to_str().map_err(|_| ProxyError::BadKeyEncoding)?;
    if text.contains(',') {
        return Err(ProxyError::SeveralKeys);
    }
    TenantId::parse(text).map_err(ProxyError::BadKey)
}

/// Whether the (lower-case) header `name` is `x-api-key` spelt with
/// underscores for some of its dashes.
fn is_key_alias(name: &str) -> bool {
    const KEY: &[u8] = b"x-api-key";
    name.len() == KEY.len()
        && name.contains('_')
        && name
            .bytes()
            .zip(KEY)
            .all(|(b, &k)| b == k || (b == b'_' && k == b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn underscore_spellings_of_the_key_header_are_aliases() {
        assert!(is_key_alias("x_api_key"));
        assert!(is_key_alias("x-api_key"));
        assert!(!is_key_alias("x-api-key"));
        assert!(!is_key_alias("x_api_kez"));
        assert!(!is_key_alias("accept"));
    }
}
