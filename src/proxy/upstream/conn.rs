//! One upstream HTTP/1.1 connection, driven by the request that uses it.
//!
//! Owns the socket (TCP, or TLS to an `https://` upstream), its read
//! buffer and one exchange at a time: [`Conn::send`] writes a request's
//! head and streams its body while watching for an early answer, and
//! returns the answer's head; `answer::UpstreamBody` then reads the body
//! from the same connection and gives the connection back once the body
//! has ended and nothing said to close it. No task and no channel stand
//! between a request and its connection: the request's own future does
//! the reading and writing.
//!
//! Invariants: a connection is given back only with an empty read buffer
//! (bytes beyond an answer mean the upstream and the gateway disagree on
//! framing); a request is sent again on a fresh connection only when
//! nothing of its body had been taken from the client and nothing of an
//! answer had come, and, when the request had been written whole, only
//! for an idempotent method (RFC 9110 §9.2.2).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use hyper::Method;
use hyper::body::Body;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::UPSTREAM_READ_BUFFER;
use super::framing::{self, Head, RequestFraming};
use crate::proxy::body::RequestBody;

/// Room made in the read buffer before a read, when less is left.
const READ_ROOM: usize = 8 * 1024;

/// Largest piece of a request body copied beside the head (or the chunk
/// framing) so that both go in one write; a larger one is written from
/// where it is.
const COPY_MAX: usize = 8 * 1024;

/// The socket under a connection.
pub(super) enum Io {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP. Boxed: its state is far larger than a socket.
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A request body as a connection sends it.
pub(super) trait Upload: Body<Data = Bytes, Error = io::Error> + Unpin {}

impl<B: Body<Data = Bytes, Error = io::Error> + Unpin> Upload for B {}

/// An open connection to an upstream.
pub(super) struct Conn {
    /// The socket.
    io: Io,
    /// What has been read and not yet taken.
    pub(super) buf: BytesMut,
}

/// Why an exchange failed, and whether the request may go again on
/// another connection.
pub(super) struct SendFailure {
    /// What failed.
    pub(super) error: io::Error,
    /// Whether the request may be sent again on a fresh connection.
    pub(super) retry: bool,
}

/// A request on its way: its head, written once, and its body (the
/// client's upload).
pub(super) struct Outgoing<B = RequestBody> {
    /// The request line and headers; once the body has started, also
    /// small pieces of it waiting to be written.
    head: Vec<u8>,
    /// The client's upload.
    body: B,
    /// How the body is framed.
    framing: RequestFraming,
    /// Whether the request is a HEAD (its answer has no body).
    head_request: bool,
    /// Whether the method may be repeated without harm.
    idempotent: bool,
    /// Whether anything of the body has been taken from the client: the
    /// request can then not be sent again.
    started: bool,
}

impl<B> Outgoing<B> {
    /// A request with `head` (written by [`framing::write_head`] with
    /// `framing`) for `method`, and `body`.
    pub(super) fn new(head: Vec<u8>, body: B, framing: RequestFraming, method: &Method) -> Self {
        Self {
            head,
            body,
            framing,
            head_request: *method == Method::HEAD,
            idempotent: method.is_idempotent(),
            started: false,
        }
    }
}

/// Where writing one request stands.
struct Writing {
    /// Bytes of `Outgoing::head` written.
    written: usize,
    /// A larger piece of the body, written after the head buffer.
    data: Option<Bytes>,
    /// Whether no chunk has been framed yet.
    first_chunk: bool,
    /// Whether the body has ended (its end framed, if chunked).
    body_done: bool,
    /// Whether bytes were written since the last flush.
    unflushed: bool,
    /// Whether the whole request has been written and flushed.
    sent: bool,
    /// Whether anything of an answer has been read.
    received: bool,
    /// Why the connection failed for writing: the answer may have come
    /// all the same (an upstream that answers early and closes), so it is
    /// read before this is the exchange's error.
    broken: Option<io::Error>,
}

/// Why a request could not be written.
enum Unwritten {
    /// The client's upload failed.
    Upload(io::Error),
    /// The connection failed.
    Socket(io::Error),
}

impl From<io::Error> for Unwritten {
    fn from(error: io::Error) -> Self {
        Self::Socket(error)
    }
}

impl Conn {
    /// A connection over `io`.
    pub(super) fn new(io: Io) -> Self {
        Self {
            io,
            buf: BytesMut::new(),
        }
    }

    /// Whether an idle connection may carry a request: not closed by the
    /// upstream and with nothing unasked for waiting in it.
    pub(super) fn is_open(&mut self) -> bool {
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        self.poll_fill(&mut cx).is_pending()
    }

    /// Reads more into the buffer; `Ok(0)` when the upstream has closed.
    pub(super) fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_ROOM / 8 {
            self.buf.reserve(READ_ROOM);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
    }

