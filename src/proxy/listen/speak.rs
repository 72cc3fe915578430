//! How the listener speaks to a connection: HTTP/1.1 alone, or HTTP/2
//! beside it, with the header deadline and buffer bound, HTTP/2's stream
//! cap and flow-control windows (what a connection may hold unread), how
//! an HTTP/2 connection is told from the rest ([`Sniffed`]), and what a
//! served connection can be asked (to finish, whether its error was a
//! deadline).

use std::cell::Cell;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;

use super::deadline::CoarseTimer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Largest read and write buffer of one client connection: bounds a
/// request's head (a larger one is answered 431) and what a response whose
/// client reads slowly holds in memory. An HTTP/1.1 response's body is
/// copied into it behind the head (`writev(false)`) rather than queued
/// beside it: most answers are small, and one plain write of one buffer
/// costs a request less than a vectored write of a queue of them.
const CLIENT_BUFFER: usize = 64 * 1024;

/// How often an HTTP/2 connection is pinged, and how long a ping may go
/// unanswered before the connection is closed.
const H2_PING_INTERVAL: Duration = Duration::from_secs(20);

/// The HTTP/2 connection preface a client opens with (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How much one HTTP/2 connection lets its client send ahead of what the
/// server has read: per stream, and for the whole connection. The bound
/// on what a connection holds unread, whatever its client does.
#[derive(Debug, Clone, Copy)]
pub(super) struct H2Windows {
    /// Each stream's initial window.
    pub(super) stream: u32,
    /// The connection's window.
    pub(super) connection: u32,
}

impl H2Windows {
    /// The proxy's: request bodies stream to the upstream, so a window is
    /// what waits while the upstream is slower than the client.
    pub(super) const PROXY: Self = Self {
        stream: 256 * 1024,
        connection: 512 * 1024,
    };

    /// The check's and the RLS's: bodies are small and read whole, so a
    /// stream's window holds one gRPC message (64 KiB; the rest follows
    /// as the server reads), and the connection's four.
    pub(super) const SMALL_BODIES: Self = Self {
        stream: 64 * 1024,
        connection: 256 * 1024,
    };
}

/// How connections are spoken to: HTTP/1.1 alone, or either protocol
/// (with `server.h2c`, and always over TLS, where ALPN has chosen).
pub(super) enum Protocols {
    /// HTTP/1.1.
    Http1(http1::Builder),
    /// HTTP/2 after its preface, HTTP/1.1 otherwise.
    Auto(auto::Builder<LocalExec>),
}

impl Protocols {
    /// HTTP/1.1 with `header_timeout`, and HTTP/2 beside it when `http2`,
    /// at most `max_streams` streams per connection, with `windows`.
    ///
    /// An HTTP/1.1 connection is read for requests only (`half_close`).
    /// Otherwise hyper reads it again while a request is served, to see
    /// whether the client went away: that takes a fresh read buffer for
    /// every request (the request still holds the one it was read into),
    /// and it drops the request of a client that shut its side of the
    /// connection once it had sent it, which then gets no answer. A request
    /// whose client went away is therefore served to the end and its
    /// answer dropped; its upstream exchange, once begun, would hold its
    /// slot until the answer's head in any case, and what a client leaves
    /// behind is bounded by its in-flight slots and the upstream's
    /// timeouts.
    pub(super) fn new(
        header_timeout: Duration,
        http2: bool,
        max_streams: u32,
        windows: H2Windows,
    ) -> Self {
        if http2 {
            let mut auto = auto::Builder::new(LocalExec);
            auto.http1()
                .timer(CoarseTimer)
                .header_read_timeout(header_timeout)
                .max_buf_size(CLIENT_BUFFER)
                .writev(false)
                .half_close(true);
            // Pings find a peer that vanished without closing; an HTTP/2
            // connection has no header deadline to end it otherwise.
            auto.http2()
                .timer(TokioTimer::new())
                .keep_alive_interval(Some(H2_PING_INTERVAL))
                .keep_alive_timeout(H2_PING_INTERVAL)
                .max_concurrent_streams(max_streams)
                .initial_stream_window_size(windows.stream)
                .initial_connection_window_size(windows.connection);
            Self::Auto(auto)
        } else {
            let mut http1 = http1::Builder::new();
            http1
                .timer(CoarseTimer)
                .header_read_timeout(header_timeout)
                .max_buf_size(CLIENT_BUFFER)
                .writev(false)
                .half_close(true);
            Self::Http1(http1)
        }
    }
}

