//! Idle upstream connections of one worker and one upstream origin.
//!
//! Owns which kept connection the next request gets and when a kept
//! connection is too old to use: the most recently returned connection is
//! taken first (it is the least likely to have been closed by the
//! upstream), and one idle for longer than `upstream.idle_timeout_ms` is
//! dropped instead of used, so that tollgate gives up a connection before
//! an upstream with a short keep-alive timeout closes it under a request.
//!
//! Time is passed in (milliseconds of the gateway's clock), never read here.

use std::cell::RefCell;
use std::collections::VecDeque;

/// Connections waiting for their next request, oldest first.
pub(super) struct IdleList<C> {
    /// Each connection with the time it became idle, in that order.
    entries: RefCell<VecDeque<(C, u64)>>,
    /// Longest time a connection may stay idle and still be used.
    max_idle_ms: u64,
}

impl<C> IdleList<C> {
    /// An empty list whose connections expire after `max_idle_ms` idle.
    pub(super) fn new(max_idle_ms: u64) -> Self {
        Self {
            entries: RefCell::new(VecDeque::new()),
            max_idle_ms,
        }
    }

    /// The most recently returned connection that is still fresh at `now_ms`
    /// and `usable`; drops every connection it passes over.
    pub(super) fn take(&self, now_ms: u64, mut usable: impl FnMut(&mut C) -> bool) -> Option<C> {
        let mut entries = self.entries.borrow_mut();
        while let Some((mut conn, since)) = entries.pop_back() {
            if now_ms.saturating_sub(since) > self.max_idle_ms {
                // Every entry before this one has been idle even longer.
                entries.clear();
                return None;
            }
            if usable(&mut conn) {
                return Some(conn);
            }
        }
        None
    }

    /// Keeps `conn`, idle from `now_ms`, and drops connections that have
    /// expired by then.
    pub(super) fn put(&self, conn: C, now_ms: u64) {
        let mut entries = self.entries.borrow_mut();
        while entries
            .front()
            .is_some_and(|(_, since)| now_ms.saturating_sub(*since) > self.max_idle_ms)
        {
            entries.pop_front();
        }
        entries.push_back((conn, now_ms));
    }

    /// How many connections are kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.borrow().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(_: &mut &str) -> bool {
        true
    }

    #[test]
    fn the_most_recently_returned_connection_is_taken_first() {
        let idle = IdleList::new(1000);
        idle.put("a", 0);
        idle.put("b", 10);
        assert_eq!(idle.take(20, open), Some("b"));
        assert_eq!(idle.take(20, open), Some("a"));
        assert_eq!(idle.take(20, open), None);
    }

    #[test]
    fn a_connection_is_used_up_to_its_idle_timeout_and_dropped_after() {
        let idle = IdleList::new(1000);
        idle.put("a", 0);
        assert_eq!(idle.take(1000, open), Some("a"));
        idle.put("a", 1000);
        assert_eq!(idle.take(2001, open), None);
        assert_eq!(idle.len(), 0, "the expired connection is dropped");
    }

    #[test]
    fn an_expired_newest_connection_drops_all_older_ones() {
        let idle = IdleList::new(100);
        idle.put("a", 0);
        idle.put("b", 50);
        assert_eq!(idle.take(151, open), None);
        assert_eq!(idle.len(), 0);
    }

    #[test]
    fn unusable_connections_are_skipped_and_dropped() {
        let idle = IdleList::new(1000);
        idle.put("a", 0);
        idle.put("closed", 1);
        assert_eq!(idle.take(2, |c| *c != "closed"), Some("a"));
        assert_eq!(idle.len(), 0);
    }

    #[test]
    fn returning_a_connection_drops_the_expired_ones() {
        let idle = IdleList::new(100);
        idle.put("old", 0);
        idle.put("fresh", 90);
        idle.put("new", 150);
        assert_eq!(idle.len(), 2, "only `old` has been idle too long");
        assert_eq!(idle.take(150, open), Some("new"));
        assert_eq!(idle.take(150, open), Some("fresh"));
    }
}
