//! How the listener speaks to a connection: HTTP/1.1 alone, or HTTP/2
//! beside it, with the header deadline and buffer bound, and what a served
//! connection can be asked (to finish, whether its error was a deadline).

use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};

/// Largest read and write buffer of one client connection: bounds a
/// request's head (a larger one is answered 431) and what a response whose
/// client reads slowly holds in memory.
const CLIENT_BUFFER: usize = 64 * 1024;

/// How often an HTTP/2 connection is pinged, and how long a ping may go
/// unanswered before the connection is closed.
const H2_PING_INTERVAL: Duration = Duration::from_secs(20);

/// How connections are spoken to: HTTP/1.1 alone, or either protocol
/// (with `server.h2c`, and always over TLS, where ALPN has chosen).
pub(super) enum Protocols {
    /// HTTP/1.1.
    Http1(http1::Builder),
    /// HTTP/2 after its preface, HTTP/1.1 otherwise.
    Auto(auto::Builder<LocalExec>),
}

impl Protocols {
    /// HTTP/1.1 with `header_timeout`, and HTTP/2 beside it when `http2`.
    pub(super) fn new(header_timeout: Duration, http2: bool) -> Self {
        if http2 {
            let mut auto = auto::Builder::new(LocalExec);
            auto.http1()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(CLIENT_BUFFER);
            // Pings find a peer that vanished without closing; an HTTP/2
            // connection has no header deadline to end it otherwise.
            auto.http2()
                .timer(TokioTimer::new())
                .keep_alive_interval(Some(H2_PING_INTERVAL))
                .keep_alive_timeout(H2_PING_INTERVAL);
            Self::Auto(auto)
        } else {
            let mut http1 = http1::Builder::new();
            http1
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(CLIENT_BUFFER);
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