    /// Writes `request` and waits for its answer's head; an answer that
    /// comes before the body has been sent whole ends the sending (and
    /// the connection is then not kept).
    ///
    /// # Errors
    /// When the connection fails or the upstream closes it before an
    /// answer, when the answer is not HTTP/1.1 the gateway accepts, or
    /// when the client's upload fails (the caller learns which from the
    /// upload).
    pub(super) async fn send<B: Upload>(
        &mut self,
        request: &mut Outgoing<B>,
    ) -> Result<Head, SendFailure> {
        let mut writing = Writing {
            written: 0,
            data: None,
            first_chunk: true,
            body_done: request.framing == RequestFraming::Bodiless
                || request.body.is_end_stream() && request.framing != RequestFraming::Chunked,
            unflushed: false,
            sent: false,
            received: false,
            broken: None,
        };
        std::future::poll_fn(|cx| self.poll_send(cx, request, &mut writing)).await
    }

    /// Drives one exchange: writing as far as the socket and the client
    /// allow, then reading until the answer's head is whole.
    fn poll_send<B: Upload>(
        &mut self,
        cx: &mut Context<'_>,
        request: &mut Outgoing<B>,
        w: &mut Writing,
    ) -> Poll<Result<Head, SendFailure>> {
        if !w.sent && w.broken.is_none() {
            match self.poll_write_request(cx, request, w) {
                Poll::Ready(Err(Unwritten::Upload(error))) => {
                    return Poll::Ready(Err(fatal(error)));
                }
                Poll::Ready(Err(Unwritten::Socket(error))) => w.broken = Some(error),
                Poll::Ready(Ok(())) | Poll::Pending => {}
            }
        }
        loop {
            if !self.buf.is_empty() {
                match framing::parse_head(&mut self.buf, request.head_request, UPSTREAM_READ_BUFFER)
                {
                    Ok(Some(mut head)) => {
                        // Answered before the request was sent whole: what
                        // is left of it would be read as the next request.
                        head.keep_alive &= w.sent;
                        return Poll::Ready(Ok(head));
                    }
                    Ok(None) => {}
                    Err(e) => return Poll::Ready(Err(fatal(io::Error::other(e)))),
                }
            }
            match self.poll_fill(cx) {
                Poll::Ready(Ok(0)) => {
                    let retry = !request.started && !w.received && (!w.sent || request.idempotent);
                    let error = w.broken.take().unwrap_or_else(|| {
                        io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "upstream closed the connection before answering",
                        )
                    });
                    return Poll::Ready(Err(SendFailure { error, retry }));
                }
                Poll::Ready(Ok(_)) => w.received = true,
                Poll::Ready(Err(error)) => {
                    let retry = !request.started && !w.received && !w.sent;
                    let error = w.broken.take().unwrap_or(error);
                    return Poll::Ready(Err(SendFailure { error, retry }));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// Writes what of `request` is ready: the head, then the body as the
    /// client uploads it, framed. `Ready(Ok)` once all is written and
    /// flushed; `Pending` while the socket or the client holds it up.
    fn poll_write_request<B: Upload>(
        &mut self,
        cx: &mut Context<'_>,
        request: &mut Outgoing<B>,
        w: &mut Writing,
    ) -> Poll<Result<(), Unwritten>> {
        loop {
            // Take what the client has sent, while it is small enough to
            // go out with what is already waiting.
            let mut client_pending = false;
            while !w.body_done && w.data.is_none() && request.head.len() - w.written < COPY_MAX {
                let polled = Pin::new(&mut request.body).poll_frame(cx);
                // Whatever the client did, the request is now its own.
                request.started |= polled.is_ready();
                match polled {
                    Poll::Ready(Some(Ok(frame))) => {
                        if let Ok(data) = frame.into_data()
                            && !data.is_empty()
                        {
                            queue(request, w, data);
                        }
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(Unwritten::Upload(e))),
                    Poll::Ready(None) => {
                        if request.framing == RequestFraming::Chunked {
                            framing::chunked_end(&mut request.head, w.first_chunk);
                        }
                        w.body_done = true;
                    }
                    Poll::Pending => {
                        client_pending = true;
                        break;
                    }
                }
            }
            if w.written < request.head.len() {
                let n = std::task::ready!(
                    Pin::new(&mut self.io).poll_write(cx, &request.head[w.written..])
                )?;
                if n == 0 {
                    return Poll::Ready(Err(Unwritten::Socket(io::ErrorKind::WriteZero.into())));
                }
                w.written += n;
                w.unflushed = true;
                if w.written == request.head.len() && request.started {
                    // The head can no longer be sent again: its room holds
                    // the next pieces of the body.
                    request.head.clear();
                    w.written = 0;
                }
                continue;
            }
            if let Some(data) = w.data.as_mut() {
                let n = std::task::ready!(Pin::new(&mut self.io).poll_write(cx, data))?;
                if n == 0 {
                    return Poll::Ready(Err(Unwritten::Socket(io::ErrorKind::WriteZero.into())));
                }
                bytes::Buf::advance(data, n);
                if data.is_empty() {
                    w.data = None;
                }
                w.unflushed = true;
                continue;
            }
            if w.unflushed {
                std::task::ready!(Pin::new(&mut self.io).poll_flush(cx))?;
                w.unflushed = false;
            }
            if w.body_done {
                w.sent = true;
                return Poll::Ready(Ok(()));
            }
            if client_pending {
                return Poll::Pending;
            }
        }
    }
}

/// Queues `data`, a piece of `request`'s body, framed: copied beside what
/// waits when small, else kept to be written from where it is.
fn queue<B>(request: &mut Outgoing<B>, w: &mut Writing, data: Bytes) {
    if request.framing == RequestFraming::Chunked {
        framing::chunk_start(&mut request.head, data.len(), w.first_chunk);
        w.first_chunk = false;
    }
    if data.len() <= COPY_MAX {
        request.head.extend_from_slice(&data);
    } else {
        w.data = Some(data);
    }
}

/// A failure after which the request must not go again.
fn fatal(error: io::Error) -> SendFailure {
    SendFailure {
        error,
        retry: false,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::time::Duration;

    use hyper::HeaderMap;
    use hyper::body::Frame;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpListener;

    use super::super::answer::UpstreamBody;
    use super::*;

    /// A test upload: these pieces, then its end, or nothing more at all
    /// when it `hangs`.
    struct Pieces {
        left: VecDeque<Bytes>,
        hangs: bool,
    }

    impl Body for Pieces {
        type Data = Bytes;
        type Error = io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
            match self.left.pop_front() {
                Some(piece) => Poll::Ready(Some(Ok(Frame::data(piece)))),
                None if self.hangs => Poll::Pending,
                None => Poll::Ready(None),
            }
        }

        fn is_end_stream(&self) -> bool {
            self.left.is_empty() && !self.hangs
        }
    }

    /// A connection and the upstream's end of it.
    async fn pair() -> (Conn, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (Conn::new(Io::Plain(client)), server)
    }

    /// A request `method /p` whose upload is `pieces` framed as `framing`.
    fn request(
        method: Method,
        framing: RequestFraming,
        pieces: &[&[u8]],
        hangs: bool,
    ) -> Outgoing<Pieces> {
        let mut head = Vec::new();
        framing::write_head(&mut head, &method, "/p", |_| {}, framing).unwrap();
        let left = pieces.iter().map(|p| Bytes::copy_from_slice(p)).collect();
        Outgoing::new(head, Pieces { left, hangs }, framing, &method)
    }

    /// What the upstream reads up to and including `end`.
    async fn read_until(server: &mut TcpStream, end: &[u8]) -> Vec<u8> {
        let mut seen = Vec::new();
        while !seen.ends_with(end) {
            let mut byte = [0; 1];
            assert_eq!(server.read(&mut byte).await.unwrap(), 1, "{seen:?}");
            seen.push(byte[0]);
        }
        seen
    }

    /// Every data byte and the trailers of `body`, read to its end.
    async fn read_body(body: &mut UpstreamBody) -> (Vec<u8>, Option<HeaderMap>) {
        let (mut data, mut trailers) = (Vec::new(), None);
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await
        {
            match frame.unwrap().into_data() {
                Ok(piece) => data.extend_from_slice(&piece),
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        (data, trailers)
    }

    #[tokio::test]
    async fn a_connection_comes_back_after_its_body_and_carries_the_next_request() {
        let (mut conn, mut server) = pair().await;
        for round in 0..2 {
            let mut get = request(Method::GET, RequestFraming::Bodiless, &[], false);
            let head = conn.send(&mut get);
            let upstream = async {
                let seen = read_until(&mut server, b"\r\n\r\n").await;
                assert_eq!(seen, b"GET /p HTTP/1.1\r\n\r\n");
                server
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await
                    .unwrap();
            };
            let (head, ()) = tokio::join!(head, upstream);
            let head = head.map_err(|f| f.error).unwrap();
            let mut body = UpstreamBody::new(conn, &head);
            assert_eq!(read_body(&mut body).await.0, b"ok", "round {round}");
            conn = body.into_conn().expect("kept");
        }
    }

    #[tokio::test]
    async fn an_upload_is_chunked_and_an_answers_trailers_are_read() {
        let (mut conn, mut server) = pair().await;
        let large = vec![b'x'; 9000];
        let mut post = request(
            Method::POST,
            RequestFraming::Chunked,
            &[b"hello", &large],
            false,
        );
        let upstream = async {
            let seen = read_until(&mut server, b"\r\n0\r\n\r\n").await;
            let text = String::from_utf8(seen).unwrap();
            assert!(
                text.ends_with(&format!(
                    "\r\n\r\n5\r\nhello\r\n2328\r\n{}\r\n0\r\n\r\n",
                    "x".repeat(9000)
                )),
                "{}",
                &text[..100]
            );
            server
                .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            server.write_all(b"0\r\nX-Usage: 7\r\n\r\n").await.unwrap();
        };
        let (head, ()) = tokio::join!(conn.send(&mut post), upstream);
        let head = head.map_err(|f| f.error).unwrap();
        let mut body = UpstreamBody::new(conn, &head);
        let (data, trailers) = read_body(&mut body).await;
        assert_eq!(data, b"abc");
        assert_eq!(trailers.expect("trailers")["x-usage"], "7");
        assert!(body.into_conn().is_some(), "kept after its trailers");
    }

    #[tokio::test]
    async fn an_answer_before_the_upload_ends_is_taken_and_the_connection_not_kept() {
        let post = request(Method::POST, RequestFraming::Length(100), &[b"abc"], true);
        let answer = b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\n\r\n";
        let (conn, head) = exchanged(post, answer, false).await;
        let head = head.map_err(|f| f.error).unwrap();
        assert_eq!(head.status, 413);
        assert!(!head.keep_alive);
        assert!(UpstreamBody::new(conn, &head).into_conn().is_none());
    }

    #[tokio::test]
    async fn a_request_the_upstream_closed_on_goes_again_only_when_that_is_safe() {
        for (method, again) in [(Method::GET, true), (Method::POST, false)] {
            let (mut conn, mut server) = pair().await;
            let framing = RequestFraming::of(Some(0), &method);
            let mut sent = request(method.clone(), framing, &[], false);
            let upstream = async {
                read_until(&mut server, b"\r\n\r\n").await;
                drop(server);
            };
            let (failed, ()) = tokio::join!(conn.send(&mut sent), upstream);
            let failed = failed.expect_err("no answer");
            assert_eq!(failed.retry, again, "{method}");
        }
        // Nothing was sent yet: a closed idle connection is seen as such.
        let (mut conn, server) = pair().await;
        assert!(conn.is_open());
        drop(server);
        let mut waited = 0;
        while conn.is_open() && waited < 100 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            waited += 1;
        }
        assert!(!conn.is_open(), "the upstream's close is seen");
    }

    #[tokio::test]
    async fn an_early_answer_is_taken_though_the_upstream_closed_on_the_upload() {
        let large = vec![b'x'; 8 << 20];
        let framing = RequestFraming::Length(large.len() as u64);
        let post = request(Method::POST, framing, &[&large], false);
        // Closed with the upload unread: the gateway's next write fails.
        let answer = b"HTTP/1.1 413 Content Too Large\r\nConnection: close\r\n\r\n";
        let (_, head) = exchanged(post, answer, true).await;
        let head = head
            .map_err(|f| f.error)
            .expect("the answer, not the write's failure");
        assert_eq!(head.status, 413);
        assert!(!head.keep_alive);
    }

    /// Sends `request` on a fresh connection whose upstream, once it has
    /// read the head, sends `answer` and then closes, when `close`.
    async fn exchanged(
        mut request: Outgoing<Pieces>,
        answer: &[u8],
        close: bool,
    ) -> (Conn, Result<Head, SendFailure>) {
        let (mut conn, mut server) = pair().await;
        let upstream = async {
            read_until(&mut server, b"\r\n\r\n").await;
            server.write_all(answer).await.unwrap();
            if close {
                drop(server);
            }
        };
        let (head, ()) = tokio::join!(conn.send(&mut request), upstream);
        (conn, head)
    }

    /// The body of the answer to a GET on a fresh connection, which the
    /// upstream sends as `answer` and then closes, when `close`.
    async fn answered(answer: &[u8], close: bool) -> UpstreamBody {
        let get = request(Method::GET, RequestFraming::Bodiless, &[], false);
        let (conn, head) = exchanged(get, answer, close).await;
        let head = head.map_err(|f| f.error).unwrap();
        UpstreamBody::new(conn, &head)
    }

    #[tokio::test]
    async fn a_body_without_a_length_ends_with_the_connection() {
        let mut body = answered(b"HTTP/1.1 200 OK\r\n\r\nall of it", true).await;
        assert_eq!(read_body(&mut body).await.0, b"all of it");
        assert!(body.into_conn().is_none());
    }

    #[tokio::test]
    async fn bytes_past_an_answer_keep_its_connection_from_reuse() {
        let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n";
        let mut body = answered(answer, false).await;
        assert_eq!(read_body(&mut body).await.0, b"ok");
        assert!(body.into_conn().is_none());
    }
}
