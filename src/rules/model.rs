//! Rules and the immutable snapshot the request path reads.
//!
//! Owns [`Limit`], [`Rule`] and [`RuleSet`]. A `RuleSet` is built once per
//! load and never mutated; the cache swaps whole snapshots, so a lookup is a
//! pair of hash probes with no lock and no allocation.

use std::collections::HashMap;
use std::num::NonZeroU32;

use crate::config::LimitSettings;
use crate::key::{RouteId, TenantId};

/// A rate limit: bucket size and refill rate, both > 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// Burst size in tokens.
    pub capacity: NonZeroU32,
    /// Tokens added per second.
    pub refill_per_second: NonZeroU32,
}

impl From<LimitSettings> for Limit {
    fn from(s: LimitSettings) -> Self {
        Self {
            capacity: s.capacity,
            refill_per_second: s.refill_per_second,
        }
    }
}

/// The limit of one (tenant, route) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// The tenant (API key).
    pub tenant: TenantId,
    /// The route id.
    pub route: RouteId,
    /// Its limit.
    pub limit: Limit,
}

/// Where a snapshot came from, for `/ready`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotOrigin {
    /// Source kind, e.g. `file`.
    pub source: &'static str,
    /// Unix seconds when the rules were read.
    pub loaded_at_unix: u64,
}

/// All rules in force, plus the default for pairs without one.
#[derive(Debug, Clone)]
pub struct RuleSet {
    /// tenant → route → limit.
    by_tenant: HashMap<TenantId, HashMap<RouteId, Limit>>,
    /// Limit for pairs without a rule.
    default: Limit,
    /// Number of explicit rules.
    len: usize,
    /// Provenance.
    origin: SnapshotOrigin,
}

impl RuleSet {
    /// A snapshot of `rules` (later entries win on duplicates) with `default`.
    pub fn new(
        rules: impl IntoIterator<Item = Rule>,
        default: Limit,
        origin: SnapshotOrigin,
    ) -> Self {
        let mut by_tenant: HashMap<TenantId, HashMap<RouteId, Limit>> = HashMap::new();
        for rule in rules {
            by_tenant
                .entry(rule.tenant)
                .or_default()
                .insert(rule.route, rule.limit);
        }
        let len = by_tenant.values().map(HashMap::len).sum();
        Self {
            by_tenant,
            default,
            len,
            origin,
        }
    }

    /// The limit for `tenant` on `route`: its rule, or the default.
    pub fn limit_for(&self, tenant: &str, route: &str) -> Limit {
        self.rule_for(tenant, route).unwrap_or(self.default)
    }

    /// The explicit rule for `tenant` on `route`, if there is one.
    pub fn rule_for(&self, tenant: &str, route: &str) -> Option<Limit> {
        self.by_tenant.get(tenant)?.get(route).copied()
    }

    /// Number of explicit rules.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no explicit rules.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The default limit.
    pub fn default_limit(&self) -> Limit {
        self.default
    }

    /// Where and when these rules were read.
    pub fn origin(&self) -> &SnapshotOrigin {
        &self.origin
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(c: u32, r: u32) -> Limit {
        Limit {
            capacity: NonZeroU32::new(c).unwrap(),
            refill_per_second: NonZeroU32::new(r).unwrap(),
        }
    }

    #[test]
    fn explicit_rules_win_and_the_default_covers_the_rest() {
        let rules = vec![Rule {
            tenant: TenantId::parse("shop-a").unwrap(),
            route: RouteId::parse("create-order").unwrap(),
            limit: limit(200, 100),
        }];
        let origin = SnapshotOrigin {
            source: "file",
            loaded_at_unix: 0,
        };
        let set = RuleSet::new(rules, limit(20, 10), origin);
        assert_eq!(set.limit_for("shop-a", "create-order"), limit(200, 100));
        assert_eq!(set.limit_for("shop-a", "other"), limit(20, 10));
        assert_eq!(set.limit_for("shop-b", "create-order"), limit(20, 10));
        assert_eq!(set.len(), 1);
    }
}
