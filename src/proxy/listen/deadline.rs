//! Coarse deadlines for timeouts that almost never fire: a request head's
//! (hyper's HTTP/1 header timer, through [`CoarseTimer`]) and an upstream
//! exchange's.
//!
//! Owns one list of armed deadlines per worker thread, checked every
//! [`TICK`] by a task of that worker that runs while the list holds any.
//! Arming and dropping a deadline takes or frees a place in a vector,
//! where tokio's timer locks its wheel to insert the entry and again to
//! remove it; every request arms two, and nearly all of them are dropped
//! before they fire. A deadline fires up to one tick late, never early.
//!
//! A deadline is armed on its first poll and must be polled on a worker
//! (inside a `LocalSet`, which every worker runs), whose list it joins.
//! One polled later on another thread arms again there; the place it
//! left frees itself when its time comes.

use std::cell::RefCell;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::Instant;

use crate::proxy::signal::Places;

/// How often a worker's armed deadlines are checked.
pub(in crate::proxy) const TICK: Duration = Duration::from_millis(25);

thread_local! {
    /// This thread's armed deadlines.
    static LIST: RefCell<List> = RefCell::new(List::new());
}

/// Numbers each thread's list, so that a deadline dropped or polled on
/// another thread never touches a place in the wrong one.
static LISTS: AtomicU32 = AtomicU32::new(0);

/// One thread's armed deadlines.
struct List {
    /// This list's number.
    id: u32,
    /// The armed deadlines. A place is freed when its deadline fires, is
    /// dropped or is moved, so none outlives its time by more than a
    /// tick, whatever becomes of the deadline that armed it.
    places: Places<Place>,
    /// Numbers the places armed, so that a deadline knows its own place
    /// from a later one in the same spot.
    armings: u64,
    /// No armed place fires before this (it may be earlier than the
    /// earliest still armed, once that one is dropped): a tick before it
    /// looks at no place.
    earliest: Option<Instant>,
    /// Whether the checking task runs.
    ticking: bool,
}

/// One armed deadline.
struct Place {
    /// When it fires.
    at: Instant,
    /// Whom to wake when it fires.
    waker: Waker,
    /// Which arming it is.
    arming: u64,
}

/// Where an armed deadline is: its list, its place, its arming.
#[derive(Debug, Clone, Copy)]
struct Armed {
    /// The list's number.
    list: u32,
    /// The place in it.
    index: usize,
    /// The arming, told apart from a later one in the same place.
    arming: u64,
}

impl List {
    /// An empty list with a number of its own.
    fn new() -> Self {
        Self {
            id: LISTS.fetch_add(1, Ordering::Relaxed),
            places: Places::default(),
            armings: 0,
            earliest: None,
            ticking: false,
        }
    }

    /// Arms a place for `at`, waking `waker`; starts the checking task
    /// when it does not run.
    fn arm(&mut self, at: Instant, waker: &Waker) -> Armed {
        self.armings += 1;
        let arming = self.armings;
        let index = self.places.insert(Place {
            at,
            waker: waker.clone(),
            arming,
        });
        self.earliest = Some(self.earliest.map_or(at, |earliest| earliest.min(at)));
        if !self.ticking {
            self.ticking = true;
            tokio::task::spawn_local(tick());
        }
        Armed {
            list: self.id,
            index,
            arming,
        }
    }

    /// The place `armed` holds in this list, while it is armed.
    fn place(&mut self, armed: Armed) -> Option<&mut Place> {
        if armed.list != self.id {
            return None;
        }
        self.places
            .get_mut(armed.index)
            .filter(|place| place.arming == armed.arming)
    }

    /// Frees the place of `armed`, while it holds one in this list.
    fn disarm(&mut self, armed: Armed) {
        if self.place(armed).is_some() {
            self.places.remove(armed.index);
        }
    }

    /// Fires and frees every place due at `now`; whether any is still
    /// armed. Only a tick at or after the earliest deadline looks at the
    /// places: most ticks of a worker whose deadlines are seconds away
    /// cost a comparison, however many connections it holds.
    fn fire(&mut self, now: Instant) -> bool {
        if self.earliest.is_some_and(|earliest| earliest <= now) {
            let mut earliest = None;
            self.places.remove_where(|place| {
                if place.at <= now {
                    place.waker.wake_by_ref();
                    return true;
                }
                earliest = Some(earliest.map_or(place.at, |e: Instant| e.min(place.at)));
                false
            });
            self.earliest = earliest;
        }
        if self.places.is_empty() {
            // Nothing to check until a deadline is armed again, which
            // starts a new task.
            self.ticking = false;
            self.places.reset_when_empty();
            self.earliest = None;
        }
        self.ticking
    }
}

/// Checks the thread's list every [`TICK`] while it holds a deadline.
async fn tick() {
    let mut interval = tokio::time::interval(TICK);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let now = Instant::now();
        if !LIST.with_borrow_mut(|list| list.fire(now)) {
            return;
        }
    }
}

/// A future that is ready once `at` has passed (checked every [`TICK`]).
#[derive(Debug)]
pub(in crate::proxy) struct Deadline {
    /// When it fires.
    at: Instant,
    /// Its place, once armed.
    armed: Option<Armed>,
    /// Whether it has fired.
    fired: bool,
}

impl Deadline {
    /// A deadline `after` from now.
    pub(in crate::proxy) fn after(after: Duration) -> Self {
        Self::at(Instant::now() + after)
    }

    /// A deadline at `at`.
    pub(in crate::proxy) fn at(at: Instant) -> Self {
        Self {
            at,
            armed: None,
            fired: false,
        }
    }

    /// Moves the deadline to `at`; it arms again on its next poll.
    pub(in crate::proxy) fn reset(&mut self, at: Instant) {
        self.disarm();
        *self = Self::at(at);
    }

