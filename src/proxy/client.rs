//! One client connection as its requests see it: who it is, and the
//! handles that end it, keep its socket lingering, and bound the bodies
//! it may hold.

use std::net::SocketAddr;
use std::rc::Rc;

use super::budget::Budget;
use super::early::LingerFlag;
use super::signal::{Signal, Wait};

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
/// (the watchdog's sweep), shared by that connection's requests: a
/// [`Signal`] that its task waits for.
#[derive(Clone, Default)]
pub(super) struct ClientCut(Rc<Signal>);

impl ClientCut {
    /// The connection task's wait: ready once the connection has been cut
    /// off; the task then drops the connection, which closes the socket.
    pub(super) fn wait(&self) -> Wait {
        Wait::new(self.0.clone())
    }

    /// Cuts the connection off.
    pub(super) fn cut(&self) {
        self.0.set();
    }
}
