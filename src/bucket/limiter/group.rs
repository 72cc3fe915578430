//! Decisions under several limits: a route rule's further limits, or a
//! tenant-wide rule beside the route's own ([`InForce`]).
//!
//! Owns [`Limiter::check_group`]: every limit at once in one atomic call,
//! the same count taken from all or from none; with the breaker open, or
//! Redis failing, the local limiter at 1/N of each limit, quotas counted
//! from zero in the current window. A group (its keys together) has
//! hot-key state like one bucket's ([`super::super::lease`]), against its
//! tightest limit ([`tightest`]): leases taken from every limit at once,
//! and the over-limit cache, so a tenant that spent a day's quota and
//! keeps asking costs Redis one call per wait, not one per request.
//! [`super::memory::GroupMemory`] keeps each group's last answer, which decisions made
//! without Redis report limit by limit. A sharded rule's group is decided
//! in its sub-groups, from a random one on until one admits.

use std::num::NonZeroU32;

use super::super::decision::{Ask, BucketSpec, Decision, Grant, GroupGrant, GroupLimit, Holder};
use super::super::lease::Plan;
use super::super::shard;
use super::super::store::SharedStore;
use super::slots::SlotHold;
use super::{Limiter, LimiterCore, SlotGuard};
use crate::key::{BucketKey, RouteId, TenantId, in_sub_group};
use crate::redis_client::Topology;
use crate::rules::model::{Mode, limits_of};
use crate::rules::{InForce, LimitKind, MAX_LIMITS};
use crate::telemetry::DecisionSource;

/// One limit's part in a decision under several limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitVerdict {
    /// The limit in force (after the region's share).
    pub limit: GroupLimit,
    /// Its decision; `allowed` is the request's.
    pub decision: Decision,
    /// Whether it belongs to the tenant-wide rule.
    pub tenant_wide: bool,
    /// Its place in its rule (0: the first bucket).
    pub index: usize,
    /// Its rule's mode.
    pub mode: Mode,
}

/// A decision under several limits.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupVerdict {
    /// Whether every limit admitted the request.
    pub allowed: bool,
    /// Each limit's part, the route's rule first.
    pub limits: Vec<LimitVerdict>,
    /// Which limiter decided.
    pub source: DecisionSource,
    /// The request's concurrency slots, when its limits hold any and it
    /// was admitted: held until this guard (every clone) is dropped.
    pub held: Option<SlotHold>,
}

impl GroupVerdict {
    /// Whether the request's cost was taken: from every limit when
    /// admitted, from the enforced ones when only limits in shadow mode
    /// refused and the enforced ones, asked alone, admitted.
    pub fn took(&self) -> bool {
        self.allowed || self.limits.iter().any(|l| l.decision.allowed)
    }

    /// Whether a refusal comes from limits in shadow mode only.
    pub fn refused_in_shadow_only(&self) -> bool {
        !self.allowed
            && self
                .limits
                .iter()
                // A limit refuses when it lacks the tokens (a group's
                // verdict is every key's `allowed`; an enforced limit
                // asked again alone has its own).
                .filter(|l| !l.decision.allowed && l.decision.retry_after_ms > 0)
                .all(|l| l.mode == Mode::Shadow)
    }
}

/// The bucket a group leases against: its smallest size, refilled at its
/// slowest rate (a quota's: its size over its window).
fn tightest(group: &[(String, GroupLimit)]) -> BucketSpec {
    let size = group.iter().map(|(_, l)| l.size()).min().unwrap_or(1);
    let rate = group
        .iter()
        .map(|(_, l)| match l {
            GroupLimit::Bucket(spec) => spec.refill_per_second,
            GroupLimit::Quota { quota, window } => {
                f64::from(quota.get()) / window.nominal_seconds() as f64
            }
            GroupLimit::Slots { .. } => f64::INFINITY,
        })
        .fold(f64::INFINITY, f64::min);
    BucketSpec {
        capacity: NonZeroU32::new(u32::try_from(size).unwrap_or(u32::MAX))
            .unwrap_or(NonZeroU32::MIN),
        refill_per_second: if rate.is_finite() && rate > 0.0 {
            rate
        } else {
            1.0
        },
    }
}

/// Sub-group `shard` of `group`, split `shards` ways: each key in its
/// sub-group's slot, each limit at 1/shards.
pub(super) fn sub_group(
    group: &[(String, GroupLimit)],
    shards: NonZeroU32,
    shard: u32,
) -> Vec<(String, GroupLimit)> {
    group
        .iter()
        .map(|(key, limit)| (in_sub_group(key, shard), limit.divided(shards)))
        .collect()
}

