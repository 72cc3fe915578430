//! Upstream exchanges in flight per tenant, on one worker.
//!
//! Owns the bound that keeps one tenant, or a flood of fresh keys, from
//! holding every upstream connection of a worker: a tenant may have at most
//! `upstream.max_connections_per_tenant` exchanges in flight, and all
//! requests decided by the default rule (no rule for the pair) together at
//! most `upstream.max_connections_without_rule`. A request over either
//! bound is refused before any token is taken. A slot is held from before
//! the decision until the upstream's response body has been read to its
//! end (for a small answer, often as soon as its head arrives) or its
//! client is cut off; a client that goes away before the answer's head
//! leaves it held until the head arrives or the exchange times out (see
//! `forward`), so abandoning requests frees nothing the upstream still
//! works on.
//!
//! A request under a concurrency limit (`{ concurrent = N }`) keeps its
//! cluster-wide slots ([`SlotHold`]) in its slot here, so they are given back
//! at the same moment.
//!
//! Invariant: the map holds only tenants with an exchange in flight, so it
//! is bounded by the worker's connections, never by the keys seen.

use std::cell::{Cell, RefCell};
use std::hash::{BuildHasher, RandomState};
use std::rc::Rc;

use hashbrown::HashTable;

use crate::bucket::SlotHold;
use crate::config::UpstreamSettings;
use crate::key::TenantId;

/// One worker's exchanges in flight.
pub(super) struct Slots {
    /// Most exchanges of one tenant.
    per_tenant: u32,
    /// Most exchanges decided by the default rule, all tenants together.
    without_rule: u32,
    /// Exchanges in flight by tenant (only tenants with one).
    tenants: RefCell<HashTable<(TenantId, u32)>>,
    /// Hashes tenants (randomly seeded: chosen keys cannot collide on
    /// purpose); a slot keeps its tenant's hash for its release.
    hasher: RandomState,
    /// Exchanges in flight decided by the default rule.
    defaulted: Cell<u32>,
}

impl Slots {
    /// Empty slots with the bounds of `settings`.
    pub(super) fn new(settings: &UpstreamSettings) -> Rc<Self> {
        Rc::new(Self {
            per_tenant: settings.max_connections_per_tenant,
            without_rule: settings.max_connections_without_rule,
            tenants: RefCell::new(HashTable::new()),
            hasher: RandomState::new(),
            defaulted: Cell::new(0),
        })
    }

    /// A slot for `tenant`, whose pair has a rule when `has_rule`; `None`
    /// when the tenant, or the default-rule group, is at its bound.
    pub(super) fn acquire(self: &Rc<Self>, tenant: &TenantId, has_rule: bool) -> Option<Slot> {
        if !has_rule && self.defaulted.get() >= self.without_rule {
            return None;
        }
        // One lookup: the entry is found or made, then counted.
        let hash = self.hasher.hash_one(tenant.as_str());
        let mut tenants = self.tenants.borrow_mut();
        let (_, held) = tenants
            .entry(
                hash,
                |(t, _)| t == tenant,
                |(t, _)| self.hasher.hash_one(t.as_str()),
            )
            .or_insert_with(|| (tenant.clone(), 0))
            .into_mut();
        if *held >= self.per_tenant {
            return None;
        }
        *held += 1;
        if !has_rule {
            self.defaulted.set(self.defaulted.get() + 1);
        }
        Some(Slot {
            slots: Rc::clone(self),
            tenant: tenant.clone(),
            hash,
            defaulted: !has_rule,
            held: None,
        })
    }

    /// Exchanges in flight for `tenant`.
    #[cfg(test)]
    fn held(&self, tenant: &str) -> u32 {
        let hash = self.hasher.hash_one(tenant);
        let tenants = self.tenants.borrow();
        tenants
            .find(hash, |(t, _)| t.as_str() == tenant)
            .map_or(0, |(_, held)| *held)
    }
}

/// One exchange's place in its tenant's bound; released on drop.
pub(super) struct Slot {
    /// Where it is counted.
    slots: Rc<Slots>,
    /// Whose it is.
    tenant: TenantId,
    /// Its tenant's hash in [`Slots::tenants`].
    hash: u64,
    /// Whether it also counts in the default-rule group.
    defaulted: bool,
    /// The request's slots of the cluster's concurrency limits, if any:
    /// given back when this slot is.
    held: Option<SlotHold>,
}

impl Slot {
    /// Holds the request's cluster-wide concurrency slots (`held`) as
    /// long as this one.
    pub(super) fn keep(&mut self, held: Option<SlotHold>) {
        self.held = held;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut tenants = self.slots.tenants.borrow_mut();
        if let Ok(mut entry) = tenants.find_entry(self.hash, |(t, _)| *t == self.tenant) {
            let (_, held) = entry.get_mut();
            *held -= 1;
            if *held == 0 {
                entry.remove();
            }
        }
        if self.defaulted {
            self.slots
                .defaulted
                .set(self.slots.defaulted.get().saturating_sub(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn slots(per_tenant: u32, without_rule: u32) -> Rc<Slots> {
        Slots::new(&UpstreamSettings {
            connect_timeout: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            max_connections_per_worker: 256,
            max_connections_per_tenant: per_tenant,
            max_connections_without_rule: without_rule,
            idle_timeout: Duration::from_secs(1),
            ca_file: None,
        })
    }

    fn tenant(id: &str) -> TenantId {
        TenantId::parse(id).unwrap()
    }

    #[test]
    fn one_tenant_holds_at_most_its_bound() {
        let s = slots(2, 10);
        let a = tenant("a");
        let first = s.acquire(&a, true).unwrap();
        let _second = s.acquire(&a, true).unwrap();
        assert!(s.acquire(&a, true).is_none());
        assert!(
            s.acquire(&tenant("b"), true).is_some(),
            "others are not affected"
        );
        drop(first);
        assert!(s.acquire(&a, true).is_some());
    }

    #[test]
    fn fresh_keys_share_one_bound_and_leave_tenants_with_rules_alone() {
        let s = slots(64, 3);
        let flood: Vec<_> = (0..3)
            .map(|i| s.acquire(&tenant(&format!("fresh{i}")), false).unwrap())
            .collect();
        assert!(s.acquire(&tenant("fresh-next"), false).is_none());
        assert!(s.acquire(&tenant("acme"), true).is_some());
        drop(flood);
        assert!(s.acquire(&tenant("fresh-next"), false).is_some());
    }

    #[test]
    fn released_slots_leave_no_entry_behind() {
        let s = slots(4, 4);
        for i in 0..100 {
            let key = tenant(&format!("k{i}"));
            let slot = s.acquire(&key, false).unwrap();
            assert_eq!(s.held(key.as_str()), 1);
            drop(slot);
        }
        assert!(s.tenants.borrow().is_empty());
        assert_eq!(s.defaulted.get(), 0);
    }
}
