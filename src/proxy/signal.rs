//! Wake-ups within one worker thread: [`Places`], a vector whose freed
//! places are reused, and [`Signal`], a flag set once that wakes every
//! task waiting for it through a [`Wait`].
//!
//! Both are single-threaded (`Cell`, `RefCell`, `Rc`): a worker's tasks
//! share them without a lock, and a task that checks a signal each time
//! it wakes reads a flag, where a channel's receiver would make and drop a
//! waiter each time. A waiting task holds one place until its wait is
//! dropped, however often it is polled.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// Values in numbered places; a freed place is reused by the next insert,
/// so the vector grows only to the most values held at once.
#[derive(Debug)]
pub(super) struct Places<T> {
    /// The places; `None` for a free one.
    places: Vec<Option<T>>,
    /// The free places.
    free: Vec<usize>,
}

impl<T> Default for Places<T> {
    fn default() -> Self {
        Self {
            places: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> Places<T> {
    /// Puts `value` in a free place, or a new one; its number.
    pub(super) fn insert(&mut self, value: T) -> usize {
        match self.free.pop() {
            Some(index) => {
                self.places[index] = Some(value);
                index
            }
            None => {
                self.places.push(Some(value));
                self.places.len() - 1
            }
        }
    }

    /// Frees place `index`; what it held, if anything.
    pub(super) fn remove(&mut self, index: usize) -> Option<T> {
        let value = self.places.get_mut(index)?.take()?;
        self.free.push(index);
        Some(value)
    }

    /// What place `index` holds.
    pub(super) fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        self.places.get_mut(index)?.as_mut()
    }

    /// Frees every place whose value `free` says so of.
    pub(super) fn remove_where(&mut self, mut free: impl FnMut(&T) -> bool) {
        for (index, place) in self.places.iter_mut().enumerate() {
            if place.as_ref().is_some_and(&mut free) {
                *place = None;
                self.free.push(index);
            }
        }
    }

    /// How many places hold a value.
    pub(super) fn len(&self) -> usize {
        self.places.len() - self.free.len()
    }

    /// Whether no place holds a value.
    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many places there are, held or free.
    #[cfg(test)]
    pub(super) fn capacity(&self) -> usize {
        self.places.len()
    }

    /// Forgets every place, keeping the memory for the next, once none
    /// is held.
    pub(super) fn reset_when_empty(&mut self) {
        if self.is_empty() {
            self.places.clear();
            self.free.clear();
        }
    }
}

/// A flag that is set once and wakes every task waiting for it.
#[derive(Default)]
pub(super) struct Signal {
    /// Set once.
    set: Cell<bool>,
    /// The tasks waiting for it.
    waiting: RefCell<Places<Waker>>,
}

impl Signal {
    /// Sets the flag and wakes every task waiting for it.
    pub(super) fn set(&self) {
        self.set.set(true);
        let mut woken = Vec::new();
        self.waiting.borrow_mut().remove_where(|waker| {
            woken.push(waker.clone());
            true
        });
        // Woken once the list is no longer borrowed.
        for waker in woken {
            waker.wake();
        }
    }
}

/// One task's wait for a [`Signal`]; it gives its place back when dropped.
pub(super) struct Wait {
    /// What it waits for.
    signal: Rc<Signal>,
    /// Its place among the waiting, once it has waited.
    place: Option<usize>,
}

impl Wait {
    /// A wait for `signal`.
    pub(super) fn new(signal: Rc<Signal>) -> Self {
        Self {
            signal,
            place: None,
        }
    }

    /// Ready once the signal is set; until then the task behind `cx` is
    /// woken when it is.
    pub(super) fn poll(&mut self, cx: &Context<'_>) -> Poll<()> {
        if self.signal.set.get() {
            return Poll::Ready(());
        }
        let mut waiting = self.signal.waiting.borrow_mut();
        match self.place.and_then(|place| waiting.get_mut(place)) {
            Some(waker) => {
                if !waker.will_wake(cx.waker()) {
                    waker.clone_from(cx.waker());
                }
            }
            None => self.place = Some(waiting.insert(cx.waker().clone())),
        }
        Poll::Pending
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        if let Some(place) = self.place {
            self.signal.waiting.borrow_mut().remove(place);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
    fn places_are_reused_once_freed_and_forgotten_when_empty() {
        let mut places = Places::default();
        let (a, b) = (places.insert('a'), places.insert('b'));
        assert_eq!(places.remove(a), Some('a'));
        assert_eq!(places.remove(a), None, "freed once");
        assert_eq!(places.insert('c'), a, "the freed place is reused");
        assert_eq!((places.len(), places.capacity()), (2, 2));
        places.remove_where(|&c| c == 'b');
        assert_eq!(places.get_mut(b), None);
        places.reset_when_empty();
        assert_eq!(places.capacity(), 2, "one is still held");
        places.remove(a);
        places.reset_when_empty();
        assert_eq!((places.len(), places.capacity()), (0, 0));
    }

    #[test]
    fn a_signal_wakes_every_task_still_waiting_and_places_are_reused() {
        let signal = Rc::new(Signal::default());
        let woken = Arc::new(Counted(AtomicUsize::new(0)));
        let waker = Waker::from(woken.clone());
        let cx = Context::from_waker(&waker);
        let mut waits: Vec<_> = (0..3).map(|_| Wait::new(signal.clone())).collect();
        for wait in &mut waits {
            assert!(wait.poll(&cx).is_pending());
            assert!(wait.poll(&cx).is_pending(), "polled again, still one place");
        }
        drop(waits.pop());
        let mut late = Wait::new(signal.clone());
        assert!(late.poll(&cx).is_pending());
        assert_eq!(
            signal.waiting.borrow().capacity(),
            3,
            "the dropped one's place is reused"
        );
        signal.set();
        assert_eq!(woken.0.load(Ordering::SeqCst), 3);
        assert!(waits[0].poll(&cx).is_ready());
        assert!(late.poll(&cx).is_ready());
        assert!(
            Wait::new(signal).poll(&cx).is_ready(),
            "set before it waits"
        );
    }
}
