//! The proxy listener: worker threads, client connections and shutdown.
//!
//! Owns serving. Each worker is an actix arbiter (one thread running one
//! single-threaded runtime), so that the worker's bucket-client actor, its
//! upstream connections and its client connections share a thread and
//! their messages never cross one. Every worker accepts from each listening
//! socket (the proxy's, and Envoy's rate limit service and the HTTP check
//! when served: each connection is its socket's [`Entry`]) and serves each
//! connection as HTTP/1.1 (hyper), or
//! also HTTP/2 (cleartext with `server.h2c`; over TLS, as ALPN chooses),
//! with:
//! - a header deadline (`client.header_timeout_ms`): a TLS handshake, a
//!   request's line and
//!   headers, and on a kept-alive connection the next request, must arrive
//!   within it, or the connection is closed;
//! - a cut-off from outside: the watchdog ends the connection of a client
//!   that stopped reading its response (`ClientCut`; on HTTP/2 only the
//!   stream is reset, the connection's other streams go on);
//! - graceful shutdown: [`ProxyServer::stop`] stops accepting, closes idle
//!   connections, lets requests in flight finish within the grace period,
//!   then drops what is left.
//!
//! A connection that ends in an error (a malformed request, a client gone
//! mid-request) is client noise: counted, and logged one by one only at
//! `debug`.

use std::cell::Cell;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::pin;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use actix::Arbiter;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, oneshot, watch};

use super::Worker;
use super::body::ClientCut;
use super::early::{LingerFlag, Lingering};
use super::speak::{Protocols, Served};
use crate::telemetry::{self, Entry};
use crate::tls::ListenerTls;

/// Pause after a failed accept (out of file descriptors, say) before the
/// next attempt.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// How the proxy listener serves.
#[derive(Debug, Clone)]
pub struct Serving {
    /// Worker threads (at least one).
    pub workers: usize,
    /// Longest wait for a request's line and headers.
    pub header_timeout: Duration,
    /// How long requests in flight may take to finish on shutdown.
    pub grace: Duration,
    /// Cleartext HTTP/2 (prior knowledge) beside HTTP/1.1.
    pub h2c: bool,
    /// TLS on every connection (HTTP/2 or HTTP/1.1 by ALPN), when set.
    pub tls: Option<Arc<ListenerTls>>,
}

/// A client connection, as its requests see it.
pub(super) struct Client {
    /// The client's address (`X-Forwarded-For`).
    pub(super) peer: SocketAddr,
    /// Whether the client came over TLS (`X-Forwarded-Proto`).
    pub(super) tls: bool,
    /// Ends the connection from outside its task.
    cut: ClientCut,
    /// Set when an answer leaves the request's body unread: the socket
    /// then lingers when the connection closes.
    pub(super) linger: LingerFlag,
}

impl Client {
    /// What ends a response of a request in `version` whose client stops
    /// reading: the connection for HTTP/1, nothing more than the stream
    /// for HTTP/2 (its body ends in an error, which resets the stream),
    /// whose other streams share the connection.
    pub(super) fn cut_for(&self, version: hyper::Version) -> ClientCut {
        if version == hyper::Version::HTTP_2 {
            ClientCut::default()
        } else {
            self.cut.clone()
        }
    }
}

/// A running proxy listener.
pub struct ProxyServer {
    /// Turns `true` to stop.
    stop: watch::Sender<bool>,
    /// One per worker: resolves when it has no connection left.
    drained: Vec<oneshot::Receiver<()>>,
    /// The worker threads.
    arbiters: Vec<Arbiter>,
    /// Grace period for requests in flight on shutdown.
    grace: Duration,
}

impl ProxyServer {
    /// Serves every socket of `listening` on `serving.workers` threads,
    /// each connection as its socket's [`Entry`]; each worker builds its
    /// [`Worker`] with `make_worker`, on its own thread.
    ///
    /// # Errors
    /// When a listening socket cannot be shared with the workers or a
    /// worker thread cannot start.
    pub fn start<F>(
        listening: Vec<(std::net::TcpListener, Entry)>,
        serving: Serving,
        make_worker: F,
    ) -> std::io::Result<Self>
    where
        F: Fn() -> Worker + Send + Sync + 'static,
    {
        for (socket, _) in &listening {
            socket.set_nonblocking(true)?;
        }
        let make_worker = Arc::new(make_worker);
        let (stop, _) = watch::channel(false);
        let mut drained = Vec::new();
        let mut arbiters = Vec::new();
        for _ in 0..serving.workers.max(1) {
            let sockets = listening
                .iter()
                .map(|(socket, entry)| Ok((socket.try_clone()?, *entry)))
                .collect::<std::io::Result<Vec<_>>>()?;
            let (done, worker_drained) = oneshot::channel();
            let (make_worker, stop) = (make_worker.clone(), stop.subscribe());
            let serving = serving.clone();
            let arbiter = Arbiter::new();
            let started = arbiter.spawn_fn(move || {
                // On the worker's thread: what it builds stays there.
                tokio::task::spawn_local(async move {
                    let worker = Rc::new(make_worker());
                    let open = Rc::new(Open::default());
                    let loops = sockets.into_iter().map(|(socket, entry)| {
                        let listening = Listening::new(entry, &serving);
                        accept(
                            socket,
                            listening,
                            worker.clone(),
                            open.clone(),
                            stop.clone(),
                        )
                    });
                    futures_util::future::join_all(loops).await;
                    open.drained().await;
                    let _ = done.send(());
                });
            });
            if !started {
                return Err(std::io::Error::other("a proxy worker thread did not start"));
            }
            drained.push(worker_drained);
            arbiters.push(arbiter);
        }
        Ok(Self {
            stop,
            drained,
            arbiters,
            grace: serving.grace,
        })
    }

