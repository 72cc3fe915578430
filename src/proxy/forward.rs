//! Forwarding an admitted request to its upstream and streaming the answer.
//!
//! Owns one worker's upstream connections (its own idle HTTP/1.1
//! connections, over TLS to `https://` upstreams, per upstream in a `pool::IdleList`, driven by tasks on that
//! worker's runtime, with a cap on how many it uses at once), the per-tenant
//! bound on exchanges in flight (`slots`), and the upstream timeouts.
//! Bodies stream in both directions under the client deadlines (`body`,
//! `stall`); a known `Content-Length` is kept.
//!
//! Blame is kept straight: time spent waiting for a slow uploading client
//! never counts against `upstream.timeout_ms`, and an upload the client
//! fails answers 408 (or is dropped with the client), never 502/504.

use std::error::Error as StdError;
use std::pin::pin;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::Either;
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header as hy;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::body::{
    Arrived, ClientFault, Held, ProxyBody, RequestBody, ResponseBody, Reuse, Upload,
};
use super::error::ProxyError;
use super::headers::RateLimitHeaders;
use super::hop;
use super::pool::IdleList;
use super::route::Route;
use super::server::Client;
use super::slots::{Slot, Slots};
use super::stall::Watchdog;
use crate::clock::{SharedClock, millis};
use crate::config::{ClientSettings, RouteSpec, UpstreamSettings};
use crate::key::TenantId;
use crate::telemetry::Metrics;
use crate::tls::{UpstreamTls, UpstreamTlsTo};

/// Largest read buffer of one upstream connection: bounds what a response
/// whose client reads slowly holds in memory.
const UPSTREAM_READ_BUFFER: usize = 64 * 1024;

/// Largest body answered in one piece when it arrived with its head
/// ([`Arrived`]): no larger than the default initial TCP send buffer
/// (16 KiB), so the kernel takes it whole even from a client that stops
/// reading, and nothing stays in the connection's buffer unwatched. A larger body
/// is streamed under the write pace, where the watchdog cuts off a client
/// that does not take it.
const WHOLE_BODY_MAX: u64 = 16 * 1024;

/// One upstream origin as seen by one worker.
struct Upstream {
    /// `host:port` to connect to.
    address: String,
    /// TLS to it, for an `https://` upstream.
    tls: Option<UpstreamTlsTo>,
    /// The `Host` header sent upstream.
    host: hy::HeaderValue,
    /// Idle connections.
    idle: IdleList<SendRequest<RequestBody>>,
    /// When connections become idle and expire.
    clock: SharedClock,
}

