//! Reaching an upstream: new connections (TCP, TLS for `https://`
//! upstreams), reuse of idle ones, and the
//! upstream timeout, which never counts time spent waiting on a slow
//! uploading client.

use std::error::Error as StdError;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::Upstream;
use super::conn::{Conn, Io, Outgoing};
use super::framing::Head;
use crate::clock::{SharedClock, millis};
use crate::proxy::body::{ClientFault, Upload};
use crate::proxy::error::ProxyError;
use crate::proxy::listen::deadline::Deadline;

/// What sending one exchange upstream needs: shared by a worker's
/// exchanges, each of which runs in a task of its own.
pub(super) struct Dialer {
    /// One permit per upstream connection this worker may use at once.
    pub(super) connections: Arc<Semaphore>,
    /// Bound on one connection attempt (TLS handshake included).
    pub(super) connect_timeout: Duration,
    /// Bound on waiting for a connection plus the upstream's response head,
    /// not counting time spent waiting on an uploading client.
    pub(super) timeout: Duration,
    /// Reads now for the timeout.
    pub(super) clock: SharedClock,
}

impl Dialer {
    /// Runs `exchange` under `upstream.timeout_ms` from `started` (the
    /// clock's milliseconds as the request set out), not counting the time
    /// `upload` spent waiting on its client; a failed upload is the
    /// client's fault whatever the connection reports.
    ///
    /// The exchange is pinned by the caller, so that its future is stored
    /// once, in the caller's.
    pub(super) async fn bounded<T>(
        &self,
        mut exchange: Pin<&mut impl Future<Output = Result<T, ProxyError>>>,
        upload: &Upload,
        started: u64,
    ) -> Result<T, ProxyError> {
        let limit = millis(self.timeout);
        // A coarse deadline: it almost never fires, and a timer of
        // tokio's costs a request more to arm and drop.
        let mut deadline = Deadline::after(self.timeout);
        loop {
            let ended = poll_fn(|cx| match exchange.as_mut().poll(cx) {
                Poll::Ready(result) => Poll::Ready(Some(result)),
                Poll::Pending => Pin::new(&mut deadline).poll(cx).map(|()| None),
            });
            if let Some(result) = ended.await {
                return result.map_err(|e| match upload.fault() {
                    Some(ClientFault::Slow) => ProxyError::ClientTimeout,
                    Some(ClientFault::Broken) => ProxyError::ClientAborted,
                    None => e,
                });
            }
            let now = self.clock.now_ms();
            let upstream_ms = now
                .saturating_sub(started)
                .saturating_sub(upload.waited(now));
            if upstream_ms >= limit {
                return Err(ProxyError::UpstreamTimeout);
            }
            deadline.reset(Instant::now() + Duration::from_millis(limit - upstream_ms));
        }
    }

    /// Sends `request` on an idle connection to `upstream`, or a new one,
    /// and waits for the answer's head. A request an idle connection
    /// could not take (the upstream had closed it) goes to the next one;
    /// idle connections are judged expired or not at `now_ms` (the clock's
    /// milliseconds as the exchange starts), then at a new reading after
    /// each failed attempt.
    pub(super) async fn exchange(
        &self,
        upstream: &Upstream,
        request: &mut Outgoing,
        mut now_ms: u64,
    ) -> Result<(Conn, Head), ProxyError> {
        loop {
            let (mut conn, reused) = match upstream.take_idle(now_ms) {
                Some(conn) => (conn, true),
                // Boxed: a connection attempt (a TLS handshake's state
                // above all) is far larger than the rest of an exchange,
                // which its task moves whole; most exchanges reuse one.
                None => (Box::pin(self.connect(upstream)).await?, false),
            };
            match conn.send(request).await {
                Ok(head) => return Ok((conn, head)),
                // The failed attempt took time of its own.
                Err(failure) if reused && failure.retry => now_ms = self.clock.now_ms(),
                Err(failure) => return Err(upstream_failure(failure.error)),
            }
        }
    }

    /// A new connection to `upstream` (over TLS for an `https://` one).
    async fn connect(&self, upstream: &Upstream) -> Result<Conn, ProxyError> {
        let opened = async {
            let stream = TcpStream::connect(&upstream.address).await?;
            stream.set_nodelay(true)?;
            std::io::Result::Ok(match &upstream.tls {
                Some(tls) => Io::Tls(Box::new(tls.connect(stream).await?)),
                None => Io::Plain(stream),
            })
        };
        let io = tokio::time::timeout(self.connect_timeout, opened)
            .await
            .map_err(|_| ProxyError::UpstreamTimeout)?
            .map_err(upstream_failure)?;
        Ok(Conn::new(io))
    }
}

/// Maps a connection-level failure to 502.
pub(super) fn upstream_failure(e: impl StdError + Send + Sync + 'static) -> ProxyError {
    tracing::debug!(error = %e, "Upstream request failed.");
    ProxyError::UpstreamUnreachable(Box::new(e))
}