/// A group's grant as one bucket's, for the hot-key state: the count
/// taken, the binding limit's decision (fewest left; on a refusal, the
/// longest wait) and the longest block.
fn binding(grant: &GroupGrant) -> Grant {
    let decision = if grant.granted > 0 {
        grant.decisions.iter().min_by_key(|d| d.remaining)
    } else {
        grant.decisions.iter().max_by_key(|d| d.retry_after_ms)
    };
    Grant {
        granted: grant.granted,
        decision: decision.copied().unwrap_or(Decision {
            allowed: false,
            remaining: 0,
            retry_after_ms: grant.block_ms,
        }),
        block_ms: grant.block_ms,
    }
}

/// What a group's limits are: each one's part in the verdict (tenant-wide,
/// its place in its rule, its rule's mode).
type Parts = Vec<(bool, usize, Mode)>;

/// The limits in force for `tenant` on `route` (this region's `share` of
/// each) as one group, the route's rule first, with each one's part.
pub(super) fn limits_in_force(
    tenant: &TenantId,
    route: &RouteId,
    in_force: &InForce,
    share: f64,
) -> (Vec<(String, GroupLimit)>, Parts) {
    let mut parts = Vec::with_capacity(MAX_LIMITS);
    let mut group = Vec::with_capacity(MAX_LIMITS);
    let wide = RouteId::all();
    let rules = std::iter::once((route, in_force.limit, &in_force.more)).chain(
        in_force
            .tenant_wide
            .as_ref()
            .map(|(limit, more)| (&wide, *limit, more)),
    );
    for (scope, limit, more) in rules {
        for (index, kind) in limits_of(limit, more) {
            if group.len() == MAX_LIMITS {
                break;
            }
            let (key, limit_in_force) = match kind {
                LimitKind::Bucket {
                    capacity,
                    refill_per_second,
                } => (
                    BucketKey::further(tenant, scope, index, ""),
                    GroupLimit::Bucket(BucketSpec::of(capacity, refill_per_second)),
                ),
                LimitKind::Quota { quota, window } => (
                    BucketKey::further(tenant, scope, index, &window.script_code()),
                    GroupLimit::Quota { quota, window },
                ),
                // Held by no one yet: a take names its holder.
                LimitKind::Concurrent { slots } => (
                    BucketKey::further(tenant, scope, index, "c"),
                    GroupLimit::Slots {
                        slots,
                        holder: Holder::default(),
                    },
                ),
            };
            let key = if index == 0 {
                BucketKey::new(tenant, scope)
            } else {
                key
            };
            group.push((key.into_string(), limit_in_force.scaled(share)));
            parts.push((scope.is_all(), index, limit.mode));
        }
    }
    (group, parts)
}

/// The sub-groups a sharded rule's `group` is decided in (1 when it is
/// not sharded, or stands beside a `*` rule): at most the rule's shards,
/// each sub-group holding at least `cost` on every limit.
pub(super) fn shards_for(
    in_force: &InForce,
    group: &[(String, GroupLimit)],
    cost: u32,
) -> NonZeroU32 {
    let smallest = group.iter().map(|(_, l)| l.size()).min().unwrap_or(1);
    NonZeroU32::new(
        in_force
            .limit
            .shards
            .get()
            .min(u32::try_from(smallest / u64::from(cost.max(1))).unwrap_or(u32::MAX)),
    )
    .filter(|_| in_force.tenant_wide.is_none())
    .unwrap_or(NonZeroU32::MIN)
}

impl LimiterCore {
    /// Decides a group locally as `ask` says, each limit at its 1/N share.
    pub(super) fn local_group(&self, group: &[(String, GroupLimit)], ask: Ask) -> Vec<Decision> {
        let n = self.live.get();
        let divided: Vec<(String, GroupLimit)> = group
            .iter()
            .map(|(key, limit)| (key.clone(), limit.scaled(1.0 / f64::from(n.get()))))
            .collect();
        self.local.take_group(&divided, ask).decisions
    }

    /// A group's verdict from its limits' `decisions` made by `source`,
    /// counting the decision's time since `started` (µs).
    pub(super) fn group_verdict(
        &self,
        group: &[(String, GroupLimit)],
        decisions: Vec<Decision>,
        parts: Parts,
        source: DecisionSource,
        started: u64,
    ) -> GroupVerdict {
        let allowed = decisions.iter().all(|d| d.allowed);
        let limits = group
            .iter()
            .zip(decisions)
            .zip(parts)
            .map(
                |(((_, limit), decision), (tenant_wide, index, mode))| LimitVerdict {
                    limit: *limit,
                    decision,
                    tenant_wide,
                    index,
                    mode,
                },
            )
            .collect();
        let elapsed = self.clock.now_micros().saturating_sub(started);
        self.metrics.decision(source, elapsed as f64 / 1e6);
        GroupVerdict {
            allowed,
            limits,
            source,
            held: None,
        }
    }
}

