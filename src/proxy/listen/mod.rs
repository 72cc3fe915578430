//! The proxy listener: worker threads, client connections and shutdown.
//!
//! Owns serving. Each worker is an actix arbiter (one thread running one
//! single-threaded runtime), so that the worker's decision queue, its
//! upstream connections and its client connections share a thread and
//! nothing they pass each other crosses one. Every worker accepts from each listening
//! socket (the proxy's, and Envoy's rate limit service and the HTTP check
//! when served: each connection is its socket's [`Entry`]) and serves each
//! connection as HTTP/1.1 (hyper), or
//! also HTTP/2 (cleartext with `server.h2c`; over TLS, as ALPN chooses),
//! with:
//! - a header deadline (`client.header_timeout_ms`): a TLS handshake, a
//!   request's line and
//!   headers, and on a kept-alive connection the next request, must arrive
//!   within it, or the connection is closed (checked every 25 ms on the
//!   worker's list of coarse deadlines, `deadline`, not a timer per
//!   request);
//! - an idle deadline for HTTP/2 (`client.h2_idle_timeout_ms`, once the
//!   client has sent the HTTP/2 preface): a connection that starts no
//!   request for that long is ended with `GOAWAY`, its streams in flight
//!   finishing (`Activity`);
//! - a budget for bodies read whole, per connection and per process
//!   (`budget`);
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

pub(super) mod deadline;
mod drive;
mod speak;
pub(super) mod stall;

use std::cell::Cell;
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
use tokio::sync::{Notify, Semaphore, oneshot, watch};

use drive::{Activity, Ends, drive, ended_in_error};
use speak::{H2Windows, Protocols, Sniffed};

use super::Worker;
use super::budget::Budget;
use super::client::Client;
use super::client::ClientCut;
use super::early::{LingerFlag, Lingering};
use super::signal::{Signal, Wait};
use crate::config::ClientSettings;
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
    /// The deadlines, HTTP/2 bounds and body budgets clients are held to.
    pub client: ClientSettings,
    /// How long requests in flight may take to finish on shutdown.
    pub grace: Duration,
    /// Cleartext HTTP/2 (prior knowledge) beside HTTP/1.1.
    pub h2c: bool,
    /// TLS on every connection (HTTP/2 or HTTP/1.1 by ALPN), when set.
    pub tls: Option<Arc<ListenerTls>>,
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
        let bodies = Budget::process(serving.client.body_buffer_bytes);
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
            let (serving, bodies) = (serving.clone(), bodies.clone());
            let arbiter = Arbiter::new();
            let started = arbiter.spawn_fn(move || {
                // On the worker's thread: what it builds stays there.
                tokio::task::spawn_local(async move {
                    let worker = Rc::new(make_worker());
                    let open = Rc::new(Open::default());
                    let shutdown = Rc::new(Signal::default());
                    let mut stopped = stop.clone();
                    let told = shutdown.clone();
                    tokio::task::spawn_local(async move {
                        let _ = stopped.wait_for(|stopping| *stopping).await;
                        told.set();
                    });
                    let loops = sockets.into_iter().map(|(socket, entry)| {
                        let listening = Listening::new(entry, &serving, bodies.clone());
                        let ends = (stop.clone(), shutdown.clone());
                        accept(socket, listening, worker.clone(), open.clone(), ends)
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
    /// Longest wait for a client's TLS handshake, and for a connection's
    /// first request until it shows itself to be HTTP/2.
    handshake_timeout: Duration,
    /// Longest time an HTTP/2 connection may start no request.
    h2_idle_timeout: Duration,
    /// Each connection's body budget, in bytes.
    body_budget: u32,
    /// The process's body budget, shared by every connection.
    bodies: Arc<Semaphore>,
}

impl Listening {
    /// The proxy's socket speaks as `serving` says; the others speak
    /// HTTP/1.1 and cleartext HTTP/2 (gRPC needs it), without TLS, with
    /// the small windows of listeners that read bodies whole.
    fn new(entry: Entry, serving: &Serving, bodies: Arc<Semaphore>) -> Self {
        let tls = if entry == Entry::Proxy {
            serving.tls.clone()
        } else {
            None
        };
        let h2c = serving.h2c || entry != Entry::Proxy;
        let windows = if entry == Entry::Proxy {
            H2Windows::PROXY
        } else {
            H2Windows::SMALL_BODIES
        };
        let client = &serving.client;
        Self {
            entry,
            http: Rc::new(Protocols::new(
                client.header_timeout,
                h2c || tls.is_some(),
                client.h2_max_concurrent_streams,
                windows,
            )),
            tls,
            handshake_timeout: client.header_timeout,
            h2_idle_timeout: client.h2_idle_timeout,
            body_budget: client.body_buffer_bytes_per_connection,
            bodies,
        }
    }
}

/// One worker's accept loop on `socket`, until `stop`; its connections
/// learn of it through the worker's `shutdown`.
async fn accept(
    socket: std::net::TcpListener,
    listening: Listening,
    worker: Rc<Worker>,
    open: Rc<Open>,
    (mut stop, shutdown): (watch::Receiver<bool>, Rc<Signal>),
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
                    h2_idle_timeout: listening.h2_idle_timeout,
                    budget: Budget::new(listening.body_budget, listening.bodies.clone()),
                    shutdown: shutdown.clone(),
                    _open: Open::enter(&open),
                };
                tokio::task::spawn_local(connection.serve(stream, peer));
            }
            Err(e) => {
                // Summarised once a minute: out of file descriptors, every
                // attempt fails.
                telemetry::count_accept_failure(&e);
                tracing::debug!(error = %e, "Accepting a client connection failed.");
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
    /// Longest time an HTTP/2 connection may start no request.
    h2_idle_timeout: Duration,
    /// What its bodies read whole may hold.
    budget: Budget,
    /// The worker's shutdown.
    shutdown: Rc<Signal>,
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
            budget: self.budget,
        });
        let (worker, entry) = (self.worker, self.entry);
        let clock = worker.state.clock.clone();
        // HTTP/1 alone has its header deadline from the first byte; only a
        // connection whose protocol is still to be chosen needs this one.
        let idle = matches!(*self.http, Protocols::Auto(_)).then(|| {
            Rc::new(Activity {
                first_within: self.handshake_timeout,
                h2_idle: self.h2_idle_timeout,
                clock: clock.clone(),
                opened_ms: clock.now_ms(),
                last_request_ms: Cell::new(None),
                h2: Rc::new(Cell::new(false)),
            })
        });
        let seen = idle.clone();
        let service = service_fn(move |req| {
            if let Some(seen) = &seen {
                seen.last_request_ms.set(Some(clock.now_ms()));
            }
            super::entry::handle(entry, req, client.clone(), worker.clone())
        });
        let h2 = idle
            .as_ref()
            .map_or_else(|| Rc::new(Cell::new(false)), |idle| idle.h2.clone());
        let io = TokioIo::new(Sniffed::new(Lingering::new(stream, linger), h2));
        let ends = Ends {
            cut: cut.wait(),
            stop: Wait::new(self.shutdown),
            peer,
            idle,
        };
        match &*self.http {
            Protocols::Http1(http1) => drive(pin!(http1.serve_connection(io, service)), ends).await,
            Protocols::Auto(auto) => drive(pin!(auto.serve_connection(io, service)), ends).await,
        }
    }
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