impl Upstream {
    /// The upstream of `spec`, whose origin config validation has checked,
    /// reached over `tls` when it is `https://`; connections idle longer
    /// than `max_idle` are not used again.
    fn new(
        spec: &RouteSpec,
        tls: Option<&UpstreamTls>,
        max_idle: Duration,
        clock: SharedClock,
    ) -> Self {
        // expect: validation accepts only `http[s]://host[:port]` origins,
        // and their authority is a valid header value.
        let (authority, default_port) = match spec.upstream_origin.split_once("://") {
            Some(("https", authority)) => (authority, 443),
            Some((_, authority)) => (authority, 80),
            None => (spec.upstream_origin.as_str(), 80),
        };
        let authority: hyper::http::uri::Authority =
            authority.parse().expect("a validated upstream origin");
        let host = match authority.port() {
            Some(port) => format!("{}:{}", authority.host(), port.as_str()),
            None => authority.host().to_owned(),
        };
        Self {
            address: format!(
                "{}:{}",
                authority.host(),
                authority.port_u16().unwrap_or(default_port)
            ),
            // expect: the app builds the trust when a route is https://,
            // and validation checked that the host can be a certificate's
            // name.
            tls: spec.is_tls().then(|| {
                tls.expect("trust for https:// upstreams")
                    .to(authority.host())
                    .expect("a validated upstream host")
            }),
            host: hy::HeaderValue::try_from(host).expect("an authority is a header value"),
            idle: IdleList::new(millis(max_idle)),
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

/// What one request is sent as: its route, its upstream target and the
/// tenant it was limited as.
pub(super) struct Target<'a> {
    /// The matched route.
    route: &'a Route,
    /// The route's base path, the normalised path and the query as sent.
    uri: hyper::Uri,
    /// The identity the upstream receives in `X-Api-Key`.
    tenant: &'a TenantId,
}

impl<'a> Target<'a> {
    /// The target of a request for `path` (normalised) with `query` on
    /// `route`, limited as `tenant`.
    ///
    /// # Errors
    /// [`ProxyError::UpstreamUnreachable`] when the joined target is not
    /// a valid URI.
    pub(super) fn new(
        route: &'a Route,
        path: &str,
        query: Option<&str>,
        tenant: &'a TenantId,
    ) -> Result<Self, ProxyError> {
        let base = &route.spec.upstream_base_path;
        let mut uri =
            String::with_capacity(base.len() + path.len() + query.map_or(0, |q| q.len() + 1));
        uri.push_str(base);
        uri.push_str(path);
        if let Some(query) = query {
            uri.push('?');
            uri.push_str(query);
        }
        Ok(Self {
            route,
            uri: hyper::Uri::try_from(uri).map_err(upstream_failure)?,
            tenant,
        })
    }
}

/// One worker's upstream connections.
pub struct Forwarder {
    /// Each route's upstream, by route index; routes with the same origin
    /// share one.
    upstreams: Vec<Rc<Upstream>>,
    /// One permit per upstream connection this worker may use at once.
    connections: Arc<Semaphore>,
    /// Exchanges in flight per tenant.
    slots: Rc<Slots>,
    /// Responses whose clients may stop reading.
    watchdog: Rc<Watchdog<Held<Lease>>>,
    /// Bound on one connection attempt (TLS handshake included).
    connect_timeout: Duration,
    /// Bound on waiting for a connection plus the upstream's response head,
    /// not counting time spent waiting on an uploading client.
    timeout: Duration,
    /// The pace clients must keep.
    client: ClientSettings,
    /// Reads now for deadlines and idle times.
    clock: SharedClock,
}

impl Forwarder {
    /// Connection handling for `routes` (over `tls` to `https://` ones)
    /// with the configured caps, timeouts and client pace, time measured
    /// by `clock`. Connects to nothing until
    /// the first request. Must be created on the worker that uses it (it
    /// starts that worker's watchdog).
    pub fn new(
        settings: &UpstreamSettings,
        tls: Option<UpstreamTls>,
        client: ClientSettings,
        routes: &[RouteSpec],
        clock: &SharedClock,
        metrics: Metrics,
    ) -> Self {
        let mut upstreams: Vec<Rc<Upstream>> = Vec::new();
        for (i, spec) in routes.iter().enumerate() {
            let same = routes[..i]
                .iter()
                .position(|earlier| earlier.upstream_origin == spec.upstream_origin);
            upstreams.push(match same {
                Some(j) => upstreams[j].clone(),
                None => Rc::new(Upstream::new(
                    spec,
                    tls.as_ref(),
                    settings.idle_timeout,
                    clock.clone(),
                )),
            });
        }
        let sweep =
            (client.write.timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        Self {
            upstreams,
            connections: Arc::new(Semaphore::new(settings.max_connections_per_worker)),
            slots: Slots::new(settings),
            watchdog: Watchdog::start(sweep, clock.clone(), metrics),
            connect_timeout: settings.connect_timeout,
            timeout: settings.timeout,
            client,
            clock: clock.clone(),
        }
    }

    /// How long a client may keep its request body coming without
    /// progress.
    pub(super) fn read_timeout(&self) -> Duration {
        self.client.read.timeout
    }

    /// A place for one exchange of `tenant` (whose pair has a rule when
    /// `has_rule`); `None` when the tenant, or the default-rule group, has
    /// as many in flight as it may on this worker.
    pub(super) fn slot(&self, tenant: &TenantId, has_rule: bool) -> Option<Slot> {
        self.slots.acquire(tenant, has_rule)
    }

    /// Sends `req`, its body streamed, from `client` to `target`'s
    /// upstream and streams the answer back, holding `slot` until the
    /// answer ends; the answer carries `limits`.
    ///
    /// # Errors
    /// [`ProxyError::UpstreamUnreachable`] or [`ProxyError::UpstreamTimeout`]
    /// for the upstream's failures, [`ProxyError::ClientTimeout`] or
    /// [`ProxyError::ClientAborted`] when the client failed its upload.
    pub(super) async fn forward(
        &self,
        req: Request<Incoming>,
        client: &Client,
        target: Target<'_>,
        slot: Slot,
        limits: &RateLimitHeaders,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let upstream = Rc::clone(&self.upstreams[target.route.index]);
        let head = req.method() == Method::HEAD;
        let cut = client.cut_for(req.version());
        let (request, upload) = self.upstream_request(req, client, target, &upstream);
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
                    _slot: slot,
                },
                response,
            ))
        };
        let (lease, response) = self.bounded(exchange, &upload).await?;

