//! Where each key's bucket lives: the deployment's shards and their
//! breakers, as every worker and actor reads them.
//!
//! Owns [`Topology`]: the current [`Layout`] (published whole, read
//! without locks), the hint that it may be stale, and the count of
//! failovers followed. A shard is one primary: the single server, the
//! primary Sentinel names, or one Cluster primary with the slots it
//! serves. Each shard has its own [`BreakerGate`], so one node's failure
//! sends only its own keys to the local fallback. A new layout keeps the
//! gate of every primary still in it; a primary new to it (a promoted
//! replica) starts closed.
//!
//! Invariants: every slot maps to at most one shard; a layout is never
//! changed once published.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use arc_swap::ArcSwap;

use super::node::NodeAddr;
use crate::breaker::{BreakerGate, State};

/// Hash slots of a Redis Cluster.
pub const SLOTS: usize = 16_384;

/// The hash slot of `key`: CRC16 (XMODEM) of its hash tag (the bytes
/// between the first `{` and the next `}`, when not empty), else of the
/// whole key, modulo [`SLOTS`].
pub fn slot_of(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    let crc = crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(key));
    // SLOTS is a power of two that fits u16.
    crc % (SLOTS as u16)
}

/// The slot table's mark for a slot no shard serves.
const UNSERVED: u16 = u16::MAX;

/// How the deployment is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One server.
    Single,
    /// A primary found and followed through Sentinel.
    Sentinel,
    /// A Redis Cluster.
    Cluster,
}

impl Mode {
    /// Lower-case name for JSON and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Single => "single",
            Self::Sentinel => "sentinel",
            Self::Cluster => "cluster",
        }
    }
}

/// One primary and what guards calls to it.
#[derive(Debug)]
pub struct Shard {
    /// Where it is reached.
    pub addr: NodeAddr,
    /// Its breaker, as the request path sees it.
    pub gate: Arc<BreakerGate>,
    /// A hash tag (`{…}`) whose slot this shard serves, for keys the
    /// breaker's probe writes.
    pub probe_tag: String,
    /// Cluster slots it serves (0 outside a Cluster).
    pub slots: u32,
}

/// One published arrangement of shards.
#[derive(Debug)]
pub struct Layout {
    /// Bumped by every publication, so connection caches know to rebuild.
    pub generation: u64,
    /// The primaries; empty until a Cluster or Sentinel has been reached.
    pub shards: Vec<Shard>,
    /// On a Cluster: each slot's shard index ([`UNSERVED`] when none).
    owners: Option<Box<[u16]>>,
}

impl Layout {
    /// The index of the shard serving `key`.
    pub fn shard_of(&self, key: &[u8]) -> Option<usize> {
        match &self.owners {
            None => (!self.shards.is_empty()).then_some(0),
            Some(owners) => {
                let owner = owners[usize::from(slot_of(key))];
                (owner != UNSERVED).then_some(usize::from(owner))
            }
        }
    }

    /// The index of the shard at `addr`.
    pub fn shard_at(&self, addr: &NodeAddr) -> Option<usize> {
        self.shards.iter().position(|s| &s.addr == addr)
    }
}

/// A primary and the slots it serves, as discovery found them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The primary.
    pub addr: NodeAddr,
    /// Inclusive slot ranges (empty outside a Cluster).
    pub ranges: Vec<(u16, u16)>,
}

/// How Redis as a whole is doing, from its shards' breakers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// No primary is known and none has been looked for yet (startup).
    Unknown,
    /// Every shard's breaker is closed.
    Up,
    /// Some shards' breakers are closed, others not.
    Partial,
    /// No shard's breaker is closed, or no primary was found.
    Down,
}

/// The deployment as every part of this gateway sees it.
#[derive(Debug)]
pub struct Topology {
    /// Single, Sentinel or Cluster.
    mode: Mode,
    /// The current layout.
    layout: ArcSwap<Layout>,
    /// Set when a call saw a sign that the layout may be out of date.
    stale: AtomicBool,
    /// Failovers followed: a slot (or, outside a Cluster, the one shard)
    /// served by another primary than before, as after a promotion (a slot
    /// moved by resharding counts too).
    failovers: AtomicU64,
    /// When the last one was followed (Unix seconds; 0 = never).
    last_failover_unix: AtomicU64,
    /// Failures counted by gates no longer in the layout.
    retired_failures: AtomicU64,
    /// Whether a lookup of the primaries has finished, found or not.
    looked_up: AtomicBool,
}

