//! Decisions under several limits: a route rule's further limits, or a
//! tenant-wide rule beside the route's own ([`InForce`]).
//!
//! Owns [`Limiter::check_group`]: every limit at once in one atomic call,
//! the cost taken from all or from none; with the breaker open, or Redis
//! failing, the local limiter at 1/N of each limit, quotas counted from
//! zero in the current window. And the groups' over-limit cache
//! ([`GroupBlocks`]): once Redis refuses a group, this instance refuses it
//! locally until the longest of the refusing limits' waits has passed, so
//! a tenant that spends a day's quota and keeps asking costs Redis one
//! call per wait, not one per request. Such requests take no leases and
//! no sub-buckets yet.

use std::num::NonZeroU32;
use std::sync::Arc;

use super::super::decision::{BucketSpec, Decision, GroupLimit};
use super::super::keymap::{Idle, KeyMap};
use super::super::store::SharedStore;
use super::{Limiter, LimiterCore};
use crate::clock::SharedClock;
use crate::key::{BucketKey, RouteId, TenantId};
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

/// A group refused by Redis: until when, and with what answer.
#[derive(Debug, Clone)]
struct Block {
    /// The refusal's limits, as Redis answered.
    limits: Arc<[LimitVerdict]>,
    /// When it was answered (ms of the clock).
    at_ms: u64,
    /// When the longest wait ends.
    until_ms: u64,
}

impl Idle for Block {
    fn is_idle(&self, now_ms: u64) -> bool {
        now_ms >= self.until_ms
    }

    fn last_used_ms(&self) -> u64 {
        self.at_ms
    }
}

/// The over-limit cache of groups, keyed by a group's keys.
pub(crate) struct GroupBlocks {
    /// Group key → its refusal.
    blocks: KeyMap<Block>,
    /// Reads now.
    clock: SharedClock,
}

impl GroupBlocks {
    /// A cache of at most about `max_keys` groups.
    pub(crate) fn new(max_keys: usize, clock: SharedClock) -> Self {
        Self {
            blocks: KeyMap::new(max_keys),
            clock,
        }
    }

    /// The refusal in force for `key`, when its limits are still `group`'s
    /// (a changed rule ends a block), each wait shortened by the time
    /// since.
    fn refusal(&self, key: &str, group: &[(String, GroupLimit)]) -> Option<Vec<LimitVerdict>> {
        let now = self.clock.now_ms();
        self.blocks
            .get(key, |block| {
                let same = block.limits.len() == group.len()
                    && block
                        .limits
                        .iter()
                        .zip(group)
                        .all(|(l, (_, g))| l.limit == *g);
                (same && now < block.until_ms).then(|| {
                    let passed = now - block.at_ms;
                    block
                        .limits
                        .iter()
                        .map(|l| {
                            let mut l = *l;
                            if l.decision.retry_after_ms > 0 {
                                l.decision.retry_after_ms =
                                    l.decision.retry_after_ms.saturating_sub(passed).max(1);
                            }
                            l
                        })
                        .collect()
                })
            })
            .flatten()
    }

    /// Records Redis's refusal of the group `key`.
    fn block(&self, key: String, limits: &[LimitVerdict]) {
        let now = self.clock.now_ms();
        let wait = limits
            .iter()
            .map(|l| l.decision.retry_after_ms)
            .max()
            .unwrap_or(0);
        let block = Block {
            limits: Arc::from(limits),
            at_ms: now,
            until_ms: now + wait,
        };
        self.blocks
            .with(&key, now, || block.clone(), |b| *b = block.clone());
    }

    /// Drops the blocks that have ended.
    pub(crate) fn sweep(&self) {
        self.blocks.sweep(self.clock.now_ms());
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
        self.local.take_group(&divided, cost.get())
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
        let blocked_key = group
            .iter()
            .map(|(key, _)| key.as_str())
            .collect::<Vec<_>>()
            .join("|");
        if let Some(limits) = core.blocked.refusal(&blocked_key, &group) {
            core.metrics.decision(DecisionSource::Cache, 0.0);
            return GroupVerdict {
                allowed: false,
                limits,
                source: DecisionSource::Cache,
            };
        }
        let (decisions, source) = match (&self.redis, &core.breaker) {
            (Some(redis), Some(gate)) if gate.allows() => {
                match redis.take_group(&group, cost.get()).await {
                    Ok(decisions) if decisions.len() == group.len() => {
                        (decisions, DecisionSource::Redis)
                    }
                    outcome => {
                        if let Err(e) = outcome {
                            tracing::debug!(error = %e, "No answer from Redis; deciding locally.");
                        }
                        self.group_fallback(&group, cost)
                    }
                }
            }
            (Some(_), _) => self.group_fallback(&group, cost),
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
        if !allowed && source == DecisionSource::Redis {
            core.blocked.block(blocked_key, &verdict.limits);
        }
        let elapsed = core.clock.now_micros().saturating_sub(started);
        core.metrics.decision(source, elapsed as f64 / 1e6);
        verdict
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