    /// Frees its place, if it holds one.
    fn disarm(&mut self) {
        if let Some(armed) = self.armed.take() {
            // A thread that is ending has no list left to free it in.
            let _ = LIST.try_with(|list| list.borrow_mut().disarm(armed));
        }
    }
}

impl Future for Deadline {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.fired {
            return Poll::Ready(());
        }
        LIST.with_borrow_mut(|list| match this.armed {
            Some(armed) if armed.list == list.id => match list.place(armed) {
                Some(place) => {
                    if !place.waker.will_wake(cx.waker()) {
                        place.waker.clone_from(cx.waker());
                    }
                    Poll::Pending
                }
                // Freed by the tick that fired it.
                None => {
                    this.armed = None;
                    this.fired = true;
                    Poll::Ready(())
                }
            },
            // Not armed yet, or armed on another thread, whose place
            // frees itself at its time: armed here.
            _ => {
                this.armed = Some(list.arm(this.at, cx.waker()));
                Poll::Pending
            }
        })
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        self.disarm();
    }
}

impl hyper::rt::Sleep for Deadline {}

/// hyper's timer on coarse deadlines, for the HTTP/1 header timer.
#[derive(Debug, Clone, Copy)]
pub(in crate::proxy) struct CoarseTimer;

impl hyper::rt::Timer for CoarseTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Deadline::after(duration))
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Deadline::at(deadline.into()))
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: std::time::Instant) {
        match sleep.as_mut().downcast_mut_pin::<Deadline>() {
            Some(deadline) => deadline.get_mut().reset(new_deadline.into()),
            None => *sleep = self.sleep_until(new_deadline),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::poll_fn;

    /// Runs `f` on a paused-time local set.
    fn local<F: Future>(f: F) -> F::Output {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        tokio::task::LocalSet::new().block_on(&runtime, f)
    }

    /// Whether `deadline` is ready when polled once now.
    async fn ready(deadline: &mut Deadline) -> bool {
        poll_fn(|cx| Poll::Ready(Pin::new(&mut *deadline).poll(cx).is_ready())).await
    }

    /// Asserts that a deadline armed at `start` for `after` fired within a
    /// tick after its time.
    fn fired_on_time(start: Instant, after: Duration) {
        let waited = start.elapsed();
        assert!(waited >= after, "{waited:?}");
        assert!(waited <= after + TICK, "{waited:?}");
    }

    #[test]
    fn a_deadline_fires_within_a_tick_after_its_time_and_never_before() {
        local(async {
            let start = Instant::now();
            let mut deadline = Deadline::after(Duration::from_millis(100));
            assert!(!ready(&mut deadline).await);
            tokio::time::sleep(Duration::from_millis(99)).await;
            assert!(!ready(&mut deadline).await, "early");
            (&mut deadline).await;
            fired_on_time(start, Duration::from_millis(100));
            assert!(ready(&mut deadline).await, "stays fired");
        });
    }

    #[test]
    fn ticks_before_the_earliest_deadline_look_at_no_place_and_later_ones_still_fire() {
        local(async {
            let start = Instant::now();
            let mut late = Deadline::after(Duration::from_secs(5));
            assert!(!ready(&mut late).await);
            let mut soon = Deadline::after(Duration::from_millis(60));
            assert!(!ready(&mut soon).await);
            assert_eq!(
                LIST.with_borrow(|list| list.earliest),
                Some(start + Duration::from_millis(60))
            );
            (&mut soon).await;
            drop(soon);
            // The scan that fired it found the next deadline.
            assert_eq!(
                LIST.with_borrow(|list| list.earliest),
                Some(start + Duration::from_secs(5))
            );
            (&mut late).await;
            fired_on_time(start, Duration::from_secs(5));
        });
    }

    #[test]
    fn dropped_and_reset_deadlines_give_their_places_back_and_the_task_stops() {
        local(async {
            let mut kept = Deadline::after(Duration::from_secs(1));
            assert!(!ready(&mut kept).await);
            for _ in 0..100 {
                let mut dropped = Deadline::after(Duration::from_millis(10));
                assert!(!ready(&mut dropped).await);
            }
            let places = LIST.with_borrow(|list| (list.places.len(), list.places.capacity()));
            assert_eq!(places, (1, 2), "one place reused by every dropped one");
            // Moved later: not fired at its first time.
            kept.reset(Instant::now() + Duration::from_secs(2));
            assert!(!ready(&mut kept).await);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            assert!(!ready(&mut kept).await);
            (&mut kept).await;
            drop(kept);
            tokio::time::sleep(TICK * 2).await;
            let left = LIST.with_borrow(|list| (list.places.len(), list.ticking));
            assert_eq!(left, (0, false), "nothing armed, nothing ticking");
            // Arming again starts the task again.
            let started = Instant::now();
            Deadline::after(Duration::from_millis(50)).await;
            assert!(started.elapsed() <= Duration::from_millis(50) + TICK);
        });
    }

    #[test]
    fn a_deadline_polled_on_another_thread_fires_there_and_its_first_place_frees_itself() {
        local(async {
            let mut deadline = Deadline::after(Duration::from_millis(100));
            assert!(!ready(&mut deadline).await);
            let elsewhere = std::thread::spawn(move || local(deadline));
            elsewhere.join().unwrap();
            assert_eq!(LIST.with_borrow(|list| list.places.len()), 1);
            tokio::time::sleep(Duration::from_millis(100) + TICK * 2).await;
            let left = LIST.with_borrow(|list| (list.places.len(), list.ticking));
            assert_eq!(
                left,
                (0, false),
                "the place left behind fired and was freed"
            );
        });
    }
}
