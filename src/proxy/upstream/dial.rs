//! Reaching an upstream: new connections (TCP, TLS for `https://`
//! upstreams, the HTTP/1.1 handshake), reuse of idle ones, and the
//! upstream timeout, which never counts time spent waiting on a slow
//! uploading client.

use std::error::Error as StdError;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::Either;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use super::{UPSTREAM_READ_BUFFER, Upstream};
use crate::clock::{SharedClock, millis};
use crate::proxy::body::{ClientFault, RequestBody, Upload};
use crate::proxy::error::ProxyError;

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
    /// Runs `exchange` under `upstream.timeout_ms`, not counting the time
    /// `upload` spent waiting on its client; a failed upload is the
    /// client's fault whatever hyper reports.
    ///
    /// The exchange is pinned by the caller, so that its future is stored
    /// once, in the caller's.
    pub(super) async fn bounded<T>(
        &self,
        mut exchange: Pin<&mut impl Future<Output = Result<T, ProxyError>>>,
        upload: &Upload,
    ) -> Result<T, ProxyError> {
        let started = self.clock.now_ms();
        let limit = millis(self.timeout);
        let mut wait = self.timeout;
        loop {
            match tokio::time::timeout(wait, exchange.as_mut()).await {
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
    pub(super) async fn exchange(
        &self,
        upstream: &Upstream,
        mut request: hyper::Request<RequestBody>,
    ) -> Result<(SendRequest<RequestBody>, hyper::Response<Incoming>), ProxyError> {
        loop {
            let (mut sender, reused) = match upstream.take_idle() {
                Some(sender) => (sender, true),
                // Boxed: a connection attempt (a TLS handshake's state
                // above all) is far larger than the rest of an exchange,
                // which its task moves whole; most exchanges reuse one.
                None => (Box::pin(self.connect(upstream)).await?, false),
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
pub(super) fn upstream_failure(e: impl StdError + Send + Sync + 'static) -> ProxyError {
    tracing::debug!(error = %e, "Upstream request failed.");
    ProxyError::UpstreamUnreachable(Box::new(e))
}
