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
//! [`GroupMemory`] keeps each group's last answer, which decisions made
//! without Redis report limit by limit. Groups take no sub-buckets.

use std::num::NonZeroU32;
use std::sync::Arc;

use super::super::decision::{Ask, BucketSpec, Decision, Grant, GroupGrant, GroupLimit};
use super::super::keymap::{Idle, KeyMap};
use super::super::lease::Plan;
use super::super::shard;
use super::super::store::SharedStore;
use super::{Limiter, LimiterCore, SlotGuard};
use crate::clock::SharedClock;
use crate::key::{BucketKey, RouteId, TenantId, in_sub_group};
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
}

impl GroupVerdict {
    /// Whether a refusal comes from limits in shadow mode only.
    pub fn refused_in_shadow_only(&self) -> bool {
        !self.allowed
            && self
                .limits
                .iter()
                .filter(|l| l.decision.retry_after_ms > 0)
                .all(|l| l.mode == Mode::Shadow)
    }
}

/// How long a group's last answer is kept beyond its longest wait, for
/// the leases and refusals answered from it.
const MEMORY_MS: u64 = 10_000;

/// A group's last answer from Redis.
#[derive(Debug, Clone)]
struct Memory {
    /// Each limit's decision, in group order.
    decisions: Arc<[Decision]>,
    /// When it was answered (ms of the clock).
    at_ms: u64,
    /// When it may be forgotten.
    until_ms: u64,
}

impl Idle for Memory {
    fn is_idle(&self, now_ms: u64) -> bool {
        now_ms >= self.until_ms
    }

    fn last_used_ms(&self) -> u64 {
        self.at_ms
    }
}

/// Each group's last answer from Redis, keyed by the group's keys: what a
/// decision made without Redis (from the group's lease, or by the
/// over-limit cache) reports for each limit.
pub(crate) struct GroupMemory {
    /// Group key → its last answer.
    answers: KeyMap<Memory>,
    /// Reads now.
    clock: SharedClock,
}

impl GroupMemory {
    /// A memory of at most about `max_keys` groups.
    pub(crate) fn new(max_keys: usize, clock: SharedClock) -> Self {
        Self {
            answers: KeyMap::new(max_keys),
            clock,
        }
    }

    /// Keeps Redis's answer for the group `key`.
    fn remember(&self, key: &str, decisions: &[Decision]) {
        let now = self.clock.now_ms();
        let longest = decisions
            .iter()
            .map(|d| d.retry_after_ms)
            .max()
            .unwrap_or(0);
        let memory = Memory {
            decisions: Arc::from(decisions),
            at_ms: now,
            until_ms: now + longest + MEMORY_MS,
        };
        self.answers
            .with(key, now, || memory.clone(), |m| *m = memory.clone());
    }

    /// Each limit's decision when `decision`, for the whole group of `len`
    /// limits, was made without Redis: the last answer's, the waits counted
    /// down, with the limit that binds (fewest left, or the longest wait)
    /// reporting `decision` itself.
    fn recall(&self, key: &str, len: usize, decision: Decision) -> Vec<Decision> {
        let now = self.clock.now_ms();
        let mut decisions = self
            .answers
            .get(key, |m| {
                let passed = now.saturating_sub(m.at_ms);
                m.decisions
                    .iter()
                    .map(|d| Decision {
                        allowed: decision.allowed,
                        remaining: d.remaining,
                        retry_after_ms: match d.retry_after_ms {
                            0 => 0,
                            wait => wait.saturating_sub(passed).max(1),
                        },
                    })
                    .collect::<Vec<_>>()
            })
            .filter(|d| d.len() == len)
            .unwrap_or_else(|| vec![decision; len]);
        let binding = if decision.allowed {
            decisions
                .iter()
                .enumerate()
                .min_by_key(|(_, d)| d.remaining)
        } else {
            decisions
                .iter()
                .enumerate()
                .max_by_key(|(_, d)| d.retry_after_ms)
        }
        .map(|(i, _)| i);
        if let Some(i) = binding {
            decisions[i] = decision;
        }
        decisions
    }

