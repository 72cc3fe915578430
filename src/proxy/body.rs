//! Request and response bodies between a client and an upstream.
//!
//! Owns streaming in both directions, never waiting to buffer a whole
//! body, and the client deadlines on each: [`RequestBody`] reads the
//! client's upload as hyper asks for it and fails it when the client falls
//! behind `client.read_timeout_ms` / `client.min_bytes_per_second`,
//! recording that the client (not the upstream) was at fault;
//! [`ResponseBody`] streams the upstream's answer to actix, holding the
//! upstream connection and the tenant's slot until the body ends, and is
//! watched so that a client that stops reading loses both (see
//! [`super::stall`]). An answer whose body had wholly arrived with its
//! head ([`Arrived`]) skips the stream: the exchange with the upstream is
//! already over, and actix writes head and body together.

use std::cell::Cell;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::web;
use futures_util::Stream;
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};

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

/// A request body for hyper: the client's payload, read as hyper asks
/// for it (back-pressure both ways), under the read pace.
pub(super) struct RequestBody {
    /// The client's payload; `None` for a request without a body.
    payload: Option<web::Payload>,
    /// The declared length, when known.
    length: Option<u64>,
    /// Shared with the forwarder.
    upload: Rc<Upload>,
    /// Fires when the client's credit runs out during a wait.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Reads now.
    clock: SharedClock,
}

impl RequestBody {
    /// The body of a request framed as `length` (`None` without a body,
    /// `Some(None)` for chunked), read from `payload` at `pace`.
    pub(super) fn new(
        payload: web::Payload,
        length: Option<Option<u64>>,
        pace: Pace,
        clock: SharedClock,
    ) -> (Self, Rc<Upload>) {
        let upload = Rc::new(Upload {
            progress: Cell::new(Progress::new(pace)),
            fault: Cell::new(None),
        });
        let body = Self {
            length: length.map_or(Some(0), |declared| declared),
            payload: length.map(|_| payload),
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
        let polled = Pin::new(payload).poll_next(cx);
        let result = match polled {
            Poll::Ready(Some(Ok(chunk))) => {
                progress.moved(now, chunk.len());
                Poll::Ready(Some(Ok(Frame::data(chunk))))
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
            .map_or_else(SizeHint::default, SizeHint::with_exact)
    }
}

/// What a response holds while it streams: the upstream's body, the
/// connection (with its permit and slot) it arrives on, and a handle on
/// the client's socket.
pub(super) struct Held<L> {
    /// hyper's body: data frames, possibly trailers (dropped).
    pub(super) body: Incoming,
    /// Returned to its upstream when the body ends, dropped otherwise.
    pub(super) lease: L,
    /// The client's connection, when known.
    pub(super) client: Option<ClientSocket>,
}

impl<L> Cut for Held<L> {
    /// Drops the upstream side (the body unread, so the connection closes)
    /// and shuts the client's socket down: the client's connection, stuck
    /// behind full buffers, ends at once instead of when the client reads
    /// again or leaves.
    fn cut(self) {
        let Self {
            body,
            lease,
            client,
        } = self;
        drop((body, lease));
        if let Some(client) = client {
            client.shut_down();
        }
    }
}

/// A second handle on a client connection's socket (a duplicated file
/// descriptor, taken once per connection and kept with it), so that a
/// response can end the connection from outside actix's dispatcher.
#[derive(Clone)]
pub(crate) struct ClientSocket(Rc<std::net::TcpStream>);

impl ClientSocket {
    /// The handle of `conn`, the connection actix is about to serve, when it
    /// is a TCP socket that can be duplicated.
    pub(crate) fn of(conn: &dyn std::any::Any) -> Option<Self> {
        use std::os::fd::AsFd as _;
        let tcp = conn.downcast_ref::<actix_web::rt::net::TcpStream>()?;
        let fd = tcp.as_fd().try_clone_to_owned().ok()?;
        Some(Self(Rc::new(std::net::TcpStream::from(fd))))
    }

    /// Shuts both directions down; the dispatcher's next write fails and it
    /// drops the connection.
    fn shut_down(&self) {
        if let Err(e) = self.0.shutdown(std::net::Shutdown::Both) {
            tracing::debug!(error = %e, "Could not shut down a stalled client's connection.");
        }
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

/// The upstream's response body as a byte stream for actix, under the
/// write pace: the worker's watchdog releases what it holds if the client
/// stops taking it.
pub(super) struct ResponseBody<L: Reuse> {
    /// The watched body and connection.
    watch: Watch<Held<L>>,
    /// What had arrived before streaming began, handed over first.
    first: Option<Bytes>,
    /// Bytes handed to actix by the last poll, not yet known taken.
    handed: Option<usize>,
    /// Whether the body has been read to the end.
    done: bool,
    /// Reads now.
    clock: SharedClock,
}

impl<L: Reuse> ResponseBody<L> {
    /// Streams `first`, then what `watch` holds.
    pub(super) fn new(watch: Watch<Held<L>>, first: Option<Bytes>, clock: SharedClock) -> Self {
        Self {
            watch,
            first,
            handed: None,
            done: false,
            clock,
        }
    }
}

impl<L: Reuse> Stream for ResponseBody<L> {
    type Item = Result<Bytes, io::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
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
            Poll::Ready(Some(Ok(data)))
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
                            Poll::Ready(Some(Ok(data)))
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
