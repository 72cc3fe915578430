//! Driving one client connection to its end: the deadlines that close a
//! silent connection or say `GOAWAY` to an idle HTTP/2 one
//! ([`Activity`]), the watchdog's cut-off, and graceful shutdown.

use std::cell::Cell;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use super::speak::Served;
use crate::clock::SharedClock;
use crate::proxy::signal::Wait;
use crate::telemetry;

/// When a connection that may speak HTTP/2 has been idle too long.
///
/// Until its first request has begun, nothing else bounds a client that
/// sends nothing after its TLS handshake, or only part of the HTTP/2
/// preface (the protocol is not yet chosen, so HTTP/1's header deadline
/// does not run): such a connection is closed at the header deadline. A
/// connection that has sent the whole HTTP/2 preface is a pooled client's
/// (Envoy's gRPC pool, say): it may go `client.h2_idle_timeout_ms` without
/// starting a request, its first included, and is then ended with
/// `GOAWAY`, never a bare close, so a request sent at that moment is known
/// to be unprocessed and safe to send again.
pub(super) struct Activity {
    /// The header deadline, from the connection's start.
    pub(super) first_within: Duration,
    /// How long an HTTP/2 connection may start no request.
    pub(super) h2_idle: Duration,
    /// The worker's clock.
    pub(super) clock: SharedClock,
    /// When the connection opened (ms of `clock`).
    pub(super) opened_ms: u64,
    /// When its latest request began.
    pub(super) last_request_ms: Cell<Option<u64>>,
    /// Set once the client has sent the HTTP/2 preface.
    pub(super) h2: Rc<Cell<bool>>,
}

impl Activity {
    /// What to do when the deadline passes.
    fn at_deadline(&self) -> Idle {
        let last = self.last_request_ms.get();
        if !self.h2.get() {
            // HTTP/1: hyper's header deadline runs from the first byte
            // on; a connection that never began a request is closed here.
            return if last.is_none() {
                Idle::Close
            } else {
                Idle::Watched
            };
        }
        let since = last.unwrap_or(self.opened_ms);
        let idle_for = Duration::from_millis(self.clock.now_ms().saturating_sub(since));
        match self.h2_idle.checked_sub(idle_for) {
            Some(left) if !left.is_zero() => Idle::Again(left),
            _ => Idle::GoAway,
        }
    }
}

/// What a connection's idle deadline calls for.
#[derive(Debug, PartialEq, Eq)]
enum Idle {
    /// Nothing said yet: close it.
    Close,
    /// HTTP/1 is watched by its own header deadline from here on.
    Watched,
    /// Look again after this long.
    Again(Duration),
    /// An idle HTTP/2 connection: `GOAWAY`, streams in flight finishing.
    GoAway,
}

/// What may end a connection besides its client.
pub(super) struct Ends {
    /// The watchdog's cut-off.
    pub cut: Wait,
    /// The worker's shutdown.
    pub stop: Wait,
    /// The client, named when the connection ends in an error.
    pub peer: SocketAddr,
    /// The idle deadline, for a connection that may speak HTTP/2.
    pub idle: Option<Rc<Activity>>,
}

/// Drives `conn` until it ends, the watchdog cuts it off, it has been
/// idle too long (when it may speak HTTP/2), or shutdown has let its
/// requests in flight finish.
pub(super) async fn drive<C: Served>(mut conn: std::pin::Pin<&mut C>, ends: Ends) {
    let Ends {
        mut cut,
        mut stop,
        peer,
        idle,
    } = ends;
    let mut stopping = false;
    // Never polled (so never armed) without an idle watch.
    let deadline = tokio::time::sleep(idle.as_ref().map_or(Duration::ZERO, |a| a.first_within));
    tokio::pin!(deadline);
    let mut watching = idle.is_some();
    loop {
        tokio::select! {
            biased;
            () = &mut deadline, if watching => {
                let Some(activity) = &idle else { return };
                match activity.at_deadline() {
                    Idle::Close => return,
                    Idle::Watched => watching = false,
                    Idle::Again(left) => {
                        deadline.as_mut().reset(tokio::time::Instant::now() + left);
                    }
                    Idle::GoAway => {
                        watching = false;
                        if !stopping {
                            stopping = true;
                            conn.as_mut().finish();
                        }
                    }
                }
            }
            served = conn.as_mut() => {
                if let Err(e) = served
                    && !C::timed_out(&e)
                {
                    ended_in_error(&e, peer);
                }
                return;
            }
            () = poll_fn(|cx| cut.poll(cx)) => return,
            () = poll_fn(|cx| stop.poll(cx)), if !stopping => {
                stopping = true;
                conn.as_mut().finish();
            }
        }
    }
}

/// Records a connection that ended in `error` (a header deadline that ran
/// out is not noise: it is also how an idle kept-alive connection ends).
pub(super) fn ended_in_error(error: &dyn std::fmt::Display, peer: SocketAddr) {
    telemetry::count_client_noise();
    tracing::debug!(error = %error, %peer, "A client connection ended in an error.");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    #[test]
    fn an_idle_deadline_closes_a_silent_connection_and_says_goaway_to_an_http2_one() {
        let clock = ManualClock::new(1_000);
        let activity = Activity {
            first_within: Duration::from_secs(5),
            h2_idle: Duration::from_secs(60),
            clock: clock.clone(),
            opened_ms: 1_000,
            last_request_ms: Cell::new(None),
            h2: Rc::new(Cell::new(false)),
        };
        clock.advance(Duration::from_secs(5));
        // Nothing said: closed. HTTP/1 after a request: its own deadline.
        assert_eq!(activity.at_deadline(), Idle::Close);
        activity.last_request_ms.set(Some(2_000));
        assert_eq!(activity.at_deadline(), Idle::Watched);
        // HTTP/2: the idle timeout runs from the latest request, or from
        // the start when there was none.
        activity.h2.set(true);
        assert_eq!(activity.at_deadline(), Idle::Again(Duration::from_secs(56)));
        activity.last_request_ms.set(None);
        assert_eq!(activity.at_deadline(), Idle::Again(Duration::from_secs(55)));
        clock.advance(Duration::from_secs(55));
        assert_eq!(activity.at_deadline(), Idle::GoAway);
    }
}