/// Runs HTTP/2 streams on the current worker (they hold the worker's
/// `Rc`s, so they stay on its thread).
#[derive(Clone, Copy)]
pub(super) struct LocalExec;

impl<F: Future + 'static> hyper::rt::Executor<F> for LocalExec {
    fn execute(&self, future: F) {
        tokio::task::spawn_local(future);
    }
}

/// A served connection that can be asked to finish.
pub(super) trait Served: Future<Output = Result<(), Self::Error>> {
    /// What ends it badly.
    type Error: std::fmt::Display;

    /// Finishes the requests in flight, then ends.
    fn finish(self: std::pin::Pin<&mut Self>);

    /// Whether `error` is a deadline that ran out (an idle kept-alive
    /// connection ending), not client noise.
    fn timed_out(error: &Self::Error) -> bool;
}

impl<I, S> Served for http1::Connection<TokioIo<I>, S>
where
    I: AsyncRead + AsyncWrite + Unpin + 'static,
    S: hyper::service::HttpService<Incoming>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S::ResBody: 'static,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Error = hyper::Error;

    fn finish(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }

    fn timed_out(error: &hyper::Error) -> bool {
        error.is_timeout()
    }
}

impl<I, S, B> Served for auto::Connection<'_, TokioIo<I>, S, LocalExec>
where
    I: AsyncRead + AsyncWrite + Unpin + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>>,
    S::Future: 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    LocalExec: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn finish(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }

    fn timed_out(error: &Self::Error) -> bool {
        error
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_timeout)
    }
}

/// `io`, marking `h2` once its client has sent the whole HTTP/2 preface:
/// what tells an HTTP/2 connection (held to `client.h2_idle_timeout_ms`)
/// from one still to say anything (held to the header deadline).
pub(super) struct Sniffed<I> {
    /// The connection.
    io: I,
    /// Preface bytes matched so far; `None` once one differed.
    matched: Option<usize>,
    /// Set when the preface is complete.
    h2: Rc<Cell<bool>>,
}

impl<I> Sniffed<I> {
    /// `io`, its preface reported in `h2`.
    pub(super) fn new(io: I, h2: Rc<Cell<bool>>) -> Self {
        Self {
            io,
            matched: Some(0),
            h2,
        }
    }

    /// Follows the preface through `read`, the bytes just read.
    fn sniff(&mut self, read: &[u8]) {
        let Some(matched) = self.matched else {
            return;
        };
        let take = read.len().min(PREFACE.len() - matched);
        if read[..take] == PREFACE[matched..matched + take] {
            self.matched = Some(matched + take);
            if matched + take == PREFACE.len() {
                self.h2.set(true);
                self.matched = None;
            }
        } else {
            self.matched = None;
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Sniffed<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if self.matched.is_some() && buf.filled().len() > before {
            self.sniff(&buf.filled()[before..]);
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Sniffed<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preface_is_recognised_however_it_is_split() {
        for split in 1..PREFACE.len() {
            let h2 = Rc::new(Cell::new(false));
            let mut sniffed = Sniffed::new((), h2.clone());
            let mut sent = PREFACE.to_vec();
            sent.extend_from_slice(b"\0\0\0\x04");
            sniffed.sniff(&sent[..split]);
            assert!(!h2.get());
            sniffed.sniff(&sent[split..]);
            assert!(h2.get(), "split at {split}");
        }
        for other in [&b"GET / HTTP/1.1\r\n"[..], b"PRI * HTTP/1.1"] {
            let h2 = Rc::new(Cell::new(false));
            let mut sniffed = Sniffed::new((), h2.clone());
            sniffed.sniff(other);
            sniffed.sniff(&PREFACE[other.len().min(24)..]);
            assert!(!h2.get(), "{other:?}");
        }
    }
}
