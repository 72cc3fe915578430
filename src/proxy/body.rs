//! Bodies between a client and the gateway.
//!
//! Owns the client's upload and the answer type: [`RequestBody`] reads the
//! client's upload as the upstream connection asks for it, never buffering
//! it whole, and fails it when the client falls behind
//! `client.read_timeout_ms` / `client.min_bytes_per_second`, recording that
//! the client (not the upstream) was at fault; [`read_small`] reads the small bodies the check
//! and gRPC entries decide on; [`ProxyBody`] is every answer, in one piece,
//! with trailers, or an upstream's body streamed as it arrives (see
//! [`super::upstream`]).

use std::cell::Cell;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};

use super::budget::{Budget, Taken};
use super::listen::stall::Progress;
use super::upstream::ResponseBody;
use crate::clock::SharedClock;
use crate::config::Pace;

/// What polling a body for its next frame gives.
pub(super) type Polled = Poll<Option<Result<Frame<Bytes>, io::Error>>>;

/// How a client failed its upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClientFault {
    /// It fell behind the read pace.
    Slow,
    /// Its stream broke off (disconnect, bad framing).
    Broken,
}

/// What the forwarder learns about an upload while it is sent.
pub(super) struct Upload {
    /// The upload's credit, and the time it waited on the client.
    progress: Cell<Progress>,
    /// Why the client failed the upload, if it did.
    fault: Cell<Option<ClientFault>>,
}

impl Upload {
    /// Why the client failed the upload, if it did.
    pub(super) fn fault(&self) -> Option<ClientFault> {
        self.fault.get()
    }

    /// Time the upload has spent waiting on the client up to `now`.
    pub(super) fn waited(&self, now: u64) -> u64 {
        self.progress.get().waited(now)
    }
}

/// A request body on its way upstream: the client's upload, read as the
/// upstream connection asks for it (back-pressure both ways), under the
/// read pace.
pub(super) struct RequestBody {
    /// The client's upload; `None` once it has ended or failed.
    payload: Option<Incoming>,
    /// The upload's size as the client framed it.
    length: SizeHint,
    /// Shared with the forwarder.
    upload: Rc<Upload>,
    /// Fires when the client's credit runs out during a wait.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Reads now.
    clock: SharedClock,
}

impl RequestBody {
    /// The body of a request, read from `payload` at `pace`.
    pub(super) fn new(payload: Incoming, pace: Pace, clock: SharedClock) -> (Self, Rc<Upload>) {
        let upload = Rc::new(Upload {
            progress: Cell::new(Progress::new(pace)),
            fault: Cell::new(None),
        });
        let body = Self {
            length: payload.size_hint(),
            payload: (!payload.is_end_stream()).then_some(payload),
            upload: upload.clone(),
            timer: None,
            clock,
        };
        (body, upload)
    }

    /// Records `fault` and ends the body with an error, so the exchange
    /// is abandoned instead of finishing a cut-short body.
    fn fail(&mut self, fault: ClientFault) -> Polled {
        self.upload.fault.set(Some(fault));
        self.payload = None;
        let kind = match fault {
            ClientFault::Slow => io::ErrorKind::TimedOut,
            ClientFault::Broken => io::ErrorKind::UnexpectedEof,
        };
        Poll::Ready(Some(Err(io::Error::new(kind, "client upload failed"))))
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let this = self.get_mut();
        let Some(payload) = this.payload.as_mut() else {
            return Poll::Ready(None);
        };
        let now = this.clock.now_ms();
        let mut progress = this.upload.progress.get();
        let polled = Pin::new(payload).poll_frame(cx);
        let result = match polled {
            Poll::Ready(Some(Ok(frame))) => {
                let moved = frame.data_ref().map_or(0, Bytes::len);
                progress.moved(now, moved);
                // The client's trailers are hop-level here: dropped.
                match frame.into_data() {
                    Ok(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                    Err(_) => {
                        this.payload = None;
                        Poll::Ready(None)
                    }
                }
            }
            Poll::Ready(None) => {
                progress.moved(now, 0);
                this.payload = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(_))) => {
                this.upload.progress.set(progress);
                return this.fail(ClientFault::Broken);
            }
            Poll::Pending => {
                progress.wait(now);
                match progress.deadline() {
                    Some(deadline) if now > deadline => {
                        this.upload.progress.set(progress);
                        return this.fail(ClientFault::Slow);
                    }
                    Some(deadline) => {
                        let at =
                            tokio::time::Instant::now() + Duration::from_millis(deadline - now + 1);
                        let timer = this
                            .timer
                            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                        timer.as_mut().reset(at);
                        if timer.as_mut().poll(cx).is_ready() {
                            this.upload.progress.set(progress);
                            return this.fail(ClientFault::Slow);
                        }
                    }
                    None => {}
                }
                Poll::Pending
            }
        };
        this.upload.progress.set(progress);
        result
    }

