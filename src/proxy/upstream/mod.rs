//! Forwarding an admitted request to its upstream and streaming the answer.
//!
//! Owns one worker's upstream connections (its own idle HTTP/1.1
//! connections, over TLS to `https://` upstreams, per upstream in a
//! `pool::IdleList`, each driven by the request using it, with a cap on
//! how many it uses at once), hop-by-hop headers (`hop`) and the
//! upstream timeouts; an exchange holds its tenant's slot
//! ([`super::slots`]) until its answer ends. Connections are opened,
//! reused and timed in `dial`, speak HTTP/1.1 in `conn` (bytes on the
//! wire in `framing`, answer bodies read in `answer`); the answer streams
//! back through `response` under the client's write pace; a known
//! `Content-Length` is kept.
//!
//! Blame is kept straight: time spent waiting for a slow uploading client
//! never counts against `upstream.timeout_ms`, and an upload the client
//! fails answers 408 (or is dropped with the client), never 502/504.

mod answer;
mod conn;
mod dial;
mod framing;
mod hop;
mod pool;
mod response;

pub(super) use response::ResponseBody;

use std::pin::{Pin, pin};
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body as _, Incoming};
use hyper::header as hy;
use hyper::{HeaderMap, Method, Request, Response, StatusCode};
use tokio::sync::Semaphore;

use answer::UpstreamBody;
use conn::{Conn, Outgoing};
use dial::{Dialer, upstream_failure};
use framing::{Framing, RequestFraming};
use pool::IdleList;
use response::{Arrived, Held, Lease};

use super::body::{ProxyBody, RequestBody, Upload};
use super::client::Client;
use super::error::ProxyError;
use super::listen::stall::Watchdog;
use super::route::Route;
use super::slots::Slot;
use crate::clock::{SharedClock, millis};
use crate::config::{ClientSettings, RouteSpec, UpstreamSettings};
use crate::key::TenantId;
use crate::telemetry::Metrics;
use crate::tls::{UpstreamTls, UpstreamTlsTo};

/// Largest response head (or chunk size line, or trailer section) read
/// from an upstream: bounds what one connection holds in memory.
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
    idle: IdleList<Conn>,
    /// When connections become idle (an exchange passes in the time its
    /// idle connections are judged expired at).
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
        let (authority, port) = spec.upstream_authority();
        let host = match authority.port() {
            Some(port) => format!("{}:{}", authority.host(), port.as_str()),
            None => authority.host().to_owned(),
        };
        Self {
            address: format!("{}:{port}", authority.host()),
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

    /// An idle connection still open and not expired at `now_ms`, if any.
    fn take_idle(&self, now_ms: u64) -> Option<Conn> {
        self.idle.take(now_ms, Conn::is_open)
    }

    /// Keeps `conn` for a later request.
    fn keep(&self, conn: Conn) {
        self.idle.put(conn, self.clock.now_ms());
    }
}

/// What one request is sent as: its route, its upstream target and the
/// tenant it was limited as.
pub(super) struct Target<'a> {
    /// The matched route.
    route: &'a Route,
    /// The route's base path, the normalised path and the query as sent.
    uri: String,
    /// The identity the upstream receives in `X-Api-Key`.
    tenant: &'a TenantId,
}

impl<'a> Target<'a> {
    /// The target of a request for `path` (normalised) with `query` on
    /// `route`, limited as `tenant`. Whether it can be sent is checked
    /// when its request line is written.
    pub(super) fn new(
        route: &'a Route,
        path: &str,
        query: Option<&str>,
        tenant: &'a TenantId,
    ) -> Self {
        let base = &route.spec.upstream_base_path;
        let mut uri =
            String::with_capacity(base.len() + path.len() + query.map_or(0, |q| q.len() + 1));
        uri.push_str(base);
        uri.push_str(path);
        if let Some(query) = query {
            uri.push('?');
            uri.push_str(query);
        }
        Self { route, uri, tenant }
    }
}

