//! Forwarding an admitted request to its upstream and streaming the answer.
//!
//! Owns the upstream connections (each worker keeps its own idle HTTP/1.1
//! connections per upstream in a `pool::IdleList`, driven by tasks on that
//! worker's runtime, with a cap on how many it uses at once), hop-by-hop
//! header removal in both directions, `X-Forwarded-*`, and upstream
//! timeouts. Bodies are streamed in both directions, never buffered; a
//! known `Content-Length` is kept.
//!
//! actix-web speaks `http` 0.2 types and hyper `http` 1.x ones, so method,
//! URI, status and headers cross over as bytes.

use std::error::Error as StdError;
use std::fmt::Write as _;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::body::SizedStream;
use actix_web::http::header as ax;
use actix_web::http::{Method, StatusCode};
use actix_web::{HttpRequest, HttpResponse, HttpResponseBuilder, web};
use futures_util::{Stream, StreamExt};
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header as hy;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::error::ProxyError;
use super::pool::IdleList;
use super::route::Route;
use crate::clock::SharedClock;
use crate::config::{RouteSpec, UpstreamSettings};

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

/// Request-body chunks in flight between the client connection and the
/// upstream one.
const BODY_CHUNKS_IN_FLIGHT: usize = 4;

/// One upstream origin as seen by one worker.
struct Upstream {
    /// `host:port` to connect to.
    address: String,
    /// The `Host` header sent upstream.
    host: hy::HeaderValue,
    /// Idle connections.
    idle: IdleList<SendRequest<RequestBody>>,
    /// When connections become idle and expire.
    clock: SharedClock,
}

impl Upstream {
    /// The upstream of `spec`, whose origin config validation has checked;
    /// connections idle longer than `max_idle` are not used again.
    fn new(spec: &RouteSpec, max_idle: Duration, clock: SharedClock) -> Self {
        // expect: validation accepts only `http://host[:port]` origins, and
        // their authority is a valid header value.
        let authority: hyper::http::uri::Authority = spec
            .upstream_origin
            .trim_start_matches("http://")
            .parse()
            .expect("a validated upstream origin");
        let host = match authority.port() {
            Some(port) => format!("{}:{}", authority.host(), port.as_str()),
            None => authority.host().to_owned(),
        };
        Self {
            address: format!(
                "{}:{}",
                authority.host(),
                authority.port_u16().unwrap_or(80)
            ),
            host: hy::HeaderValue::try_from(host).expect("an authority is a header value"),
            idle: IdleList::new(u64::try_from(max_idle.as_millis()).unwrap_or(u64::MAX)),
            clock,
        }
    }

    /// An idle connection still open and not expired, if any.
    fn take_idle(&self) -> Option<SendRequest<RequestBody>> {
        self.idle
            .take(self.clock.now_ms(), |sender| !sender.is_closed())
    }

    /// Keeps `sender` for a later request.
    fn keep(&self, sender: SendRequest<RequestBody>) {
        self.idle.put(sender, self.clock.now_ms());
    }
}

/// One worker's upstream connections.
pub struct Forwarder {
    /// Each route's upstream, by route index; routes with the same origin
    /// share one.
    upstreams: Vec<Rc<Upstream>>,
    /// One permit per upstream connection this worker may use at once.
    connections: Arc<Semaphore>,
    /// Bound on one connection attempt.
    connect_timeout: Duration,
    /// Bound on waiting for a connection plus the upstream's response head.
    timeout: Duration,
}

impl Forwarder {
    /// Connection handling for `routes` with the configured cap and
    /// timeouts, idle time measured by `clock`. Connects to nothing until
    /// the first request.
    pub fn new(settings: &UpstreamSettings, routes: &[RouteSpec], clock: &SharedClock) -> Self {
        let mut upstreams: Vec<Rc<Upstream>> = Vec::new();
        for (i, spec) in routes.iter().enumerate() {
            let same = routes[..i]
                .iter()
                .position(|earlier| earlier.upstream_origin == spec.upstream_origin);
            upstreams.push(match same {
                Some(j) => upstreams[j].clone(),
                None => Rc::new(Upstream::new(spec, settings.idle_timeout, clock.clone())),
            });
        }
        Self {
            upstreams,
            connections: Arc::new(Semaphore::new(settings.max_connections_per_worker)),
            connect_timeout: settings.connect_timeout,
            timeout: settings.timeout,
        }
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
        route: &Route,
        decorate: impl FnOnce(&mut HttpResponseBuilder),
    ) -> Result<HttpResponse, ProxyError> {
        let upstream = Rc::clone(&self.upstreams[route.index]);
        let request = upstream_request(req, payload, &route.spec, &upstream)?;
        let exchange = async {
            let permit = Arc::clone(&self.connections)
                .acquire_owned()
                .await
                .map_err(upstream_failure)?;
            let (sender, response) = self.exchange(&upstream, request).await?;
            Ok((
                Lease {
                    sender,
                    upstream,
                    _permit: permit,
                },
                response,
            ))
        };
        let (lease, response) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| ProxyError::UpstreamTimeout)??;