        let (mut parts, mut body) = response.into_parts();
        let status = parts.status;
        // A chunked answer has no length; a declared one is what the body
        // carries. A HEAD answer keeps the upstream's Content-Length and has
        // no body.
        let length = if parts.headers.contains_key(hy::TRANSFER_ENCODING) {
            None
        } else {
            content_length(parts.headers.get(hy::CONTENT_LENGTH))
        };
        hop::strip_response_headers(&mut parts.headers);
        limits.apply(&mut parts.headers);
        let bodiless = status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        if head || bodiless {
            if let (true, Some(len)) = (head, length) {
                parts
                    .headers
                    .insert(hy::CONTENT_LENGTH, hy::HeaderValue::from(len));
            }
            lease.reuse_when_done(body);
            return Ok(Response::from_parts(parts, ProxyBody::Whole(None)));
        }
        let mut first = None;
        if length.is_some_and(|len| len <= WHOLE_BODY_MAX) {
            match Arrived::take(&mut body).map_err(upstream_failure)? {
                Arrived::Whole(data) => {
                    lease.reuse();
                    return Ok(Response::from_parts(parts, ProxyBody::whole(data)));
                }
                Arrived::Part(data) => first = data,
            }
        }
        let watch = self.watchdog.watch(
            Held {
                body,
                lease,
                client: cut,
            },
            self.client.write,
        );
        let stream = ResponseBody::new(watch, first, length, self.clock.clone());
        Ok(Response::from_parts(parts, ProxyBody::Streamed(stream)))
    }

    /// Runs `exchange` under `upstream.timeout_ms`, not counting the time
    /// `upload` spent waiting on its client; a failed upload is the
    /// client's fault whatever hyper reports.
    async fn bounded<T>(
        &self,
        exchange: impl Future<Output = Result<T, ProxyError>>,
        upload: &Upload,
    ) -> Result<T, ProxyError> {
        let started = self.clock.now_ms();
        let limit = millis(self.timeout);
        let mut exchange = pin!(exchange);
        let mut wait = self.timeout;
        loop {
            match tokio::time::timeout(wait, &mut exchange).await {
                Ok(result) => {
                    return result.map_err(|e| match upload.fault() {
                        Some(ClientFault::Slow) => ProxyError::ClientTimeout,
                        Some(ClientFault::Broken) => ProxyError::ClientAborted,
                        None => e,
                    });
                }
                Err(_) => {
                    let now = self.clock.now_ms();
                    let upstream_ms = now
                        .saturating_sub(started)
                        .saturating_sub(upload.waited(now));
                    if upstream_ms >= limit {
                        return Err(ProxyError::UpstreamTimeout);
                    }
                    wait = Duration::from_millis(limit - upstream_ms);
                }
            }
        }
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

    /// A new connection to `upstream` (over TLS for an `https://` one),
    /// its task running on this worker.
    async fn connect(&self, upstream: &Upstream) -> Result<SendRequest<RequestBody>, ProxyError> {
        let opened = async {
            let stream = TcpStream::connect(&upstream.address).await?;
            stream.set_nodelay(true)?;
            std::io::Result::Ok(match &upstream.tls {
                Some(tls) => Either::Right(tls.connect(stream).await?),
                None => Either::Left(stream),
            })
        };
        let stream = tokio::time::timeout(self.connect_timeout, opened)
            .await
            .map_err(|_| ProxyError::UpstreamTimeout)?
            .map_err(upstream_failure)?;
        match stream {
            Either::Left(plain) => handshake(plain).await,
            Either::Right(tls) => handshake(tls).await,
        }
    }

    /// The upstream request for `req`: same method; the route's base path
    /// followed by the normalised path and the query as sent; the
    /// upstream's `Host`, the end-to-end headers, the limited `X-Api-Key`
    /// and `X-Forwarded-*`; the body read at the client read pace.
    fn upstream_request(
        &self,
        req: Request<Incoming>,
        client: &Client,
        target: Target<'_>,
        upstream: &Upstream,
    ) -> (Request<RequestBody>, Rc<Upload>) {
        let (mut parts, payload) = req.into_parts();
        // HTTP/2 carries the host in the URI (`:authority`), not in `Host`.
        let authority = parts.uri.authority().cloned();
        parts.uri = target.uri;
        parts.version = hyper::Version::HTTP_11;
        hop::forwarded_headers(
            &mut parts.headers,
            (client.peer.ip(), client.tls),
            target.tenant,
            authority.as_ref().map(|a| a.as_str()),
        );
        parts.headers.insert(hy::HOST, upstream.host.clone());
        let (body, upload) = RequestBody::new(payload, self.client.read, self.clock.clone());
        (Request::from_parts(parts, body), upload)
    }
}