impl Topology {
    /// A topology of `mode` with no shard known yet.
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            layout: ArcSwap::from_pointee(Layout {
                generation: 0,
                shards: Vec::new(),
                owners: None,
            }),
            stale: AtomicBool::new(false),
            failovers: AtomicU64::new(0),
            last_failover_unix: AtomicU64::new(0),
            retired_failures: AtomicU64::new(0),
            looked_up: AtomicBool::new(false),
        }
    }

    /// A single server at `addr`, its breaker closed.
    pub fn single(addr: NodeAddr) -> Self {
        let topology = Self::new(Mode::Single);
        topology.publish(
            &[Owner {
                addr,
                ranges: Vec::new(),
            }],
            0,
        );
        topology
    }

    /// Single, Sentinel or Cluster.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The current layout.
    pub fn layout(&self) -> Arc<Layout> {
        self.layout.load_full()
    }

    /// Whether `key`'s shard may be called now (its breaker is closed);
    /// a key no shard serves may not.
    pub fn allows(&self, key: &str) -> bool {
        let layout = self.layout.load();
        layout
            .shard_of(key.as_bytes())
            .is_some_and(|i| layout.shards[i].gate.allows())
    }

    /// Notes that a call saw the layout may be out of date (a lost
    /// connection, a redirection, a read-only primary).
    pub fn suspect(&self) {
        self.stale.store(true, Ordering::Relaxed);
    }

    /// Whether the layout was suspected since the last call; clears it.
    pub fn take_suspicion(&self) -> bool {
        self.stale.swap(false, Ordering::Relaxed)
    }

    /// Failovers followed since start.
    pub fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Relaxed)
    }

    /// When the last failover was followed (Unix seconds), if ever.
    pub fn last_failover_unix(&self) -> Option<u64> {
        Some(self.last_failover_unix.load(Ordering::Relaxed)).filter(|&t| t > 0)
    }

    /// Failed calls reported to any shard's breaker since start.
    pub fn total_failures(&self) -> u64 {
        let layout = self.layout.load();
        self.retired_failures.load(Ordering::Relaxed)
            + layout
                .shards
                .iter()
                .map(|s| s.gate.total_failures())
                .sum::<u64>()
    }

    /// Every shard's breaker state, worst first (open, half-open,
    /// closed); `None` when no shard is known.
    pub fn worst_state(&self) -> Option<State> {
        let layout = self.layout.load();
        layout
            .shards
            .iter()
            .map(|s| s.gate.state())
            .max_by_key(|s| match s {
                State::Closed => 0,
                State::HalfOpen => 1,
                State::Open => 2,
            })
    }

    /// Notes that a lookup of the primaries finished, found or not.
    pub fn looked_up(&self) {
        self.looked_up.store(true, Ordering::Relaxed);
    }

    /// How Redis as a whole is doing.
    pub fn health(&self) -> Health {
        let layout = self.layout.load();
        let closed = layout.shards.iter().filter(|s| s.gate.allows()).count();
        match closed {
            0 if layout.shards.is_empty() && !self.looked_up.load(Ordering::Relaxed) => {
                Health::Unknown
            }
            0 => Health::Down,
            n if n == layout.shards.len() => Health::Up,
            _ => Health::Partial,
        }
    }

    /// Publishes the primaries `owners` found at `now_unix` (seconds), keeping the
    /// gate of each primary already known. Returns whether anything
    /// changed. A slot (or, outside a Cluster, the one shard) now served
    /// by a primary it was not served by counts as a failover followed.
    pub fn publish(&self, owners: &[Owner], now_unix: u64) -> bool {
        let old = self.layout.load_full();
        let owners_table = (self.mode == Mode::Cluster).then(|| {
            let mut table = vec![UNSERVED; SLOTS].into_boxed_slice();
            for (i, owner) in owners.iter().enumerate() {
                for &(start, end) in &owner.ranges {
                    for slot in start..=end.min(SLOTS as u16 - 1) {
                        table[usize::from(slot)] = u16::try_from(i).unwrap_or(UNSERVED);
                    }
                }
            }
            table
        });
        let unchanged = old.shards.len() == owners.len()
            && old.shards.iter().zip(owners).all(|(s, o)| s.addr == o.addr)
            && old.owners == owners_table;
        if unchanged {
            self.looked_up();
            return false;
        }
        let mut kept: HashMap<&NodeAddr, &Arc<BreakerGate>> =
            old.shards.iter().map(|s| (&s.addr, &s.gate)).collect();
        let shards: Vec<Shard> = owners
            .iter()
            .enumerate()
            .map(|(i, owner)| Shard {
                addr: owner.addr.clone(),
                gate: kept
                    .remove(&owner.addr)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(BreakerGate::new())),
                probe_tag: match &owners_table {
                    Some(table) => probe_tag(table, i),
                    None => "{probe}".to_owned(),
                },
                slots: slot_count(&owner.ranges),
            })
            .collect();
        let retired: u64 = kept.values().map(|g| g.total_failures()).sum();
        self.retired_failures.fetch_add(retired, Ordering::Relaxed);
        let replaced = !old.shards.is_empty()
            && match (&old.owners, &owners_table) {
                (Some(before), Some(after)) => before.iter().zip(after.iter()).any(|(b, a)| {
                    *b != UNSERVED
                        && *a != UNSERVED
                        && old.shards[usize::from(*b)].addr != shards[usize::from(*a)].addr
                }),
                _ => old.shards.first().map(|s| &s.addr) != shards.first().map(|s| &s.addr),
            };
        if replaced {
            self.failovers.fetch_add(1, Ordering::Relaxed);
            self.last_failover_unix.store(now_unix, Ordering::Relaxed);
        }
        self.looked_up();
        self.layout.store(Arc::new(Layout {
            generation: old.generation + 1,
            shards,
            owners: owners_table,
        }));
        true
    }
}

