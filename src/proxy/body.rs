//! Request and response bodies between a client and an upstream.
//!
//! Owns streaming in both directions, never waiting to buffer a whole
//! body, and the client deadlines on each: [`RequestBody`] reads the
//! client's upload as hyper asks for it and fails it when the client falls
//! behind `client.read_timeout_ms` / `client.min_bytes_per_second`,
//! recording that the client (not the upstream) was at fault;
//! [`ResponseBody`] streams the upstream's answer to the client, holding the
//! upstream connection and the tenant's slot until the body ends, and is
//! watched so that a client that stops reading loses both (see
//! [`super::stall`]). An answer whose body had wholly arrived with its
//! head ([`Arrived`]) skips the stream: the exchange with the upstream is
//! already over, and head and body are written together ([`ProxyBody`]).

use std::cell::Cell;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use tokio::sync::Notify;

use super::forward::Lease;
use super::stall::{Cut, Progress, Watch};
use crate::clock::SharedClock;
use crate::config::Pace;

/// How a client failed its upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClientFault {
    /// It fell behind the read pace.
    Slow,
    /// Its stream broke off (disconnect, bad framing).
    Broken,
}

/// What the forwarder learns about an upload while hyper sends it.
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

/// A request body for hyper: the client's upload, read as hyper asks for
/// it (back-pressure both ways), under the read pace.
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

    /// Records `fault` and ends the body with an error, so hyper abandons
    /// the exchange instead of finishing a cut-short body.
    fn fail(&mut self, fault: ClientFault) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
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

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
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

/// What a response holds while it streams: the upstream's body, the
/// connection (with its permit and slot) it arrives on, and a way to end
/// the client's connection.
pub(super) struct Held<L> {
    /// hyper's body: data frames, possibly trailers (dropped).
    pub(super) body: Incoming,
    /// Returned to its upstream when the body ends, dropped otherwise.
    pub(super) lease: L,
    /// Ends the client's connection.
    pub(super) client: ClientCut,
}

impl<L> Cut for Held<L> {
    /// Drops the upstream side (the body unread, so the connection closes)
    /// and ends the client's connection: stuck behind full buffers, it
    /// closes at once instead of when the client reads again or leaves.
    fn cut(self) {
        let Self {
            body,
            lease,
            client,
        } = self;
        drop((body, lease));
        client.cut();
    }
}

/// A way to end one client connection from outside the task serving it
/// (the watchdog's sweep), shared by that connection's requests.
#[derive(Clone, Default)]
pub(super) struct ClientCut(Rc<Notify>);

impl ClientCut {
    /// Resolves once the connection has been cut off; its task then drops
    /// the connection, which closes the socket.
    pub(super) async fn requested(&self) {
        self.0.notified().await;
    }

    /// Cuts the connection off.
    fn cut(&self) {
        self.0.notify_one();
    }
}

/// Where a finished exchange's connection goes.
pub(super) trait Reuse {
    /// Keeps the connection for a later request.
    fn reuse(self);
}

/// What of an upstream's response body had arrived when its head did.
pub(super) enum Arrived {
    /// All of it: the exchange with the upstream is over.
    Whole(Bytes),
    /// Not all of it: the first piece, if one had come.
    Part(Option<Bytes>),
}

impl Arrived {
    /// Takes from `body` what is already there, without waiting: a body
    /// that arrived with its head (the common case for small answers) is
    /// then answered in one piece, with no stream to drive or watch.
    ///
    /// # Errors
    /// The upstream's error, when the body failed before anything was sent.
    pub(super) fn take(body: &mut Incoming) -> Result<Self, hyper::Error> {
        use futures_util::FutureExt as _;
        if body.is_end_stream() {
            return Ok(Self::Whole(Bytes::new()));
        }
        let ready =
            futures_util::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).now_or_never();
        Ok(match ready {
            Some(Some(frame)) => match frame?.into_data() {
                Ok(data) if body.is_end_stream() => Self::Whole(data),
                Ok(data) => Self::Part(Some(data)),
                // Trailers are hop-level here: dropped, as when streaming.
                Err(_) => Self::Part(None),
            },
            Some(None) => Self::Whole(Bytes::new()),
            None => Self::Part(None),
        })
    }
}