/// A connection in use by one exchange, returned to its upstream's idle
/// list once the response body has been read to the end.
pub(super) struct Lease {
    /// The connection.
    sender: SendRequest<RequestBody>,
    /// Where it goes back to.
    upstream: Rc<Upstream>,
    /// Counts against the worker's connection cap while in use.
    _permit: OwnedSemaphorePermit,
    /// Counts against the tenant's bound while in use.
    _slot: Slot,
}

impl Reuse for Lease {
    fn reuse(self) {
        self.upstream.keep(self.sender);
    }
}

impl Lease {
    /// Keeps the connection for a later request when `body`, which the
    /// client does not get (a HEAD answer, a 204 or 304), has ended.
    fn reuse_when_done(self, body: Incoming) {
        if body.is_end_stream() {
            self.reuse();
        }
    }
}

/// Starts HTTP/1.1 on `io`, the connection's task running on this worker.
async fn handshake<I>(io: I) -> Result<SendRequest<RequestBody>, ProxyError>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + 'static,
{
    let (sender, connection) = http1::Builder::new()
        .max_buf_size(UPSTREAM_READ_BUFFER)
        .handshake(TokioIo::new(io))
        .await
        .map_err(upstream_failure)?;
    tokio::task::spawn_local(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "Upstream connection ended with an error.");
        }
    });
    Ok(sender)
}

/// Maps a connection-level failure to 502.
fn upstream_failure(e: impl StdError + Send + Sync + 'static) -> ProxyError {
    tracing::debug!(error = %e, "Upstream request failed.");
    ProxyError::UpstreamUnreachable(Box::new(e))
}

/// The value of a `Content-Length` header, when it is one number.
fn content_length(value: Option<&hy::HeaderValue>) -> Option<u64> {
    value?.to_str().ok()?.trim().parse().ok()
}