    fn is_end_stream(&self) -> bool {
        self.payload.is_none() && self.upload.fault.get().is_none()
    }

    fn size_hint(&self) -> SizeHint {
        self.length
    }
}

/// What the proxy answers with: a body in one piece (the gateway's own
/// answers, and upstream answers that arrived whole), an upstream's body
/// streamed as it comes, or a body followed by trailers (gRPC's status).
pub(super) enum ProxyBody {
    /// The whole body; `None` once handed over (or for no body).
    Whole(Option<Bytes>),
    /// The upstream's body, as it arrives.
    Streamed(ResponseBody),
    /// A body in one piece, then trailers; each `None` once handed over.
    Trailed(Option<Bytes>, Option<hyper::HeaderMap>),
}

impl ProxyBody {
    /// A body of `data`, in one piece.
    pub(super) fn whole(data: Bytes) -> Self {
        Self::Whole((!data.is_empty()).then_some(data))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        match self.get_mut() {
            Self::Whole(data) => Poll::Ready(data.take().map(|data| Ok(Frame::data(data)))),
            Self::Streamed(body) => Pin::new(body).poll_frame(cx),
            Self::Trailed(data, trailers) => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Whole(data) => data.is_none(),
            Self::Streamed(body) => body.is_end_stream(),
            Self::Trailed(data, trailers) => data.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Whole(data) | Self::Trailed(data, _) => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Self::Streamed(body) => body.size_hint(),
        }
    }
}

/// Why a small request body was not read whole.
#[derive(Debug)]
pub(super) enum SmallBodyError {
    /// It is longer than allowed.
    TooLarge,
    /// It broke off (the cause is logged at debug level, never sent).
    Broken,
    /// It did not arrive in time.
    TimedOut,
}

/// Room taken from the budget before each read of a body read whole: an
/// HTTP/2 frame at most (16 KiB by default).
const READ_AHEAD: usize = 16 * 1024;

/// A request body read whole, holding its bytes of the budget until
/// dropped.
pub(super) struct SmallBody {
    /// The body.
    data: Vec<u8>,
    /// Its bytes of the connection's and the process's budget.
    _held: Taken,
}

impl std::ops::Deref for SmallBody {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.data
    }
}

/// The whole of a request body that may be at most `max` bytes and must
/// arrive within `timeout` (a check or a gRPC call: read into memory,
/// never streamed), each chunk counted against `budget` before it is
/// kept (a stream out of budget is not read meanwhile; the wait counts
/// against `timeout`).
///
/// # Errors
/// When it is longer than `max`, breaks off, or is late.
pub(super) async fn read_small(
    mut body: Incoming,
    max: usize,
    timeout: Duration,
    budget: &Budget,
) -> Result<SmallBody, SmallBodyError> {
    let read = async {
        let mut data = Vec::new();
        let mut held = Taken::default();
        loop {
            // Room for the next frame before it is read: a stream out of
            // budget is not read, so its sender stalls under flow control.
            budget
                .room(&mut held, data.len() + READ_AHEAD.min(max - data.len()))
                .await;
            let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
            else {
                break;
            };
            let frame = frame.map_err(|e| {
                tracing::debug!(error = %e, "A request body broke off.");
                SmallBodyError::Broken
            })?;
            if let Ok(chunk) = frame.into_data() {
                if data.len() + chunk.len() > max {
                    return Err(SmallBodyError::TooLarge);
                }
                // Exactly what is kept is held (a chunk larger than the
                // room, an HTTP/1 read, is covered first).
                budget.keep(&mut held, data.len() + chunk.len()).await;
                data.reserve_exact(chunk.len());
                data.extend_from_slice(&chunk);
            }
        }
        budget.keep(&mut held, data.len()).await;
        Ok(SmallBody { data, _held: held })
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or(Err(SmallBodyError::TimedOut))
}
