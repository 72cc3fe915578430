//! One client connection as its requests see it: who it is, and the
//! handles that end it, keep its socket lingering, and bound the bodies
//! it may hold.

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use super::budget::Budget;
use super::early::LingerFlag;

/// A client connection, as its requests see it.
pub(super) struct Client {
    /// The client's address (`X-Forwarded-For`).
    pub(super) peer: SocketAddr,
    /// Whether the client came over TLS (`X-Forwarded-Proto`).
    pub(super) tls: bool,
    /// Ends the connection from outside its task.
    pub(super) cut: ClientCut,
    /// Set when an answer leaves the request's body unread: the socket
    /// then lingers when the connection closes.
    pub(super) linger: LingerFlag,
    /// What the bodies its requests read whole may hold.
    pub(super) budget: Budget,
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

/// A way to end one client connection from outside the task serving it
/// (the watchdog's sweep), shared by that connection's requests. A flag
/// and the waker of the one task that waits on it: checking it costs the
/// connection's task next to nothing each time it wakes.
#[derive(Clone, Default)]
pub(super) struct ClientCut(Rc<Cut>);

/// What a [`ClientCut`] shares.
#[derive(Default)]
struct Cut {
    /// Set once the connection is cut off.
    cut: Cell<bool>,
    /// The task waiting for it, once it has waited.
    waiter: RefCell<Option<Waker>>,
}

impl ClientCut {
    /// Ready once the connection has been cut off; its task then drops
    /// the connection, which closes the socket. Polled by one task.
    pub(super) fn poll_requested(&self, cx: &Context<'_>) -> Poll<()> {
        if self.0.cut.get() {
            return Poll::Ready(());
        }
        let mut waiter = self.0.waiter.borrow_mut();
        if !waiter.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            *waiter = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Cuts the connection off.
    pub(super) fn cut(&self) {
        self.0.cut.set(true);
        let waiter = self.0.waiter.borrow_mut().take();
        if let Some(waiter) = waiter {
            waiter.wake();
        }
    }
}