/// One worker's upstream connections.
pub struct Forwarder {
    /// Each route's upstream, by route index; routes with the same origin
    /// share one.
    upstreams: Vec<Rc<Upstream>>,
    /// Sends exchanges upstream, from tasks of their own.
    dialer: Rc<Dialer>,
    /// Responses whose clients may stop reading.
    watchdog: Rc<Watchdog<Held>>,
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
            dialer: Rc::new(Dialer {
                connections: Arc::new(Semaphore::new(settings.max_connections_per_worker)),
                connect_timeout: settings.connect_timeout,
                timeout: settings.timeout,
                clock: clock.clone(),
            }),
            watchdog: Watchdog::start(sweep, clock.clone(), metrics),
            client,
            clock: clock.clone(),
        }
    }

    /// How long a client may keep its request body coming without
    /// progress.
    pub(super) fn read_timeout(&self) -> Duration {
        self.client.read.timeout
    }

    /// Sends `req`, its body streamed, from `client` to `target`'s
    /// upstream and streams the answer back, holding `slot` until the
    /// answer ends.
    ///
    /// The exchange (a connection, the request, the answer's head) holds
    /// `slot` and, when the request is dropped before the head arrives (a
    /// reset stream, a closed socket), runs on in a task of its own
    /// ([`Detachable`]): a client that goes away frees nothing while the
    /// upstream works on its request. The slot is freed when the
    /// head arrives (the connection is then closed, unread, so the
    /// upstream's next write fails), when the upload breaks off (the
    /// upstream sees the request cut short), or at `upstream.timeout_ms`.
    ///
    /// # Errors
    /// [`ProxyError::UpstreamUnreachable`] or [`ProxyError::UpstreamTimeout`]
    /// for the upstream's failures, [`ProxyError::ClientTimeout`] or
    /// [`ProxyError::ClientAborted`] when the client failed its upload.
    ///
    /// `started_ms` is the clock's reading as the request is forwarded,
    /// which the caller has just taken: the upstream's time is counted
    /// from it.
    pub(super) async fn forward(
        &self,
        req: Request<Incoming>,
        client: &Client,
        target: Target<'_>,
        slot: Slot,
        started_ms: u64,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let upstream = Rc::clone(&self.upstreams[target.route.index]);
        let head_request = req.method() == Method::HEAD;
        let cut = client.cut_for(req.version());
        let (mut request, upload) = self.upstream_request(req, client, target, &upstream)?;
        let dialer = Rc::clone(&self.dialer);
        let exchange = Detachable::new(async move {
            let exchange = pin!(async {
                // A slot taken at once leaves the reading as it was; one
                // waited for (all taken, perhaps by another upstream's
                // exchanges) needs a new one, or an idle connection's age
                // would be judged by the time before the wait.
                let (permit, now_ms) = match Arc::clone(&dialer.connections).try_acquire_owned() {
                    Ok(permit) => (permit, started_ms),
                    Err(_) => {
                        let permit = Arc::clone(&dialer.connections)
                            .acquire_owned()
                            .await
                            .map_err(upstream_failure)?;
                        (permit, dialer.clock.now_ms())
                    }
                };
                let (conn, head) = dialer.exchange(&upstream, &mut request, now_ms).await?;
                let lease = Lease {
                    upstream,
                    _permit: permit,
                    _slot: slot,
                };
                Ok((lease, conn, head))
            });
            dialer.bounded(exchange, &upload, started_ms).await
        });
        let (lease, conn, head) = exchange.await?;

        let mut body = UpstreamBody::new(conn, &head);
        let (status, mut headers) = (head.status, head.headers);
        // A chunked answer has no length; a declared one is what the body
        // carries. A HEAD answer keeps the upstream's Content-Length and has
        // no body.
        let length = match head.framing {
            Framing::Length(length) => Some(length),
            Framing::Empty => head.length,
            Framing::Chunked | Framing::Close => None,
        };
        if head.framing == Framing::Empty {
            if let (true, Some(len)) = (head_request, length) {
                headers.insert(hy::CONTENT_LENGTH, hy::HeaderValue::from(len));
            }
            lease.reuse(body);
            return Ok(answer(status, headers, ProxyBody::Whole(None)));
        }
        let mut first = None;
        if length.is_some_and(|len| len <= WHOLE_BODY_MAX) {
            match Arrived::take(&mut body).map_err(upstream_failure)? {
                Arrived::Whole(data) => {
                    lease.reuse(body);
                    return Ok(answer(status, headers, ProxyBody::whole(data)));
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
        Ok(answer(status, headers, ProxyBody::Streamed(stream)))
    }
}

impl Forwarder {
    /// The upstream request for `req`: same method; the route's base path
    /// followed by the normalised path and the query as sent; the
    /// upstream's `Host`, the end-to-end headers, the limited `X-Api-Key`
    /// and `X-Forwarded-*`, and `TE: trailers` on a route that settles
    /// usage; the body read at the client read pace.
    fn upstream_request(
        &self,
        req: Request<Incoming>,
        client: &Client,
        target: Target<'_>,
        upstream: &Upstream,
    ) -> Result<(Outgoing, Rc<Upload>), ProxyError> {
        let (parts, payload) = req.into_parts();
        let forwarded = hop::Forwarded {
            peer: (client.peer.ip(), client.tls),
            tenant: target.tenant,
            // HTTP/2 carries the host in the URI (`:authority`), not in
            // `Host`.
            authority: parts.uri.authority().map(|a| a.as_str()),
            host: &upstream.host,
            trailers: target.route.spec.usage.is_some(),
        };
        let (body, upload) = RequestBody::new(payload, self.client.read, self.clock.clone());
        let framing = RequestFraming::of(body.size_hint().exact(), &parts.method);
        let mut head = Vec::with_capacity(head_size(&target.uri, &parts.headers, &forwarded));
        framing::write_head(
            &mut head,
            &parts.method,
            &target.uri,
            |out| hop::write_fields(out, &parts.headers, &forwarded),
            framing,
        )
        .map_err(upstream_failure)?;
        Ok((Outgoing::new(head, body, framing, &parts.method), upload))
    }
}

/// Room for a request head to `target` with the client's `headers` and
/// what the gateway adds to them: the request line, each header line, and
/// a framing header.
fn head_size(target: &str, headers: &HeaderMap, forwarded: &hop::Forwarded<'_>) -> usize {
    let lines: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    target.len() + lines + forwarded.added_len() + 64
}

/// An answer with `status`, `headers` and `body`.
fn answer(status: StatusCode, headers: HeaderMap, body: ProxyBody) -> Response<ProxyBody> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// A future polled in place by its owner that, when the owner drops it
/// unfinished, runs to its end in a task of its own on the current worker
/// (its output then dropped). Heap-pinned from the start, so that it can
/// move to that task once polled; cheaper than a task for every request,
/// which is what a client that stays costs.
struct Detachable<F: Future + 'static> {
    /// The future, until it has finished.
    future: Option<Pin<Box<F>>>,
}

impl<F: Future + 'static> Detachable<F> {
    /// `future`, to be polled in place.
    fn new(future: F) -> Self {
        Self {
            future: Some(Box::pin(future)),
        }
    }
}

impl<F: Future + 'static> Future for Detachable<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending;
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<F: Future + 'static> Drop for Detachable<F> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            tokio::task::spawn_local(async move {
                drop(future.await);
            });
        }
    }
}