        let (head, body) = response.into_parts();
        let status = StatusCode::from_u16(head.status.as_u16()).map_err(upstream_failure)?;
        let mut builder = HttpResponse::build(status);
        let listed = connection_tokens(head.headers.get_all(hy::CONNECTION).iter());
        for (name, value) in &head.headers {
            if is_end_to_end(name.as_str(), &listed)
                && name != hy::CONTENT_LENGTH
                && let (Ok(name), Ok(value)) = (
                    ax::HeaderName::from_bytes(name.as_str().as_bytes()),
                    ax::HeaderValue::from_bytes(value.as_bytes()),
                )
            {
                builder.append_header((name, value));
            }
        }
        decorate(&mut builder);
        let bodiless = status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        let stream = ResponseBody {
            body,
            done: false,
            lease: Some(lease),
        };
        // A chunked answer has no length. A HEAD answer keeps the
        // upstream's Content-Length; actix writes no body for HEAD, and the
        // upstream sent none.
        let length = if head.headers.contains_key(hy::TRANSFER_ENCODING) {
            None
        } else {
            content_length(head.headers.get(hy::CONTENT_LENGTH).map(|v| v.as_bytes()))
        };
        Ok(match length {
            _ if bodiless => builder.finish(),
            Some(len) => builder.body(SizedStream::new(len, stream)),
            None if req.method() == Method::HEAD => builder.finish(),
            None => builder.streaming(stream),
        })
    }

    /// Sends `request` on an idle connection to `upstream`, or a new one,
    /// and waits for the response head. A request an idle connection
    /// could not take (it was closing) goes to the next one.
    async fn exchange(
        &self,
        upstream: &Upstream,
        mut request: hyper::Request<RequestBody>,
    ) -> Result<(SendRequest<RequestBody>, hyper::Response<Incoming>), ProxyError> {
        loop {
            let (mut sender, reused) = match upstream.take_idle() {
                Some(sender) => (sender, true),
                None => (self.connect(upstream).await?, false),
            };
            if sender.ready().await.is_err() {
                if reused {
                    continue;
                }
                return Err(ProxyError::UpstreamUnreachable(
                    "upstream closed the connection".into(),
                ));
            }
            match sender.try_send_request(request).await {
                Ok(response) => return Ok((sender, response)),
                Err(mut failed) => match failed.take_message() {
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(upstream_failure(failed.into_error())),
                },
            }
        }
    }

    /// A new connection to `upstream`, its task running on this worker.
    async fn connect(&self, upstream: &Upstream) -> Result<SendRequest<RequestBody>, ProxyError> {
        let stream =
            tokio::time::timeout(self.connect_timeout, TcpStream::connect(&upstream.address))
                .await
                .map_err(|_| ProxyError::UpstreamTimeout)?
                .map_err(upstream_failure)?;
        stream.set_nodelay(true).map_err(upstream_failure)?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(upstream_failure)?;
        actix_web::rt::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "Upstream connection ended with an error.");
            }
        });
        Ok(sender)
    }
}

/// A connection in use by one exchange, returned to its upstream's idle
/// list once the response body has been read to the end.
struct Lease {
    /// The connection.
    sender: SendRequest<RequestBody>,
    /// Where it goes back to.
    upstream: Rc<Upstream>,
    /// Counts against the worker's connection cap while in use.
    _permit: OwnedSemaphorePermit,
}

/// Maps a connection-level failure to 502.
fn upstream_failure(e: impl StdError + Send + Sync + 'static) -> ProxyError {
    tracing::debug!(error = %e, "Upstream request failed.");
    ProxyError::UpstreamUnreachable(Box::new(e))
}