impl<S: SharedStore> Limiter<S> {
    /// Takes `cost` from every limit in force for `tenant` on `route`
    /// (this region's `share` of each), or from none when one refuses; a
    /// concurrency limit's slot is held for `holder` (a fresh holder when
    /// `None`; see [`Limiter::release_slots`]).
    ///
    /// A refusal by limits in shadow mode alone spares none of the
    /// enforced ones: those are asked again on their own, so that a
    /// request let through in shadow mode takes from every enforced limit,
    /// and is refused when they cannot cover it.
    pub async fn check_group(
        &self,
        tenant: &TenantId,
        route: &RouteId,
        in_force: &InForce,
        share: f64,
        cost: NonZeroU32,
        holder: Option<u64>,
    ) -> GroupVerdict {
        let core = &self.core;
        let started = core.clock.now_micros();
        let (mut group, parts) = limits_in_force(tenant, route, in_force, share);
        let (decisions, source, held) = self.take_group(&mut group, in_force, cost, holder).await;
        let mut verdict = GroupVerdict {
            held,
            ..core.group_verdict(&group, decisions, parts, source, started)
        };
        let enforced = |l: &LimitVerdict| l.mode == Mode::Enforce;
        if verdict.refused_in_shadow_only() && verdict.limits.iter().any(enforced) {
            let mut alone: Vec<_> = group
                .iter()
                .zip(&verdict.limits)
                .filter(|(_, l)| enforced(l))
                .map(|(limit, _)| limit.clone())
                .collect();
            let (decisions, source, held) =
                self.take_group(&mut alone, in_force, cost, holder).await;
            let asked = verdict.limits.iter_mut().filter(|l| enforced(l));
            for (l, ((_, limit), decision)) in asked.zip(alone.into_iter().zip(decisions)) {
                (l.limit, l.decision) = (limit, decision);
            }
            (verdict.source, verdict.held) = (source, held);
        }
        verdict
    }

    /// Takes `cost` from every limit of `group` or from none, through
    /// Redis (sharded when `in_force` says so), or locally when Redis
    /// cannot be asked; slots are held for `holder`.
    async fn take_group(
        &self,
        group: &mut [(String, GroupLimit)],
        in_force: &InForce,
        cost: NonZeroU32,
        holder: Option<u64>,
    ) -> (Vec<Decision>, DecisionSource, Option<SlotHold>) {
        let core = &self.core;
        if group.iter().any(|(_, limit)| limit.is_slots()) {
            return self.take_slots(group, cost, holder).await;
        }
        let exact =
            in_force.limit.exact || in_force.tenant_wide.as_ref().is_some_and(|(l, _)| l.exact);
        // A sharded rule (never beside a `*` rule) is decided in one of its
        // sub-groups: every limit at 1/k, the keys under a tag of their
        // own. Each must hold at least one request's cost.
        let shards = shards_for(in_force, group, cost.get());
        let (decisions, source) = match (&self.redis, &core.breaker) {
            (Some(redis), Some(topology)) if shards.get() > 1 => {
                self.sharded_group(redis, topology, group, shards, exact, cost)
                    .await
            }
            (Some(redis), Some(topology)) => {
                let first = group.first().map_or("", |(key, _)| key.as_str());
                if topology.allows(first) {
                    self.shared_group(redis, group, exact, cost).await
                } else {
                    self.group_fallback(group, Ask::single(cost.get()))
                }
            }
            (Some(_), None) => self.group_fallback(group, Ask::single(cost.get())),
            (None, _) => (
                core.local_group(group, Ask::single(cost.get())),
                DecisionSource::Local,
            ),
        };
        (decisions, source, None)
    }

    /// A sharded rule's group, decided in its sub-groups (every limit at
    /// 1/k, the keys under a tag of their own) from a random one on until
    /// one admits: refused only when none can take the request, quoting
    /// the refusal that passes soonest. Remaining counts are one
    /// sub-group's × k, an estimate of the whole limit's.
    async fn sharded_group(
        &self,
        redis: &S,
        topology: &Topology,
        group: &[(String, GroupLimit)],
        shards: NonZeroU32,
        exact: bool,
        cost: NonZeroU32,
    ) -> (Vec<Decision>, DecisionSource) {
        let k = shards.get();
        let start = shard::pick(shards);
        let soonest = |decisions: &[Decision]| decisions.iter().map(|d| d.retry_after_ms).max();
        let mut refused: Option<(Vec<Decision>, DecisionSource)> = None;
        for i in 0..k {
            let sub = sub_group(group, shards, (start + i) % k);
            if !topology.allows(sub.first().map_or("", |(key, _)| key.as_str())) {
                return self.group_fallback(group, Ask::single(cost.get()));
            }
            let (mut decisions, source) = self.shared_group(redis, &sub, exact, cost).await;
            if source == DecisionSource::Local {
                return (decisions, source);
            }
            for (decision, (_, limit)) in decisions.iter_mut().zip(group) {
                decision.remaining = (decision.remaining * u64::from(k)).min(limit.size());
            }
            if decisions.iter().all(|d| d.allowed) {
                return (decisions, source);
            }
            if refused
                .as_ref()
                .is_none_or(|(r, _)| soonest(&decisions) < soonest(r))
            {
                refused = Some((decisions, source));
            }
        }
        // Every one of the k ≥ 2 sub-groups refused.
        refused.unwrap_or_else(|| self.group_fallback(group, Ask::single(cost.get())))
    }