/// Slots in `ranges`.
fn slot_count(ranges: &[(u16, u16)]) -> u32 {
    ranges
        .iter()
        .map(|&(start, end)| u32::from(end.saturating_sub(start)) + 1)
        .sum()
}

/// The first tag `{probe-<n>}` whose slot shard `index` serves (or
/// `{probe}` when none is found).
fn probe_tag(owners: &[u16], index: usize) -> String {
    (0..100_000u32)
        .map(|n| format!("probe-{n}"))
        .find(|tag| usize::from(owners[usize::from(slot_of(tag.as_bytes()))]) == index)
        .map_or_else(|| "{probe}".to_owned(), |tag| format!("{{{tag}}}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(port: u16, ranges: &[(u16, u16)]) -> Owner {
        Owner {
            addr: NodeAddr::new("127.0.0.1", port),
            ranges: ranges.to_vec(),
        }
    }

    fn three() -> Vec<Owner> {
        vec![
            owner(7001, &[(0, 5460)]),
            owner(7002, &[(5461, 10922)]),
            owner(7003, &[(10923, 16383)]),
        ]
    }

    #[test]
    fn slots_follow_the_hash_tag_as_redis_computes_them() {
        // CLUSTER KEYSLOT answers on Redis 7.
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
        assert_eq!(
            slot_of(b"foo{}{bar}"),
            slot_of(b"foo{}{bar}"),
            "an empty tag hashes the key"
        );
        assert_ne!(slot_of(b"foo{}{bar}"), slot_of(b"bar"));
        assert_eq!(slot_of(b"rl:{shop-a}:orders"), slot_of(b"shop-a"));
    }

    #[test]
    fn keys_find_the_shard_serving_their_slot_and_probes_land_on_it() {
        let topology = Topology::new(Mode::Cluster);
        assert!(!topology.allows("rl:{a}:r"), "nothing known yet");
        assert!(topology.publish(&three(), 1));
        let layout = topology.layout();
        for (i, shard) in layout.shards.iter().enumerate() {
            assert_eq!(layout.shard_of(shard.probe_tag.as_bytes()), Some(i));
        }
        let slot = slot_of(b"rl:{a}:r");
        let expected = usize::from(slot > 5460) + usize::from(slot > 10922);
        assert_eq!(layout.shard_of(b"rl:{a}:r"), Some(expected));
        assert_eq!(topology.failovers(), 0);
        assert!(!topology.publish(&three(), 2), "the same layout again");
        assert_eq!(topology.layout().generation, 1);
    }

    #[test]
    fn a_promoted_replica_gets_a_closed_gate_and_the_others_keep_theirs() {
        let topology = Topology::new(Mode::Cluster);
        topology.publish(&three(), 1);
        let before = topology.layout();
        before.shards[0].gate.publish(State::Open);
        before.shards[1].gate.publish(State::Open);
        before.shards[0].gate.failure();
        assert_eq!(topology.health(), Health::Partial);
        let mut after = three();
        after[0].addr = NodeAddr::new("127.0.0.1", 7004);
        assert!(topology.publish(&after, 42));
        let layout = topology.layout();
        assert!(layout.shards[0].gate.allows(), "new primary, new gate");
        assert!(!layout.shards[1].gate.allows(), "kept");
        assert_eq!(topology.failovers(), 1);
        assert_eq!(topology.last_failover_unix(), Some(42));
        assert_eq!(
            topology.total_failures(),
            1,
            "the retired gate's count stays"
        );
    }

    #[test]
    fn unserved_slots_have_no_shard_and_single_servers_serve_every_key() {
        let topology = Topology::new(Mode::Cluster);
        topology.publish(&[owner(7001, &[(0, 99)])], 0);
        let key = |served: bool| {
            (0..)
                .map(|n| format!("{{k{n}}}"))
                .find(|k| (slot_of(k.as_bytes()) < 100) == served)
                .unwrap()
        };
        assert_eq!(topology.layout().shard_of(key(true).as_bytes()), Some(0));
        assert_eq!(topology.layout().shard_of(key(false).as_bytes()), None);
        assert!(!topology.allows(&key(false)));
        let single = Topology::single(NodeAddr::new("h", 6379));
        assert_eq!(single.layout().shard_of(b"anything"), Some(0));
        assert_eq!(single.health(), Health::Up);
        let sentinel = Topology::new(Mode::Sentinel);
        assert_eq!(sentinel.health(), Health::Unknown);
        sentinel.looked_up();
        assert_eq!(sentinel.health(), Health::Down, "looked for, not found");
        sentinel.publish(&[owner(6379, &[])], 5);
        assert_eq!(sentinel.failovers(), 0, "the first primary found");
        sentinel.publish(&[owner(6380, &[])], 9);
        assert_eq!(sentinel.failovers(), 1);
    }
}
