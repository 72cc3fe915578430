//! Charges: usage reported after the fact (what an answer cost, known
//! only at its end), taken from every limit in force whatever it holds, or
//! given back, in one atomic call ([`Limiter::charge`]).
//!
//! A charge takes the same path as a group decision ([`super::group`])
//! without the hot-key shortcuts: it always goes to Redis (one of a
//! sharded rule's sub-groups, picked at random), and then brings the
//! hot-key state it changed up to date, so that the over-limit cache
//! never answers from before a refund or a debt. Without an answer from
//! Redis it is taken from the local 1/N share.

use super::super::decision::{Ask, Decision};
use super::super::shard;
use super::super::store::SharedStore;
use super::group::{limits_in_force, shards_for, sub_group};
use super::{GroupVerdict, Limiter};
use crate::key::{RouteId, TenantId};
use crate::rules::InForce;
use crate::telemetry::DecisionSource;

impl<S: SharedStore> Limiter<S> {
    /// Charges `amount` (gives it back when negative) to every limit in
    /// force for `tenant` on `route` (this region's `share` of each),
    /// whatever they hold: usage reported after the fact, in one atomic
    /// call. Never refused: each limit's decision says what it holds
    /// afterwards (a debt shows as none left, with the wait until one
    /// request's token exists). A sharded rule's charge goes to one of
    /// its sub-groups, picked at random; without an answer from Redis the
    /// local limiter's 1/N share is charged.
    pub async fn charge(
        &self,
        tenant: &TenantId,
        route: &RouteId,
        in_force: &InForce,
        share: f64,
        amount: i64,
    ) -> GroupVerdict {
        let core = &self.core;
        let started = core.clock.now_micros();
        let (group, parts) = limits_in_force(tenant, route, in_force, share);
        let ask = Ask::charge(amount);
        let shared = match (&self.redis, &core.breaker) {
            (Some(redis), Some(topology)) => {
                let shards = shards_for(in_force, &group, 1);
                let sub;
                let target = if shards.get() > 1 {
                    sub = sub_group(&group, shards, shard::pick(shards));
                    &sub
                } else {
                    &group
                };
                let first = target.first().map_or("", |(key, _)| key.as_str());
                if topology.allows(first) {
                    match redis.take_group(target, ask).await {
                        Ok(grant) if grant.decisions.len() == group.len() => {
                            let mut decisions = grant.decisions;
                            // The hot-key state of what was charged (one
                            // bucket's, or the group's) follows it.
                            let key = target
                                .iter()
                                .map(|(key, _)| key.as_str())
                                .collect::<Vec<_>>()
                                .join("|");
                            let left = Decision {
                                allowed: true,
                                remaining: decisions.iter().map(|d| d.remaining).min().unwrap_or(0),
                                retry_after_ms: decisions
                                    .iter()
                                    .map(|d| d.retry_after_ms)
                                    .max()
                                    .unwrap_or(0),
                            };
                            core.hot.charged(&key, &left);
                            if target.len() > 1 {
                                core.answers.remember(&key, &decisions);
                            }
                            for (decision, (_, limit)) in decisions.iter_mut().zip(&group) {
                                decision.remaining = (decision.remaining * u64::from(shards.get()))
                                    .min(limit.size());
                            }
                            Some(decisions)
                        }
                        outcome => {
                            if let Err(e) = outcome {
                                tracing::debug!(error = %e, "No answer from Redis; charging locally.");
                            }
                            None
                        }
                    }
                } else {
                    None
                }
            }
            _ => None,
        };
        let (decisions, source) = match shared {
            Some(decisions) => (decisions, DecisionSource::Redis),
            None if self.redis.is_some() => self.group_fallback(&group, ask),
            None => (core.local_group(&group, ask), DecisionSource::Local),
        };
        core.group_verdict(&group, decisions, parts, source, started)
    }
}
