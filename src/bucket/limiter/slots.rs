//! Concurrency limits: slots held in the shared store while requests run.
//!
//! Owns [`Holders`] (a holder id per request, unique across the cluster)
//! and [`SlotHold`], the guard of one request's slots. While a guard lives, a
//! task renews its slots every third of the lease; when the last clone of
//! it is dropped, the task gives them back. A gateway that dies stops
//! renewing, and its slots come back when their lease runs out. Slots
//! taken while Redis is away are held by the local limiter, at 1/N of
//! each concurrency limit, and released the same way; a hold taken in
//! Redis stays there whatever happens to Redis meanwhile (a renewal that
//! cannot reach it is tried again at the next turn, and a hold found lost
//! is counted).

use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;

use super::group::{GroupVerdict, limits_in_force};
use super::{Limiter, LimiterCore};
use crate::bucket::decision::{Ask, Decision, GroupGrant, GroupLimit, Holder};
use crate::bucket::store::SharedStore;
use crate::key::{RouteId, TenantId};
use crate::redis_client::RedisCallError;
use crate::rules::InForce;
use crate::telemetry::DecisionSource;

/// Hands out holder ids: a count, mixed with this process's random seed.
pub(super) struct Holders {
    /// Random per process, so that two gateways' ids differ.
    instance: u64,
    /// The next count.
    next: AtomicU64,
    /// Each hold's lease.
    lease_ms: u32,
}

impl Holders {
    /// Holders whose slots last `lease` unless renewed.
    pub(super) fn new(lease: Duration) -> Self {
        Self {
            instance: RandomState::new().hash_one(std::process::id()),
            next: AtomicU64::new(0),
            lease_ms: u32::try_from(lease.as_millis()).unwrap_or(u32::MAX).max(1),
        }
    }

    /// Holder `id`, named by the request (see [`holder_id`]).
    pub(super) fn named(&self, id: u64) -> Holder {
        Holder {
            id,
            lease_ms: self.lease_ms,
        }
    }

    /// A holder no other hold alive in the cluster has: a count mixed
    /// by a bijection (splitmix64's finaliser) with this process's seed,
    /// so that one process never repeats an id and two processes' ids
    /// meet only by 64-bit chance.
    pub(super) fn next(&self) -> Holder {
        let count = self.next.fetch_add(1, Ordering::Relaxed);
        let mut z = self
            .instance
            .wrapping_add(count.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Holder {
            id: z ^ (z >> 31),
            lease_ms: self.lease_ms,
        }
    }
}

/// Where a request's slots are held.
pub(super) enum Place<S> {
    /// In the shared store.
    Shared(S),
    /// In this gateway's local limiter.
    Local,
}

/// The guard of one request's concurrency slots: they are held, and
/// renewed, until the last clone is dropped.
#[derive(Clone)]
pub struct SlotHold(Arc<oneshot::Sender<()>>);

impl std::fmt::Debug for SlotHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SlotHold")
    }
}

impl SlotHold {
    /// Stops renewing the slots without giving them back: they end with
    /// their lease. For a request whose end this gateway does not see.
    pub fn keep_until_lease_ends(self) {
        if let Ok(guard) = Arc::try_unwrap(self.0) {
            let _ = guard.send(());
        }
    }
}

