//! Answers given before a request's body was read, without breaking the
//! client's connection.
//!
//! Owns what happens to the unread body of a request refused early (405,
//! 400, 404, 401, 429, 413) on HTTP/1: a body of at most [`DRAIN_LIMIT`]
//! bytes that arrives within [`DRAIN_DEADLINE`] is read and thrown away
//! before the answer leaves, so the kept-alive connection serves the
//! client's next request; a longer or slower body, or one the client
//! waits to send until told to (`Expect: 100-continue`: no `100 Continue`
//! is sent), gets the answer with `Connection: close`, and the connection
//! closes gracefully ([`Lingering`]): the gateway stops writing and reads
//! and discards what the client still sends, for at most [`LINGER`] or
//! [`LINGER_LIMIT`] bytes, before it closes, so the client reads the
//! answer rather than a reset. On HTTP/2 nothing is needed: the stream
//! ends with the answer, the connection stays up.

use std::cell::Cell;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Incoming};
use hyper::header::{CONNECTION, EXPECT, HeaderValue};
use hyper::{Request, Response, Version};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::body::ProxyBody;

/// The most unread body read and discarded so that the connection stays
/// open.
pub(super) const DRAIN_LIMIT: u64 = 64 * 1024;

/// How long the rest of an unread body may take to arrive.
pub(super) const DRAIN_DEADLINE: Duration = Duration::from_millis(500);

/// How long a connection closed after an early answer keeps reading what
/// its client still sends.
pub(super) const LINGER: Duration = Duration::from_secs(2);

/// The most bytes read (and discarded) while lingering.
pub(super) const LINGER_LIMIT: usize = 1024 * 1024;

/// Whether a connection is to linger when it closes, shared by its
/// requests and its socket.
#[derive(Debug, Clone, Default)]
pub(super) struct LingerFlag(Rc<Cell<bool>>);

impl LingerFlag {
    /// The connection will close after an answer whose request body was
    /// not all read.
    fn set(&self) {
        self.0.set(true);
    }

    fn is_set(&self) -> bool {
        self.0.get()
    }
}

/// `response`, the early answer to `req`, once `req`'s unread body is
/// settled: read and thrown away when small and prompt, else the answer
/// says `Connection: close` and the connection is marked to linger.
pub(super) async fn answer(
    req: Request<Incoming>,
    response: Response<ProxyBody>,
    linger: &LingerFlag,
) -> Response<ProxyBody> {
    if req.version() == Version::HTTP_2 || req.body().is_end_stream() {
        return response;
    }
    // Boxed: only a request with a body left pays for the drain's
    // deadline and state, and every other early answer's future stays
    // small inside the request's.
    Box::pin(settle_body(req, response, linger)).await
}

/// [`answer`] for a request whose body is not all read.
async fn settle_body(
    req: Request<Incoming>,
    mut response: Response<ProxyBody>,
    linger: &LingerFlag,
) -> Response<ProxyBody> {
    let waits_to_send = req
        .headers()
        .get(EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let too_long = req.body().size_hint().lower() > DRAIN_LIMIT;
    let drained = !waits_to_send
        && !too_long
        && tokio::time::timeout(DRAIN_DEADLINE, drain(req.into_body()))
            .await
            .unwrap_or(false);
    if !drained {
        close(&mut response, linger);
    }
    response
}

/// Marks `response` as the connection's last, and the connection to linger.
pub(super) fn close(response: &mut Response<ProxyBody>, linger: &LingerFlag) {
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    linger.set();
}

/// Reads `body` to its end and throws it away; `false` when it breaks off
/// or passes [`DRAIN_LIMIT`].
async fn drain(mut body: Incoming) -> bool {
    let mut read: u64 = 0;
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        let Ok(frame) = frame else {
            return false;
        };
        if let Some(data) = frame.data_ref() {
            read += data.len() as u64;
            if read > DRAIN_LIMIT {
                return false;
            }
        }
    }
    true
}

/// A client socket that, when the connection is done with it after an
/// early answer ([`LingerFlag`]), is not closed at once: a task reads and
/// discards what the client still sends until it closes its side, for at
/// most [`LINGER`] and [`LINGER_LIMIT`] bytes. (Closing a socket with
/// unread data makes the kernel send a reset, which can destroy the
/// answer before the client reads it.)
pub(super) struct Lingering<I: AsyncRead + AsyncWrite + Unpin + 'static> {
    /// The socket; taken by the lingering task.
    io: Option<I>,
    /// Whether to linger.
    flag: LingerFlag,
}

impl<I: AsyncRead + AsyncWrite + Unpin + 'static> Lingering<I> {
    /// `io`, lingering on close when `flag` says so.
    pub(super) fn new(io: I, flag: LingerFlag) -> Self {
        Self { io: Some(io), flag }
    }

    fn io(&mut self) -> &mut I {
        // unwrap: taken only in drop.
        self.io.as_mut().expect("the socket until drop")
    }
}

impl<I: AsyncRead + AsyncWrite + Unpin + 'static> Drop for Lingering<I> {
    fn drop(&mut self) {
        let Some(mut io) = self.io.take().filter(|_| self.flag.is_set()) else {
            return;
        };
        actix_web::rt::spawn(async move {
            // The answer is written: say so (FIN), then read what comes.
            let _ = tokio::time::timeout(LINGER, io.shutdown()).await;
            let mut buf = vec![0u8; 16 * 1024];
            let mut read = 0;
            let discard = async {
                while read < LINGER_LIMIT {
                    match io.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => read += n,
                    }
                }
            };
            let _ = tokio::time::timeout(LINGER, discard).await;
        });
    }
}

impl<I: AsyncRead + AsyncWrite + Unpin + 'static> AsyncRead for Lingering<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(self.io()).poll_read(cx, buf)
    }
}

impl<I: AsyncRead + AsyncWrite + Unpin + 'static> AsyncWrite for Lingering<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(self.io()).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(self.io()).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(self.io()).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(self.io()).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(AsyncWrite::is_write_vectored)
    }
}
