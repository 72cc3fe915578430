//! Slow clients: progress-based deadlines on request and response bodies.
//!
//! Owns [`Progress`], the credit a client has while a body transfer waits
//! on it, and [`Watchdog`], one worker's list of responses waiting for
//! their clients, swept on a timer. A client that uploads or downloads
//! slower than `client.min_bytes_per_second` on average, or makes no
//! progress for `client.read_timeout_ms` / `client.write_timeout_ms`, is
//! cut off: what it held (an upstream connection, a tenant's slot) is
//! released, and a download's client connection is shut down ([`Cut`]).
//! Time spent waiting on the upstream is never counted against the client.
//!
//! Credit model: a transfer starts with `timeout` of credit. While it waits
//! on the client the credit drains in real time; every chunk the client
//! moves earns `bytes / min_bytes_per_second` (the whole `timeout` when
//! there is no minimum rate), never above `timeout`. The client is cut off
//! when the credit runs out while the transfer waits on it. A client at
//! 1 byte/s thus lasts about `timeout`; one at twice the minimum rate
//! never runs out.
//!
//! Time is passed in (milliseconds of the gateway's clock), never read
//! here, except by the sweep task that [`Watchdog::start`] spawns.

use std::cell::{Cell, RefCell, RefMut};
use std::rc::{Rc, Weak};
use std::time::Duration;

use crate::clock::{SharedClock, millis};
use crate::config::Pace;
use crate::telemetry::{BodyDirection, Metrics};

/// The credit of one body transfer.
#[derive(Debug, Clone, Copy)]
pub(in crate::proxy) struct Progress {
    /// Longest wait without progress, and the most credit.
    timeout_ms: u64,
    /// Rate that earns credit as fast as waiting drains it; 0 = none.
    min_rate: u64,
    /// Credit left, in milliseconds of waiting.
    credit_ms: u64,
    /// When the current wait on the client began, if it waits.
    waiting_since: Option<u64>,
    /// Time spent waiting on the client in earlier, finished waits.
    waited_ms: u64,
}

impl Progress {
    /// A transfer that has not waited yet, at `pace`.
    pub(in crate::proxy) fn new(pace: Pace) -> Self {
        let timeout_ms = millis(pace.timeout);
        Self {
            timeout_ms,
            min_rate: pace.min_bytes_per_second,
            credit_ms: timeout_ms,
            waiting_since: None,
            waited_ms: 0,
        }
    }

    /// The transfer waits on its client from `now` (a wait already under
    /// way keeps its start).
    pub(in crate::proxy) fn wait(&mut self, now: u64) {
        self.waiting_since.get_or_insert(now);
    }

    /// The client moved `bytes` at `now`: a wait under way ends and the
    /// transfer earns credit.
    pub(in crate::proxy) fn moved(&mut self, now: u64, bytes: usize) {
        if let Some(since) = self.waiting_since.take() {
            let waited = now.saturating_sub(since);
            self.credit_ms = self.credit_ms.saturating_sub(waited);
            self.waited_ms = self.waited_ms.saturating_add(waited);
        }
        let earned = match self.min_rate {
            0 => self.timeout_ms,
            rate => (bytes as u64).saturating_mul(1000) / rate,
        };
        self.credit_ms = self.credit_ms.saturating_add(earned).min(self.timeout_ms);
    }

    /// When the wait under way runs out of credit, if the transfer waits.
    pub(in crate::proxy) fn deadline(&self) -> Option<u64> {
        self.waiting_since
            .map(|since| since.saturating_add(self.credit_ms))
    }

    /// Whether the transfer waits on its client and has run out of credit.
    pub(in crate::proxy) fn expired(&self, now: u64) -> bool {
        self.deadline().is_some_and(|deadline| now > deadline)
    }

    /// All time spent waiting on the client up to `now`.
    pub(in crate::proxy) fn waited(&self, now: u64) -> u64 {
        let current = self
            .waiting_since
            .map_or(0, |since| now.saturating_sub(since));
        self.waited_ms.saturating_add(current)
    }
}