    /// Stops accepting, closes idle connections, waits up to the grace
    /// period for requests in flight to finish, then stops the workers
    /// (dropping any connection left).
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let drained = async {
            for worker in self.drained {
                let _ = worker.await;
            }
        };
        if tokio::time::timeout(self.grace, drained).await.is_err() {
            tracing::warn!(
                grace_seconds = self.grace.as_secs(),
                "Requests still in flight at the end of the grace period were dropped."
            );
        }
        for arbiter in self.arbiters {
            arbiter.stop();
        }
    }
}

/// How one listening socket's connections are served.
struct Listening {
    /// What its requests are.
    entry: Entry,
    /// Protocol settings.
    http: Rc<Protocols>,
    /// TLS, when this socket has it (the proxy's, when configured).
    tls: Option<Arc<ListenerTls>>,
    /// Longest wait for a client's TLS handshake.
    handshake_timeout: Duration,
}

impl Listening {
    /// The proxy's socket speaks as `serving` says; the others speak
    /// HTTP/1.1 and cleartext HTTP/2 (gRPC needs it), without TLS.
    fn new(entry: Entry, serving: &Serving) -> Self {
        let tls = if entry == Entry::Proxy {
            serving.tls.clone()
        } else {
            None
        };
        let h2c = serving.h2c || entry != Entry::Proxy;
        Self {
            entry,
            http: Rc::new(Protocols::new(serving.header_timeout, h2c || tls.is_some())),
            tls,
            handshake_timeout: serving.header_timeout,
        }
    }
}

/// One worker's accept loop on `socket`, until `stop`.
async fn accept(
    socket: std::net::TcpListener,
    listening: Listening,
    worker: Rc<Worker>,
    open: Rc<Open>,
    mut stop: watch::Receiver<bool>,
) {
    let listener = match TcpListener::from_std(socket) {
        Ok(listener) => listener,
        Err(e) => {
            tracing::error!(error = %e, "A proxy worker cannot use a listening socket.");
            return;
        }
    };
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stop.wait_for(|stopping| *stopping) => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let connection = Connection {
                    worker: worker.clone(),
                    entry: listening.entry,
                    http: listening.http.clone(),
                    tls: listening.tls.clone(),
                    handshake_timeout: listening.handshake_timeout,
                    stop: stop.clone(),
                    _open: Open::enter(&open),
                };
                tokio::task::spawn_local(connection.serve(stream, peer));
            }
            Err(e) => {
                tracing::warn!(error = %e, "Accepting a client connection failed.");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// What one client connection's task needs.
struct Connection {
    /// Handles its requests.
    worker: Rc<Worker>,
    /// What its requests are.
    entry: Entry,
    /// Protocol settings.
    http: Rc<Protocols>,
    /// TLS, when the listener has it.
    tls: Option<Arc<ListenerTls>>,
    /// Longest wait for a client's TLS handshake.
    handshake_timeout: Duration,
    /// Turns `true` on shutdown.
    stop: watch::Receiver<bool>,
    /// Counts the connection as open until it ends.
    _open: OpenGuard,
}

impl Connection {
    /// Serves `stream` from `peer` until the client or the server ends it,
    /// the watchdog cuts it off, or shutdown has let its last request
    /// finish.
    async fn serve(self, stream: TcpStream, peer: SocketAddr) {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "Cannot set TCP_NODELAY on a client connection.");
        }
        let Some(tls) = self.tls.clone() else {
            return self.speak(stream, peer, false).await;
        };
        // A client that stalls its handshake is closed like one that
        // stalls its request's head.
        let handshake = tls.acceptor().accept(stream);
        match tokio::time::timeout(self.handshake_timeout, handshake).await {
            Ok(Ok(stream)) => self.speak(stream, peer, true).await,
            Ok(Err(e)) => ended_in_error(&e, peer),
            Err(_) => {}
        }
    }

    /// Speaks HTTP on `stream` (over TLS when `tls`) to `peer`.
    async fn speak<I>(self, stream: I, peer: SocketAddr, tls: bool)
    where
        I: AsyncRead + AsyncWrite + Unpin + 'static,
    {
        let cut = ClientCut::default();
        let linger = LingerFlag::default();
        let client = Rc::new(Client {
            peer,
            tls,
            cut: cut.clone(),
            linger: linger.clone(),
        });
        let (worker, entry) = (self.worker, self.entry);
        // HTTP/1 alone has its header deadline from the first byte; only a
        // connection whose protocol is still to be chosen needs this one.
        let first = matches!(*self.http, Protocols::Auto(_)).then(|| FirstRequest {
            within: self.handshake_timeout,
            asked: Rc::new(Cell::new(false)),
        });
        let asked = first.as_ref().map(|f| f.asked.clone());
        let service = service_fn(move |req| {
            if let Some(asked) = &asked {
                asked.set(true);
            }
            let (client, worker) = (client.clone(), worker.clone());
            async move { Ok::<_, Infallible>(super::handle(entry, req, &client, &worker).await) }
        });
        let io = TokioIo::new(Lingering::new(stream, linger));
        match &*self.http {
            Protocols::Http1(http1) => {
                drive(
                    pin!(http1.serve_connection(io, service)),
                    &cut,
                    self.stop,
                    peer,
                    first,
                )
                .await;
            }
            Protocols::Auto(auto) => {
                drive(
                    pin!(auto.serve_connection(io, service)),
                    &cut,
                    self.stop,
                    peer,
                    first,
                )
                .await;
            }
        }
    }
}

