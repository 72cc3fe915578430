//! A worker's decision queues: the tickets decisions wait on, each group's
//! queue, and the buffers kept for reuse.
//!
//! Owns the bookkeeping of [`super::Coalesced`] and nothing else: no call
//! is made and no task is spawned here. Everything lives on one worker's
//! thread, inside the client's `RefCell`.
//!
//! Invariant: a ticket is in use from [`Pool::issue`] until
//! [`Pool::release`], and only then issued again.

use std::collections::{HashMap, VecDeque};
use std::task::Waker;

use redis::cluster_routing::Slot;
use tokio::time::Instant;

use crate::bucket::decision::{Ask, BucketSpec, GroupLimit};
use crate::bucket::store::{Answer, Item};
use crate::redis_client::RedisCallError;

/// Which calls may share a script call: every key on a single server, the
/// keys of one hash slot on a Cluster.
#[derive(Debug, Clone, Copy)]
pub(super) enum Group {
    /// One Redis server: one group.
    Server,
    /// One slot of a Redis Cluster.
    Slot(Slot),
}

/// A decision waiting for a call, owning what the call needs of it.
pub(super) enum Job {
    /// One bucket: its key, the bucket in force, what to take.
    One(String, BucketSpec, Ask),
    /// Every limit of one request (each limit's key, and the limit in
    /// force), and what to take from each.
    Group(Vec<(String, GroupLimit)>, Ask),
}

impl Job {
    /// What the store is asked for it.
    pub(super) fn item(&self) -> Item<'_> {
        match self {
            Self::One(key, spec, ask) => Item::One(key, *spec, *ask),
            Self::Group(limits, ask) => Item::Group(limits, *ask),
        }
    }
}

/// One decision's place in the client.
#[derive(Default)]
pub(super) struct Ticket {
    /// Its job, until its call goes out.
    pub(super) job: Option<Job>,
    /// When it queued.
    pub(super) queued_at: Option<Instant>,
    /// What its call answered, until the decision reads it.
    pub(super) answer: Option<Result<Answer, RedisCallError>>,
    /// Who to wake when the answer comes.
    pub(super) waker: Option<Waker>,
    /// Whether the decision stopped waiting (its request is gone).
    pub(super) gone: bool,
}

/// The decisions of one group, and its calls in flight.
#[derive(Default)]
pub(super) struct Queue {
    /// Tickets not sent yet, oldest first.
    pub(super) waiting: VecDeque<usize>,
    /// How many calls of this group are in flight.
    pub(super) in_flight: usize,
}

/// Everything the client keeps between calls.
#[derive(Default)]
pub(super) struct State {
    /// Each group with decisions waiting or a call in flight.
    pub(super) queues: Queues,
    /// The tickets and the buffers kept for reuse.
    pub(super) pool: Pool,
}

/// The queue of each group: one for a single server, found without
/// hashing; one per slot with work on a Cluster.
#[derive(Default)]
pub(super) struct Queues {
    /// The single server's.
    pub(super) server: Queue,
    /// Each slot's with decisions waiting or a call in flight.
    pub(super) slots: HashMap<Slot, Queue>,
}

impl Queues {
    /// `group`'s queue, made when it has none.
    pub(super) fn entry(&mut self, group: Group) -> &mut Queue {
        match group {
            Group::Server => &mut self.server,
            Group::Slot(slot) => self.slots.entry(slot).or_default(),
        }
    }

    /// `group`'s queue, if it has one.
    pub(super) fn get_mut(&mut self, group: Group) -> Option<&mut Queue> {
        match group {
            Group::Server => Some(&mut self.server),
            Group::Slot(slot) => self.slots.get_mut(&slot),
        }
    }

    /// One of `group`'s senders ends, nothing waiting for it: the queue
    /// is forgotten once no sender is left.
    pub(super) fn sender_ends(&mut self, group: Group) {
        let Some(queue) = self.get_mut(group) else {
            return;
        };
        queue.in_flight -= 1;
        if queue.in_flight == 0
            && let Group::Slot(slot) = group
        {
            self.slots.remove(&slot);
        }
    }
}

/// Tickets, and the buffers of finished jobs and calls kept for the next.
#[derive(Default)]
pub(super) struct Pool {
    /// Every ticket, in use or free.
    pub(super) tickets: Vec<Ticket>,
    /// Tickets free for the next decisions.
    pub(super) free: Vec<usize>,
    /// Key buffers of finished jobs.
    pub(super) spare_keys: Vec<String>,
    /// Limit lists of finished group jobs.
    pub(super) spare_limits: Vec<Vec<(String, GroupLimit)>>,
    /// Batches of finished calls.
    pub(super) spare_batches: Vec<Vec<(usize, Job)>>,
}

impl Pool {
    /// A ticket for `job`.
    pub(super) fn issue(&mut self, job: Job) -> usize {
        let ticket = Ticket {
            job: Some(job),
            queued_at: Some(Instant::now()),
            ..Ticket::default()
        };
        match self.free.pop() {
            Some(id) => {
                self.tickets[id] = ticket;
                id
            }
            None => {
                self.tickets.push(ticket);
                self.tickets.len() - 1
            }
        }
    }

    /// Tickets in use.
    pub(super) fn in_use(&self) -> usize {
        self.tickets.len() - self.free.len()
    }

    /// Frees ticket `id`, keeping its job's buffers.
    pub(super) fn release(&mut self, id: usize) {
        let ticket = std::mem::take(&mut self.tickets[id]);
        if let Some(job) = ticket.job {
            self.recycle(job);
        }
        self.free.push(id);
    }

    /// Keeps `job`'s buffers for the next jobs.
    pub(super) fn recycle(&mut self, job: Job) {
        match job {
            Job::One(mut key, ..) => {
                key.clear();
                self.spare_keys.push(key);
            }
            Job::Group(limits, _) => self.spare_limits.push(limits),
        }
    }

    /// Answers ticket `id` with `answer` and wakes its decision, or frees
    /// the ticket when its decision is gone.
    pub(super) fn answer(&mut self, id: usize, answer: Result<Answer, RedisCallError>) {
        let ticket = &mut self.tickets[id];
        if ticket.gone {
            self.release(id);
            return;
        }
        ticket.answer = Some(answer);
        if let Some(waker) = ticket.waker.take() {
            waker.wake();
        }
    }
}