/// A response under watch: its progress, and what it holds until it ends
/// or is cut off.
pub(in crate::proxy) struct Watched<T> {
    /// The download's credit.
    progress: Cell<Progress>,
    /// Released (dropped) when the client is cut off.
    held: RefCell<Option<T>>,
}

impl<T> Watched<T> {
    /// The download's credit.
    pub(in crate::proxy) fn progress(&self) -> Progress {
        self.progress.get()
    }

    /// Records the download's credit.
    pub(in crate::proxy) fn set_progress(&self, progress: Progress) {
        self.progress.set(progress);
    }

    /// What the response holds; `None` once it has been cut off.
    pub(in crate::proxy) fn held(&self) -> RefMut<'_, Option<T>> {
        self.held.borrow_mut()
    }
}

/// What a watched response holds, and how it is let go when its client is
/// cut off (dropping it is how it is let go when the response ends).
pub(in crate::proxy) trait Cut {
    /// Releases everything, the client included.
    fn cut(self);
}

/// One worker's responses that may wait on their clients.
pub(in crate::proxy) struct Watchdog<T> {
    /// Watched responses by slot; `None` slots are free.
    entries: RefCell<Vec<Option<Rc<Watched<T>>>>>,
    /// Free slots in `entries`.
    free: RefCell<Vec<usize>>,
    /// Reads now for the sweep.
    clock: SharedClock,
    /// `tollgate_client_timeouts_total`.
    metrics: Metrics,
}

impl<T: Cut + 'static> Watchdog<T> {
    /// A watchdog whose sweep runs every `period` on the current worker
    /// (it stops once the watchdog is dropped).
    pub(in crate::proxy) fn start(
        period: Duration,
        clock: SharedClock,
        metrics: Metrics,
    ) -> Rc<Self> {
        let dog = Rc::new(Self {
            entries: RefCell::new(Vec::new()),
            free: RefCell::new(Vec::new()),
            clock,
            metrics,
        });
        let weak = Rc::downgrade(&dog);
        actix_web::rt::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(dog) = weak.upgrade() else { break };
                dog.sweep(dog.clock.now_ms());
            }
        });
        dog
    }

    /// Watches a response that holds `held`, at `pace`; it leaves the
    /// watch when the returned [`Watch`] is dropped.
    pub(in crate::proxy) fn watch(self: &Rc<Self>, held: T, pace: Pace) -> Watch<T> {
        let watched = Rc::new(Watched {
            progress: Cell::new(Progress::new(pace)),
            held: RefCell::new(Some(held)),
        });
        let mut entries = self.entries.borrow_mut();
        let slot = match self.free.borrow_mut().pop() {
            Some(slot) => {
                entries[slot] = Some(watched.clone());
                slot
            }
            None => {
                entries.push(Some(watched.clone()));
                entries.len() - 1
            }
        };
        Watch {
            watched,
            dog: Rc::downgrade(self),
            slot,
        }
    }

    /// Releases what every response whose client ran out of credit by
    /// `now` holds; returns how many were cut off.
    pub(in crate::proxy) fn sweep(&self, now: u64) -> usize {
        let mut cut = 0;
        for watched in self.entries.borrow().iter().flatten() {
            if !watched.progress().expired(now) {
                continue;
            }
            // Taken out first: the borrow ends before the hook runs.
            let held = watched.held().take();
            if let Some(held) = held {
                held.cut();
                cut += 1;
                self.metrics.client_timeout(BodyDirection::Response);
            }
        }
        if cut > 0 {
            tracing::debug!(
                clients = cut,
                "Cut off clients that stopped reading responses."
            );
        }
        cut
    }
}

/// A response's place on its worker's watch list.
pub(in crate::proxy) struct Watch<T> {
    /// The watched state, shared with the sweep.
    watched: Rc<Watched<T>>,
    /// The list it is on.
    dog: Weak<Watchdog<T>>,
    /// Its slot there.
    slot: usize,
}