/// The upstream's response body, streamed to the client under the write
/// pace: the worker's watchdog releases what it holds if the client stops
/// taking it.
pub(super) struct ResponseBody<L: Reuse> {
    /// The watched body and connection.
    watch: Watch<Held<L>>,
    /// What had arrived before streaming began, handed over first.
    first: Option<Bytes>,
    /// The body's length, when the upstream declared it.
    length: Option<u64>,
    /// Bytes handed to the connection by the last poll, not yet known
    /// taken.
    handed: Option<usize>,
    /// Whether the body has been read to the end.
    done: bool,
    /// Reads now.
    clock: SharedClock,
}

impl<L: Reuse> ResponseBody<L> {
    /// Streams `first`, then what `watch` holds: `length` bytes in all,
    /// when known.
    pub(super) fn new(
        watch: Watch<Held<L>>,
        first: Option<Bytes>,
        length: Option<u64>,
        clock: SharedClock,
    ) -> Self {
        Self {
            watch,
            first,
            length,
            handed: None,
            done: false,
            clock,
        }
    }
}

impl<L: Reuse> Body for ResponseBody<L> {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        let now = this.clock.now_ms();
        let mut progress = this.watch.progress();
        // Polled again: the client took what the last poll handed over.
        if let Some(bytes) = this.handed.take() {
            progress.moved(now, bytes);
        }
        let result = if let Some(data) = this.first.take() {
            this.handed = Some(data.len());
            progress.wait(now);
            Poll::Ready(Some(Ok(Frame::data(data))))
        } else {
            let mut held = this.watch.held();
            let Some(held) = held.as_mut() else {
                return Poll::Ready(Some(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "client stopped reading",
                ))));
            };
            loop {
                break match Pin::new(&mut held.body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(data) => {
                            this.handed = Some(data.len());
                            progress.wait(now);
                            Poll::Ready(Some(Ok(Frame::data(data))))
                        }
                        // Trailers are hop-level here: skip them.
                        Err(_) => continue,
                    },
                    Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(io::Error::other(e)))),
                    Poll::Ready(None) => {
                        this.done = true;
                        Poll::Ready(None)
                    }
                    Poll::Pending => Poll::Pending,
                };
            }
        };
        this.watch.set_progress(progress);
        result
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        self.length
            .map_or_else(SizeHint::default, SizeHint::with_exact)
    }
}

impl<L: Reuse> Drop for ResponseBody<L> {
    fn drop(&mut self) {
        if let Some(held) = self.watch.held().take()
            && (self.done || held.body.is_end_stream())
        {
            held.lease.reuse();
        }
    }
}

/// What the proxy answers with: a body in one piece (the gateway's own
/// answers, and upstream answers that arrived whole), an upstream's body
/// streamed as it comes, or a body followed by trailers (gRPC's status).
pub(super) enum ProxyBody {
    /// The whole body; `None` once handed over (or for no body).
    Whole(Option<Bytes>),
    /// The upstream's body, as it arrives.
    Streamed(ResponseBody<Lease>),
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

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
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
    /// It broke off.
    Broken(hyper::Error),
    /// It did not arrive in time.
    TimedOut,
}

/// The whole of a request body that may be at most `max` bytes and must
/// arrive within `timeout` (a check or a gRPC call: read into memory,
/// never streamed).
///
/// # Errors
/// When it is longer than `max`, breaks off, or is late.
pub(super) async fn read_small(
    mut body: Incoming,
    max: usize,
    timeout: Duration,
) -> Result<Vec<u8>, SmallBodyError> {
    let read = async {
        let mut data = Vec::new();
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
        {
            if let Ok(chunk) = frame.map_err(SmallBodyError::Broken)?.into_data() {
                if data.len() + chunk.len() > max {
                    return Err(SmallBodyError::TooLarge);
                }
                data.extend_from_slice(&chunk);
            }
        }
        Ok(data)
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or(Err(SmallBodyError::TimedOut))
}