/// The deadline for a connection's first request: until one has begun,
/// nothing else bounds a client that sends nothing after its TLS handshake,
/// or only part of the HTTP/2 preface (the protocol is not yet chosen, so
/// HTTP/1's header deadline does not run), or an HTTP/2 connection that
/// never opens a stream.
struct FirstRequest {
    /// How long the client has (the header deadline).
    within: Duration,
    /// Set when the first request's head has arrived.
    asked: Rc<Cell<bool>>,
}

/// Drives `conn` until it ends, the watchdog cuts it off (`cut`), no
/// request has begun by the `first` deadline (when there is one), or
/// shutdown (`stop`) has let its requests in flight finish.
async fn drive<C: Served>(
    mut conn: std::pin::Pin<&mut C>,
    cut: &ClientCut,
    mut stop: watch::Receiver<bool>,
    peer: SocketAddr,
    first: Option<FirstRequest>,
) {
    let mut stopping = false;
    // Never polled (so never armed) without a first-request deadline.
    let first_deadline = tokio::time::sleep(first.as_ref().map_or(Duration::ZERO, |f| f.within));
    tokio::pin!(first_deadline);
    let mut awaiting_first = first.is_some();
    loop {
        tokio::select! {
            biased;
            () = &mut first_deadline, if awaiting_first => {
                if first.as_ref().is_some_and(|f| !f.asked.get()) {
                    return;
                }
                awaiting_first = false;
            }
            served = conn.as_mut() => {
                if let Err(e) = served
                    && !C::timed_out(&e)
                {
                    ended_in_error(&e, peer);
                }
                return;
            }
            () = cut.requested() => return,
            _ = stop.wait_for(|stopping| *stopping), if !stopping => {
                stopping = true;
                conn.as_mut().finish();
            }
        }
    }
}

/// Records a connection that ended in `error` (a header deadline that ran
/// out is not noise: it is also how an idle kept-alive connection ends).
fn ended_in_error(error: &dyn std::fmt::Display, peer: SocketAddr) {
    telemetry::count_client_noise();
    tracing::debug!(error = %error, %peer, "A client connection ended in an error.");
}

/// One worker's open connections.
#[derive(Default)]
struct Open {
    /// How many.
    count: Cell<usize>,
    /// Woken when the count falls to zero.
    none_left: Notify,
}

impl Open {
    /// Counts one more open connection until the guard drops.
    fn enter(this: &Rc<Self>) -> OpenGuard {
        this.count.set(this.count.get() + 1);
        OpenGuard(this.clone())
    }

    /// Resolves once no connection is open.
    async fn drained(&self) {
        while self.count.get() > 0 {
            self.none_left.notified().await;
        }
    }
}

/// One open connection, counted in its worker's [`Open`].
struct OpenGuard(Rc<Open>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        let left = self.0.count.get().saturating_sub(1);
        self.0.count.set(left);
        if left == 0 {
            self.0.none_left.notify_waiters();
        }
    }
}
