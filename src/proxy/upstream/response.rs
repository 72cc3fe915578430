//! An upstream's answer on its way to the client.
//!
//! Owns what a streamed answer holds ([`Held`]: the upstream's body on its
//! connection, the [`Lease`] with its permit and the tenant's slot, and a way to
//! cut the client off), the part of a body that arrived with its head
//! ([`Arrived`]), and [`ResponseBody`], which streams the rest under the
//! client's write pace and gives the connection back when the body ends.

use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use hyper::body::{Body, Bytes, Frame, SizeHint};
use tokio::sync::OwnedSemaphorePermit;

use super::Upstream;
use super::answer::UpstreamBody;
use crate::clock::SharedClock;
use crate::proxy::body::Polled;
use crate::proxy::client::ClientCut;
use crate::proxy::listen::stall::{Cut, Watch};
use crate::proxy::slots::Slot;
use crate::proxy::usage::Settlement;

/// What a response holds while it streams: the upstream's body, the
/// connection (with its permit and slot) it arrives on, and a way to end
/// the client's connection.
pub(super) struct Held {
    /// The upstream's body: data frames, possibly trailers.
    pub(super) body: UpstreamBody,
    /// Returned to its upstream when the body ends, dropped otherwise.
    pub(super) lease: Lease,
    /// Ends the client's connection.
    pub(super) client: ClientCut,
}

impl Cut for Held {
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
    pub(super) fn take(body: &mut UpstreamBody) -> Result<Self, io::Error> {
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
pub(in crate::proxy) struct ResponseBody {
    /// The watched body and connection.
    watch: Watch<Held>,
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
    /// On a `usage_header` route whose answer's head reported no usage:
    /// settled from the trailers, if they report it.
    /// Boxed: most answers carry none.
    usage: Option<Box<Settlement>>,
}

impl ResponseBody {
    /// Streams `first`, then what `watch` holds: `length` bytes in all,
    /// when known.
    pub(super) fn new(
        watch: Watch<Held>,
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
            usage: None,
        }
    }

    /// Settles `usage` from the trailers, should they report it.
    pub(in crate::proxy) fn settle_from_trailers(&mut self, usage: Settlement) {
        self.usage = Some(Box::new(usage));
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
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
                        // Trailers are hop-level here: read for the usage
                        // they may report, then skipped.
                        Err(frame) => {
                            if let Some(usage) = this.usage.take()
                                && let Some(trailers) = frame.trailers_ref()
                            {
                                this.usage = usage.settle_from(trailers).map(Box::new);
                            }
                            continue;
                        }
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

impl Drop for ResponseBody {
    fn drop(&mut self) {
        if let Some(held) = self.watch.held().take() {
            held.lease.reuse(held.body);
        }
    }
}

/// What one exchange holds until its answer's body has been read: its
/// connection goes back to its upstream's idle list then.
pub(in crate::proxy) struct Lease {
    /// Where the connection goes back to.
    pub(super) upstream: Rc<Upstream>,
    /// Counts against the worker's connection cap while in use.
    pub(super) _permit: OwnedSemaphorePermit,
    /// Counts against the tenant's bound while in use.
    pub(super) _slot: Slot,
}

impl Lease {
    /// Keeps `body`'s connection for a later request when the body has
    /// been read to its end and nothing said to close it.
    pub(super) fn reuse(self, body: UpstreamBody) {
        if let Some(conn) = body.into_conn() {
            self.upstream.keep(conn);
        }
    }
}