    /// Drops the answers no longer needed.
    pub(crate) fn sweep(&self) {
        self.answers.sweep(self.clock.now_ms());
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

/// One randomly chosen sub-group of `group`, split `shards` ways: each
/// key in its sub-group's slot, each limit at 1/shards.
fn sub_group(group: &[(String, GroupLimit)], shards: NonZeroU32) -> Vec<(String, GroupLimit)> {
    let shard = shard::pick(shards);
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

impl LimiterCore {
    /// Decides a group locally, each limit at its 1/N share.
    fn local_group(&self, group: &[(String, GroupLimit)], cost: NonZeroU32) -> Vec<Decision> {
        let n = self.live.get();
        let divided: Vec<(String, GroupLimit)> = group
            .iter()
            .map(|(key, limit)| (key.clone(), limit.scaled(1.0 / f64::from(n.get()))))
            .collect();
        self.local
            .take_group(&divided, Ask::single(cost.get()))
            .decisions
    }
}

impl<S: SharedStore> Limiter<S> {
    /// Takes `cost` from every limit in force for `tenant` on `route`
    /// (this region's `share` of each), or from none when one refuses.
    pub async fn check_group(
        &self,
        tenant: &TenantId,
        route: &RouteId,
        in_force: &InForce,
        share: f64,
        cost: NonZeroU32,
    ) -> GroupVerdict {
        let core = &self.core;
        let started = core.clock.now_micros();
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
        let exact =
            in_force.limit.exact || in_force.tenant_wide.as_ref().is_some_and(|(l, _)| l.exact);
        // A sharded rule (never beside a `*` rule) is decided in one of its
        // sub-groups: every limit at 1/k, the keys under a tag of their
        // own. Each must hold at least one request's cost.
        let smallest = group.iter().map(|(_, l)| l.size()).min().unwrap_or(1);
        let shards = NonZeroU32::new(
            in_force
                .limit
                .shards
                .get()
                .min(u32::try_from(smallest / u64::from(cost.get())).unwrap_or(u32::MAX)),
        )
        .filter(|_| in_force.tenant_wide.is_none())
        .unwrap_or(NonZeroU32::MIN);
        let (decisions, source) = match (&self.redis, &core.breaker) {
            (Some(redis), Some(topology)) => {
                let sub = (shards.get() > 1).then(|| sub_group(&group, shards));
                let asked = sub.as_deref().unwrap_or(&group);
                let first = asked.first().map_or("", |(key, _)| key.as_str());
                if topology.allows(first) {
                    let (mut decisions, source) =
                        self.shared_group(redis, asked, exact, cost).await;
                    if sub.is_some() && source != DecisionSource::Local {
                        // Remaining of one sub-group, scaled to the whole
                        // limit.
                        for (decision, (_, limit)) in decisions.iter_mut().zip(&group) {
                            decision.remaining =
                                (decision.remaining * u64::from(shards.get())).min(limit.size());
                        }
                    }
                    (decisions, source)
                } else {
                    self.group_fallback(&group, cost)
                }
            }
            (Some(_), None) => self.group_fallback(&group, cost),
            (None, _) => (core.local_group(&group, cost), DecisionSource::Local),
        };
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
        let verdict = GroupVerdict {
            allowed,
            limits,
            source,
        };
        let elapsed = core.clock.now_micros().saturating_sub(started);
        core.metrics.decision(source, elapsed as f64 / 1e6);
        verdict
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
        // Wait (bounded) for another request's lease at most twice, then
        // ask Redis alone.
        let mut waits = 0;
        let (ask, owner) = loop {
            match core.hot.plan(&key, &spec, n, exact, waits < 2) {
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
                core.hot.record(&key, &binding(&grant), n, owner);
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
                self.group_fallback(group, cost)
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
                    core.hot.record(key, &binding(&grant), 0, true);
                    slot.disarm();
                }
                Ok(_) => tracing::debug!("A group lease top-up got a reply of the wrong size."),
                Err(e) => tracing::debug!(error = %e, "A group lease top-up got no answer."),
            }
        });
    }

    /// A local group decision standing in for Redis, counted as a fallback.
    fn group_fallback(
        &self,
        group: &[(String, GroupLimit)],
        cost: NonZeroU32,
    ) -> (Vec<Decision>, DecisionSource) {
        let decisions = self.core.local_group(group, cost);
        self.core
            .metrics
            .fallback(decisions.iter().all(|d| d.allowed));
        (decisions, DecisionSource::Local)
    }
}