impl PartialEq for SlotHold {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// How a hold's renewals ended.
enum Ended {
    /// Its guard was dropped: the request ended; give the slots back.
    Dropped,
    /// Its guard was detached: the slots end with their lease.
    Detached,
    /// A renewal found a slot gone (its lease ran out first).
    Lost,
}

/// Holds the slots of `group` (the request's concurrency limits, each
/// naming its holder, just taken at `place`) until the guard is dropped,
/// renewing them every third of the lease.
pub(super) fn hold<S: SharedStore>(
    core: Arc<LimiterCore>,
    place: Place<S>,
    group: Vec<(String, GroupLimit)>,
) -> SlotHold {
    let (guard, mut dropped) = oneshot::channel::<()>();
    let lease_ms = group
        .iter()
        .find_map(|(_, l)| l.holder())
        .map_or(1, |h| h.lease_ms);
    let every = Duration::from_millis(u64::from(lease_ms / 3).max(1));
    core.metrics.slots_held(true);
    actix_web::rt::spawn(async move {
        // A detached guard sends (); a dropped one sends nothing.
        let end = |sent: Result<(), _>| {
            if sent.is_ok() {
                Ended::Detached
            } else {
                Ended::Dropped
            }
        };
        let mut ended = loop {
            tokio::select! {
                sent = &mut dropped => break end(sent),
                () = tokio::time::sleep(every) => {
                    match ask(&core, &place, &group, Ask::renew()).await {
                        Ok(grant) if grant.decisions.iter().any(|d| !d.allowed) => break Ended::Lost,
                        Ok(_) => {}
                        Err(e) => tracing::debug!(error = %e, "A slot renewal got no answer; trying again."),
                    }
                }
            }
        };
        if let Ended::Lost = ended {
            core.metrics.slot_lost();
            tracing::debug!("A concurrency slot's lease ran out before its request ended.");
            // Its other slots (route and tenant-wide) are still held:
            // they go back with the request, unless it is detached.
            ended = end((&mut dropped).await);
        }
        if let Ended::Dropped = ended
            && let Err(e) = ask(&core, &place, &group, Ask::release()).await
        {
            tracing::debug!(error = %e, "A slot release got no answer; its lease ends it.");
        }
        core.metrics.slots_held(false);
    });
    SlotHold(Arc::new(guard))
}

/// Asks `place` for `ask` on `group`.
async fn ask<S: SharedStore>(
    core: &LimiterCore,
    place: &Place<S>,
    group: &[(String, GroupLimit)],
    ask: Ask,
) -> Result<GroupGrant, RedisCallError> {
    match place {
        Place::Shared(store) => store.take_group(group, ask).await,
        Place::Local => Ok(core.local.take_group(group, ask)),
    }
}

impl<S: SharedStore> Limiter<S> {
    /// Takes `cost` from the limits of `group`, which holds concurrency
    /// limits, and a slot of each for a new holder, all or nothing, in one
    /// call: never from a lease or the over-limit cache (a slot frees
    /// whenever a request ends), never split into sub-groups. Redis away:
    /// the local limiter at 1/N. The guard comes back when admitted.
    pub(super) async fn take_slots(
        &self,
        group: &mut [(String, GroupLimit)],
        cost: NonZeroU32,
        holder: Option<u64>,
    ) -> (Vec<Decision>, DecisionSource, Option<SlotHold>) {
        let core = &self.core;
        let holder = match holder {
            Some(id) => core.holders.named(id),
            None => core.holders.next(),
        };
        for (_, limit) in group.iter_mut() {
            *limit = limit.held_by(holder);
        }
        let group = &*group;
        let ask = Ask::single(cost.get());
        let first = group.first().map_or("", |(key, _)| key.as_str());
        let shared = match (&self.redis, &core.breaker) {
            (Some(redis), Some(topology)) if topology.allows(first) => {
                match redis.take_group(group, ask).await {
                    Ok(grant) if grant.decisions.len() == group.len() => {
                        Some((grant.decisions, Place::Shared(redis.clone())))
                    }
                    outcome => {
                        if let Err(e) = outcome {
                            tracing::debug!(error = %e, "No answer from Redis; deciding locally.");
                        }
                        None
                    }
                }
            }
            _ => None,
        };
        let (decisions, source, place) = match shared {
            Some((decisions, place)) => (decisions, DecisionSource::Redis, place),
            None if self.redis.is_some() => {
                let (decisions, source) = self.group_fallback(group, ask);
                (decisions, source, Place::Local)
            }
            None => (
                core.local_group(group, ask),
                DecisionSource::Local,
                Place::Local,
            ),
        };
        let held = decisions.iter().all(|d| d.allowed).then(|| {
            let slots = group.iter().filter(|(_, l)| l.is_slots()).cloned();
            hold(self.core.clone(), place, slots.collect())
        });
        (decisions, source, held)
    }
}

/// The holder id of a request that names itself (Envoy's `x-request-id`,
/// a check caller's `request_id`) for `tenant`: the same on every gateway
/// and every build (FNV-1a), so that the call that ends a request
/// releases the slot the call that began it took.
pub fn holder_id(tenant: &TenantId, request: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in tenant.as_str().bytes().chain([0]).chain(request.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

impl<S: SharedStore> Limiter<S> {
    /// Gives back the slots that holder `id` holds of the concurrency
    /// limits in force for `tenant` on `route`, in one call that also
    /// reads what the other limits (this region's `share` of each) hold:
    /// the verdict of a request's end, as a charge of nothing would read
    /// it. The slots go back in Redis and in the local limiter both
    /// (where they were taken is not known here; where they were not,
    /// nothing changes); the verdict is Redis's when it answers.
    pub async fn release_slots(
        &self,
        tenant: &TenantId,
        route: &RouteId,
        in_force: &InForce,
        share: f64,
        id: u64,
    ) -> GroupVerdict {
        let core = &self.core;
        let started = core.clock.now_micros();
        let (mut group, parts) = limits_in_force(tenant, route, in_force, share);
        let holder = core.holders.named(id);
        for (_, limit) in &mut group {
            *limit = limit.held_by(holder);
        }
        let ask = Ask::release();
        let local = core.local.take_group(&group, ask).decisions;
        let shared = match &self.redis {
            Some(redis) => match redis.take_group(&group, ask).await {
                Ok(grant) if grant.decisions.len() == group.len() => Some(grant.decisions),
                outcome => {
                    if let Err(e) = outcome {
                        tracing::debug!(error = %e, "A slot release got no answer; its lease ends it.");
                    }
                    None
                }
            },
            None => None,
        };
        let (decisions, source) = match shared {
            Some(decisions) => (decisions, DecisionSource::Redis),
            None => (local, DecisionSource::Local),
        };
        core.group_verdict(&group, decisions, parts, source, started)
    }
}
