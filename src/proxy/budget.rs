//! Memory for request bodies read whole.
//!
//! Owns the bound on what the check and RLS listeners hold: a check's
//! JSON and a gRPC message are read into memory before they are decided,
//! so a client that opens many streams and sends most of each body, never
//! the end, would otherwise hold a body's worth per stream. Room for each
//! chunk is taken before it is read (so a stream out of budget is not
//! read at all, and its sender stalls under HTTP/2 flow control), from
//! its connection's budget (`client.body_buffer_bytes_per_connection`);
//! what a body keeps beyond its first [`UNCOUNTED`] bytes also counts
//! against the process's (`client.body_buffer_bytes`, shared by every
//! worker). Both wait, within the body's read deadline, until bytes are
//! returned. So one connection holds at most its budget, and all of them
//! together at most the process's budget beyond a few KiB per stream:
//! the small calls of every other client (an RLS request or a check is a
//! few hundred bytes) are read at once even while floods on other
//! connections hold the whole process budget.
//! Bodies return their bytes when dropped ([`Taken`]).

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes one connection's bodies may hold, drawn from the process's.
#[derive(Clone)]
pub(super) struct Budget {
    /// This connection's bytes.
    connection: Arc<Semaphore>,
    /// Every connection's bytes together.
    process: Arc<Semaphore>,
}

/// Bytes of each body that need no share of the process's budget.
pub(super) const UNCOUNTED: usize = 4 * 1024;

/// The bytes held by one body; returned on drop.
#[derive(Default)]
pub(super) struct Taken {
    /// Bytes covered by the connection's budget: what the body holds and
    /// room for what it reads next.
    room: usize,
    /// Bytes the body keeps.
    kept: usize,
    /// `room` bytes of the connection's budget.
    connection: Option<OwnedSemaphorePermit>,
    /// `kept` bytes beyond the first [`UNCOUNTED`], of the process's.
    process: Option<OwnedSemaphorePermit>,
}

impl Budget {
    /// A connection's budget of `per_connection` bytes under `process`.
    pub(super) fn new(per_connection: u32, process: Arc<Semaphore>) -> Self {
        Self {
            connection: Arc::new(Semaphore::new(per_connection as usize)),
            process,
        }
    }

    /// The process-wide budget of `bytes` (capped at what a semaphore
    /// counts).
    pub(super) fn process(bytes: u64) -> Arc<Semaphore> {
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        Arc::new(Semaphore::new(bytes.min(Semaphore::MAX_PERMITS)))
    }

    /// Makes the connection's budget cover `total` bytes of `held` (what
    /// it keeps and room to read into), waiting until it has them.
    pub(super) async fn room(&self, held: &mut Taken, total: usize) {
        if total > held.room {
            // The semaphores are never closed.
            if let Ok(permit) = acquire(&self.connection, total - held.room).await {
                merge(&mut held.connection, permit);
            }
            held.room = total;
        }
    }

    /// Counts `kept` bytes as what `held` keeps, waiting until the
    /// process's budget has those beyond the first [`UNCOUNTED`]; then
    /// returns the connection's room beyond them.
    pub(super) async fn keep(&self, held: &mut Taken, kept: usize) {
        self.room(held, kept).await;
        let counted = process_part(kept).saturating_sub(process_part(held.kept));
        if counted > 0
            && let Ok(permit) = acquire(&self.process, counted).await
        {
            merge(&mut held.process, permit);
        }
        held.kept = held.kept.max(kept);
        if held.room > held.kept {
            drop(
                held.connection
                    .as_mut()
                    .and_then(|p| p.split(held.room - held.kept)),
            );
            held.room = held.kept;
        }
    }
}

/// Of a body's first `bytes`, those the process's budget counts.
fn process_part(bytes: usize) -> usize {
    bytes.saturating_sub(UNCOUNTED)
}

/// `bytes` permits of `semaphore` (a chunk is at most a frame or a
/// socket read, far below `u32::MAX`).
async fn acquire(
    semaphore: &Arc<Semaphore>,
    bytes: usize,
) -> Result<OwnedSemaphorePermit, tokio::sync::AcquireError> {
    let bytes = u32::try_from(bytes).unwrap_or(u32::MAX);
    semaphore.clone().acquire_many_owned(bytes).await
}

/// `permit` added to `into`.
fn merge(into: &mut Option<OwnedSemaphorePermit>, permit: OwnedSemaphorePermit) {
    match into {
        Some(held) => held.merge(permit),
        None => *into = Some(permit),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const K: usize = UNCOUNTED;

    /// Whether `step` finishes at once.
    async fn at_once(step: impl Future<Output = ()>) -> bool {
        tokio::time::timeout(Duration::from_millis(10), step)
            .await
            .is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_waits_for_its_own_budget_and_the_process_for_all() {
        let process = Budget::process(300);
        let per_connection = u32::try_from(K + 200).unwrap();
        let (a, b) = (
            Budget::new(per_connection, process.clone()),
            Budget::new(per_connection, process.clone()),
        );
        // A body's first K bytes need none of the process's budget.
        let mut first = Taken::default();
        assert!(at_once(a.keep(&mut first, K + 150)).await);
        assert_eq!(process.available_permits(), 150);
        // a has 50 left: room for 100 waits until first is returned.
        let mut second = Taken::default();
        assert!(
            !at_once(a.room(&mut second, 100)).await,
            "the connection's budget is spent"
        );
        // b has its own budget, but the process only 150 left.
        let mut third = Taken::default();
        assert!(at_once(b.keep(&mut third, K + 150)).await);
        assert_eq!(process.available_permits(), 0);
        let mut small = Taken::default();
        assert!(
            at_once(b.keep(&mut small, 40)).await,
            "a small body is read all the same"
        );
        let mut more = Taken::default();
        assert!(
            !at_once(b.keep(&mut more, K + 10)).await,
            "a larger one waits"
        );
        drop(first);
        assert_eq!(process.available_permits(), 150);
        assert!(at_once(a.keep(&mut second, 100)).await);
        assert_eq!(
            process.available_permits(),
            150,
            "second's first bytes are uncounted"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn room_to_read_into_is_given_back_once_a_chunk_is_kept() {
        let process = Budget::process(1 << 20);
        let a = Budget::new(1 << 20, process.clone());
        let mut held = Taken::default();
        a.room(&mut held, 16_384).await;
        assert_eq!(a.connection.available_permits(), (1 << 20) - 16_384);
        assert_eq!(process.available_permits(), 1 << 20, "room is not kept");
        // The chunk that came held 1,000 bytes.
        a.keep(&mut held, 1_000).await;
        assert_eq!(a.connection.available_permits(), (1 << 20) - 1_000);
        a.room(&mut held, K + 16_384).await;
        a.keep(&mut held, K + 5_000).await;
        assert_eq!(process.available_permits(), (1 << 20) - 5_000);
        assert_eq!(a.connection.available_permits(), (1 << 20) - K - 5_000);
        drop(held);
        assert_eq!(a.connection.available_permits(), 1 << 20);
        assert_eq!(process.available_permits(), 1 << 20);
    }
}