impl<T> std::ops::Deref for Watch<T> {
    type Target = Watched<T>;

    fn deref(&self) -> &Watched<T> {
        &self.watched
    }
}

impl<T> Drop for Watch<T> {
    fn drop(&mut self) {
        if let Some(dog) = self.dog.upgrade() {
            dog.entries.borrow_mut()[self.slot] = None;
            dog.free.borrow_mut().push(self.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Cut for &'static str {
        fn cut(self) {}
    }

    fn pace(timeout_ms: u64, min_bytes_per_second: u64) -> Pace {
        Pace {
            timeout: Duration::from_millis(timeout_ms),
            min_bytes_per_second,
        }
    }

    #[test]
    fn a_stalled_client_runs_out_after_the_timeout() {
        let mut p = Progress::new(pace(10_000, 0));
        assert!(!p.expired(50_000), "not waiting: nothing runs out");
        p.wait(1_000);
        assert_eq!(p.deadline(), Some(11_000));
        assert!(!p.expired(11_000));
        assert!(p.expired(11_001));
    }

    #[test]
    fn without_a_minimum_rate_any_progress_restores_the_whole_timeout() {
        let mut p = Progress::new(pace(10_000, 0));
        p.wait(0);
        p.moved(9_000, 1);
        p.wait(9_000);
        assert_eq!(p.deadline(), Some(19_000));
    }

    #[test]
    fn a_client_below_the_minimum_rate_runs_out() {
        // 1 byte per second against a 1024 B/s minimum and a 10 s timeout.
        let mut p = Progress::new(pace(10_000, 1024));
        let mut now = 0;
        p.wait(now);
        while !p.expired(now) {
            now += 1_000;
            if !p.expired(now) {
                p.moved(now, 1);
                p.wait(now);
            }
        }
        assert!((10_000..=11_000).contains(&now), "cut off at {now} ms");
    }

    #[test]
    fn a_client_at_twice_the_minimum_rate_never_runs_out() {
        let mut p = Progress::new(pace(10_000, 1024));
        p.wait(0);
        for second in 1..=600 {
            assert!(!p.expired(second * 1000));
            p.moved(second * 1000, 2048);
            p.wait(second * 1000);
        }
    }

    #[test]
    fn credit_never_exceeds_the_timeout() {
        let mut p = Progress::new(pace(10_000, 1024));
        p.wait(0);
        p.moved(1, 100 << 20);
        p.wait(1);
        assert_eq!(p.deadline(), Some(10_001));
    }

    #[test]
    fn time_waiting_on_the_upstream_is_not_counted() {
        let mut p = Progress::new(pace(10_000, 0));
        p.wait(0);
        p.moved(4_000, 10);
        // 60 s on the upstream side: no wait under way.
        assert!(!p.expired(64_000));
        p.wait(64_000);
        assert_eq!(p.deadline(), Some(74_000));
        assert_eq!(p.waited(65_000), 5_000);
    }

    #[actix_web::test]
    async fn the_sweep_releases_only_expired_responses_and_slots_are_reused() {
        let clock: SharedClock = crate::clock::ManualClock::new(0);
        let dog: Rc<Watchdog<&str>> =
            Watchdog::start(Duration::from_secs(3600), clock, Metrics::new());
        let slow = dog.watch("slow", pace(100, 0));
        let fast = dog.watch("fast", pace(100, 0));
        let mut p = slow.progress();
        p.wait(0);
        slow.set_progress(p);
        assert_eq!(dog.sweep(100), 0);
        assert_eq!(dog.sweep(101), 1);
        assert!(slow.held().is_none());
        assert_eq!(*fast.held(), Some("fast"));
        assert_eq!(dog.sweep(1_000), 0, "a response is cut off once");
        drop(slow);
        let again = dog.watch("again", pace(100, 0));
        assert_eq!(again.slot, 0, "the freed slot is reused");
        assert_eq!(dog.entries.borrow().len(), 2);
    }
}