    /// The hot-key path of a group, the breaker closed: the group's lease
    /// or over-limit cache when they answer (every limit reporting the
    /// group's last answer from Redis), else one call, a lease batch taken
    /// from every limit at once when the group is hot; the local limiter
    /// when the call fails.
    async fn shared_group(
        &self,
        redis: &S,
        group: &[(String, GroupLimit)],
        exact: bool,
        cost: NonZeroU32,
    ) -> (Vec<Decision>, DecisionSource) {
        let core = &self.core;
        let n = cost.get();
        let key = group
            .iter()
            .map(|(key, _)| key.as_str())
            .collect::<Vec<_>>()
            .join("|");
        let spec = tightest(group);
        let hot = core.hot.key(&key);
        // Wait (bounded) for another request's lease at most twice, then
        // ask Redis alone.
        let mut waits = 0;
        let (ask, owner) = loop {
            match core.hot.plan(hot, &spec, n, exact, waits < 2) {
                Plan::Local(decision, source) => {
                    return (core.answers.recall(&key, group.len(), decision), source);
                }
                Plan::Refresh { decision, ask } => {
                    self.refresh_group(redis, &key, group, ask);
                    let recalled = core.answers.recall(&key, group.len(), decision);
                    return (recalled, DecisionSource::Lease);
                }
                Plan::Call { ask, owner } => break (ask, owner),
                Plan::Wait(lease) => {
                    waits += 1;
                    let _ = tokio::time::timeout(redis.timeout(), lease).await;
                }
            }
        };
        let mut settle = owner.then(|| SlotGuard::new(&**core, key.as_str()));
        match redis.take_group(group, ask).await {
            Ok(grant) if grant.decisions.len() == group.len() => {
                core.hot.record(hot, &binding(&grant), n, owner);
                // record() released the slot.
                if let Some(guard) = settle.as_mut() {
                    guard.disarm();
                }
                let mut decisions = grant.decisions;
                // Tokens leased for later requests are still the tenant's
                // on every limit.
                let leased = u64::from(grant.granted.saturating_sub(n));
                for decision in &mut decisions {
                    decision.remaining += leased;
                }
                // Decisions made without Redis (from a lease, or while the
                // group is blocked) report this answer; a plain admission
                // that leaves room needs none kept.
                if leased > 0 || grant.block_ms > 0 {
                    core.answers.remember(&key, &decisions);
                }
                (decisions, DecisionSource::Redis)
            }
            outcome => {
                drop(settle);
                if let Err(e) = outcome {
                    tracing::debug!(error = %e, "No answer from Redis; deciding locally.");
                }
                self.group_fallback(group, Ask::single(cost.get()))
            }
        }
    }

    /// Fetches a hot group's next lease in the background, as
    /// [`Limiter::refresh`] does for one bucket.
    fn refresh_group(&self, redis: &S, key: &str, group: &[(String, GroupLimit)], ask: Ask) {
        let (redis, group) = (redis.clone(), group.to_vec());
        let mut slot = SlotGuard::new(self.core.clone(), key.to_owned());
        actix_web::rt::spawn(async move {
            let (core, key): (&LimiterCore, &str) = (&slot.core, &slot.key);
            match redis.take_group(&group, ask).await {
                Ok(grant) if grant.decisions.len() == group.len() => {
                    core.answers.remember(key, &grant.decisions);
                    // No request waits on this call: every token granted
                    // is leased. record() releases the slot.
                    core.hot
                        .record(core.hot.key(key), &binding(&grant), 0, true);
                    slot.disarm();
                }
                Ok(_) => tracing::debug!("A group lease top-up got a reply of the wrong size."),
                Err(e) => tracing::debug!(error = %e, "A group lease top-up got no answer."),
            }
        });
    }

    /// A local group decision standing in for Redis, counted as a fallback.
    pub(super) fn group_fallback(
        &self,
        group: &[(String, GroupLimit)],
        ask: Ask,
    ) -> (Vec<Decision>, DecisionSource) {
        let decisions = self.core.local_group(group, ask);
        self.core
            .metrics
            .fallback(decisions.iter().all(|d| d.allowed));
        (decisions, DecisionSource::Local)
    }
}