/// The upstream request for `req`: same method; the route's base path
/// followed by the request's path and query; the upstream's `Host`, the
/// end-to-end headers and `X-Forwarded-*`; the body pumped from `payload`.
fn upstream_request(
    req: &HttpRequest,
    payload: web::Payload,
    route: &RouteSpec,
    upstream: &Upstream,
) -> Result<hyper::Request<RequestBody>, ProxyError> {
    let path = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
    let base = &route.upstream_base_path;
    let mut target = String::with_capacity(base.len() + path.len());
    target.push_str(base);
    target.push_str(path);
    let uri = hyper::Uri::try_from(target).map_err(upstream_failure)?;
    let method =
        hyper::Method::from_bytes(req.method().as_str().as_bytes()).map_err(upstream_failure)?;

    let body = match request_body_length(req.headers()) {
        BodyLength::None => RequestBody::empty(),
        BodyLength::Sized(len) => RequestBody::pumped(payload, Some(len)),
        BodyLength::Chunked => RequestBody::pumped(payload, None),
    };
    let mut request = hyper::Request::new(body);
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    let headers = request.headers_mut();
    headers.reserve(req.headers().len() + 4);
    headers.insert(hy::HOST, upstream.host.clone());
    copy_end_to_end(req.headers(), headers);
    add_forwarded(req, headers);
    Ok(request)
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

fn request_body_length(headers: &ax::HeaderMap) -> BodyLength {
    if headers.contains_key(ax::TRANSFER_ENCODING) {
        BodyLength::Chunked
    } else {
        match content_length(headers.get(ax::CONTENT_LENGTH).map(|v| v.as_bytes())) {
            Some(len) => BodyLength::Sized(len),
            None => BodyLength::None,
        }
    }
}

fn content_length(value: Option<&[u8]>) -> Option<u64> {
    std::str::from_utf8(value?).ok()?.trim().parse().ok()
}

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

/// Copies the client's end-to-end headers. `Host` is left to the client
/// library (the upstream's authority) and `Content-Length` to the body.
fn copy_end_to_end(from: &ax::HeaderMap, to: &mut hy::HeaderMap) {
    let listed = connection_tokens(from.get_all(ax::CONNECTION));
    for (name, value) in from {
        if is_end_to_end(name.as_str(), &listed)
            && name != ax::HOST
            && name != ax::CONTENT_LENGTH
            && let (Ok(name), Ok(value)) = (
                hy::HeaderName::from_bytes(name.as_str().as_bytes()),
                hy::HeaderValue::from_bytes(value.as_bytes()),
            )
        {
            to.append(name, value);
        }
    }
}

/// Adds `X-Forwarded-For` (appending the peer), `-Proto` and `-Host`.
fn add_forwarded(req: &HttpRequest, to: &mut hy::HeaderMap) {
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

/// A request body for hyper, which needs `Send` bodies: the client's
/// `!Send` payload is read by a task on the worker and its chunks handed
/// over through a small bounded channel (back-pressure both ways).
struct RequestBody {
    /// Chunks from the pump; `None` for a request without a body.
    chunks: Option<mpsc::Receiver<io::Result<Bytes>>>,
    /// The declared length, when known.
    length: Option<u64>,
}

impl RequestBody {
    /// No body at all.
    fn empty() -> Self {
        Self {
            chunks: None,
            length: Some(0),
        }
    }

    /// Starts a task that moves `payload` into the body, chunk by chunk.
    fn pumped(mut payload: web::Payload, length: Option<u64>) -> Self {
        let (tx, rx) = mpsc::channel(BODY_CHUNKS_IN_FLIGHT);
        actix_web::rt::spawn(async move {
            while let Some(chunk) = payload.next().await {
                let chunk = chunk.map_err(|e| io::Error::other(e.to_string()));
                let failed = chunk.is_err();
                if tx.send(chunk).await.is_err() || failed {
                    break;
                }
            }
        });
        Self {
            chunks: Some(rx),
            length,
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match &mut self.get_mut().chunks {
            None => Poll::Ready(None),
            Some(chunks) => chunks
                .poll_recv(cx)
                .map(|chunk| chunk.map(|c| c.map(Frame::data))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        self.length
            .map_or_else(SizeHint::default, SizeHint::with_exact)
    }
}

/// The upstream's response body as a byte stream for actix; holds the
/// connection until the body is done (then it goes back to the idle list)
/// or dropped (then it is closed).
struct ResponseBody {
    /// hyper's body: data frames, possibly trailers (dropped).
    body: Incoming,
    /// Whether the body has been read to the end (a body hyper knows to be
    /// empty or fully read by its length also reports `is_end_stream`).
    done: bool,
    /// The connection it arrives on.
    lease: Option<Lease>,
}

impl Stream for ResponseBody {
    type Item = Result<Bytes, hyper::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            return match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => Poll::Ready(Some(Ok(data))),
                    // Trailers are hop-level here: skip them.
                    Err(_) => continue,
                },
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => {
                    this.done = true;
                    Poll::Ready(None)
                }
                Poll::Pending => Poll::Pending,
            };
        }
    }
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take()
            && (self.done || self.body.is_end_stream())
        {
            lease.upstream.keep(lease.sender);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_connection_listed_ones_are_dropped() {
        let mut from = ax::HeaderMap::new();
        from.insert(
            ax::CONNECTION,
            ax::HeaderValue::from_static("keep-alive, x-secret"),
        );
        from.insert(
            ax::HeaderName::from_static("x-secret"),
            ax::HeaderValue::from_static("1"),
        );
        from.insert(
            ax::TRANSFER_ENCODING,
            ax::HeaderValue::from_static("chunked"),
        );
        from.insert(ax::HOST, ax::HeaderValue::from_static("gateway"));
        from.insert(
            ax::HeaderName::from_static("x-api-key"),
            ax::HeaderValue::from_static("t"),
        );
        from.insert(ax::ACCEPT, ax::HeaderValue::from_static("*/*"));
        let mut to = hy::HeaderMap::new();
        copy_end_to_end(&from, &mut to);
        let mut names: Vec<_> = to.keys().map(|k| k.as_str().to_owned()).collect();
        names.sort();
        assert_eq!(names, vec!["accept", "x-api-key"]);
    }
}
