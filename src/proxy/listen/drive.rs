//! Driving one client connection to its end: the deadlines that close a
//! silent connection or say `GOAWAY` to an idle HTTP/2 one
//! ([`Activity`]), the watchdog's cut-off, and graceful shutdown.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::net::SocketAddr;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use super::speak::Served;
use crate::clock::SharedClock;
use crate::proxy::client::ClientCut;
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
    pub cut: ClientCut,
    /// The worker's shutdown.
    pub stop: Stopping,
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
        cut,
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
            () = poll_fn(|cx| cut.poll_requested(cx)) => return,
            () = poll_fn(|cx| stop.poll_set(cx)), if !stopping => {
                stopping = true;
                conn.as_mut().finish();
            }
        }
    }
}

/// One worker's shutdown as its connections see it: a flag, set once,
/// that wakes every connection waiting on it. Each connection's task
/// checks a flag when it wakes, where a channel's receiver would make and
/// drop a waiter each time.
#[derive(Default)]
pub(super) struct Shutdown {
    /// Set on shutdown.
    set: Cell<bool>,
    /// The connections waiting, by place; `None` for a free place or one
    /// already woken.
    waiting: RefCell<Vec<Option<Waker>>>,
    /// Free places.
    free: RefCell<Vec<usize>>,
}

impl Shutdown {
    /// Sets the flag and wakes every connection waiting on it.
    pub(super) fn set(&self) {
        self.set.set(true);
        let woken: Vec<Waker> = self
            .waiting
            .borrow_mut()
            .iter_mut()
            .filter_map(Option::take)
            .collect();
        for waker in woken {
            waker.wake();
        }
    }
}

/// One connection's wait for its worker's [`Shutdown`]; it leaves the
/// worker's list when dropped.
pub(super) struct Stopping {
    /// The worker's shutdown.
    shutdown: Rc<Shutdown>,
    /// Its place in the list, once it has waited.
    place: Option<usize>,
}

impl Stopping {
    /// A wait on `shutdown`.
    pub(super) fn new(shutdown: Rc<Shutdown>) -> Self {
        Self {
            shutdown,
            place: None,
        }
    }

    /// Ready once the worker is shutting down.
    fn poll_set(&mut self, cx: &Context<'_>) -> Poll<()> {
        if self.shutdown.set.get() {
            return Poll::Ready(());
        }
        let mut waiting = self.shutdown.waiting.borrow_mut();
        match self.place {
            Some(place) => {
                let waker = &mut waiting[place];
                if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *waker = Some(cx.waker().clone());
                }
            }
            None => {
                let waker = Some(cx.waker().clone());
                let place = match self.shutdown.free.borrow_mut().pop() {
                    Some(place) => {
                        waiting[place] = waker;
                        place
                    }
                    None => {
                        waiting.push(waker);
                        waiting.len() - 1
                    }
                };
                self.place = Some(place);
            }
        }
        Poll::Pending
    }
}

impl Drop for Stopping {
    fn drop(&mut self) {
        if let Some(place) = self.place {
            self.shutdown.waiting.borrow_mut()[place] = None;
            self.shutdown.free.borrow_mut().push(place);
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
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    /// Counts its wakes.
    struct Counted(AtomicUsize);

    impl Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn shutdown_wakes_every_connection_still_waiting_and_places_are_reused() {
        let shutdown = Rc::new(Shutdown::default());
        let woken = Arc::new(Counted(AtomicUsize::new(0)));
        let waker = Waker::from(woken.clone());
        let cx = Context::from_waker(&waker);
        let mut waits: Vec<_> = (0..3).map(|_| Stopping::new(shutdown.clone())).collect();
        for wait in &mut waits {
            assert!(wait.poll_set(&cx).is_pending());
            assert!(
                wait.poll_set(&cx).is_pending(),
                "polled again, still one place"
            );
        }
        drop(waits.pop());
        let mut late = Stopping::new(shutdown.clone());
        assert!(late.poll_set(&cx).is_pending());
        assert_eq!(
            shutdown.waiting.borrow().len(),
            3,
            "the dropped one's place is reused"
        );
        shutdown.set();
        assert_eq!(woken.0.load(Ordering::SeqCst), 3);
        assert!(waits[0].poll_set(&cx).is_ready());
        assert!(late.poll_set(&cx).is_ready());
        assert!(
            Stopping::new(shutdown).poll_set(&cx).is_ready(),
            "set before it waits"
        );
    }

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
