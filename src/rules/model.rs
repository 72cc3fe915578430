//! Rules and the immutable snapshot the request path reads.
//!
//! Owns [`Limit`], [`Rule`], [`RuleSet`] and [`RuleSpec`], the one
//! validation of a rule, whatever it came from: the rules file, a database
//! row or change event, the saved snapshot or an admin request. A `RuleSet`
//! is built per load and never changed once published; the cache swaps
//! whole snapshots, so a lookup is one hash probe with no lock and no
//! allocation (the composite key is assembled in a stack buffer).
//!
//! Memory: one map entry per rule, keyed `tenant/route` (`/` never occurs in
//! an id), so 100,000 rules stay in the low tens of MB.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use crate::config::LimitSettings;
use crate::key::{PAIR_KEY_BUF, PAIR_SEP, RouteId, TenantId, TenantName, pair_key};

/// Most sub-buckets one rule may be split into.
pub const MAX_SHARDS: u32 = 64;

/// A rate limit and how it is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// Burst size in tokens.
    pub capacity: NonZeroU32,
    /// Tokens added per second.
    pub refill_per_second: NonZeroU32,
    /// Sub-buckets the limit is split into (1 ..= [`MAX_SHARDS`]), each
    /// with 1/shards of capacity and refill, spread over Redis Cluster nodes.
    pub shards: NonZeroU32,
    /// Exact mode: never lease tokens in batches for this pair.
    pub exact: bool,
    /// Whether a refusal is enforced (429) or only counted.
    pub mode: Mode,
}

impl Limit {
    /// A limit in one bucket, leases allowed, enforced.
    pub fn new(capacity: NonZeroU32, refill_per_second: NonZeroU32) -> Self {
        Self {
            capacity,
            refill_per_second,
            shards: NonZeroU32::MIN,
            exact: false,
            mode: Mode::Enforce,
        }
    }
}

/// What a rule does with a request it refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Answer 429 (the default).
    #[default]
    Enforce,
    /// Forward it anyway and count it as `shadow_rejected`: a dry run of a
    /// new limit. Tokens are taken as under `Enforce`.
    Shadow,
}

impl Mode {
    /// The mode as written in rules: `enforce` or `shadow`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enforce => "enforce",
            Self::Shadow => "shadow",
        }
    }

    /// Reads `enforce` or `shadow`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "enforce" => Some(Self::Enforce),
            "shadow" => Some(Self::Shadow),
            _ => None,
        }
    }
}

/// A capacity or refill value: `1..=i32::MAX` (what the database column
/// holds), else `None`.
pub fn positive_i32(value: i64) -> Option<NonZeroU32> {
    i32::try_from(value)
        .ok()
        .and_then(|v| u32::try_from(v).ok())
        .and_then(NonZeroU32::new)
}

/// A shard count: `1..=MAX_SHARDS`, else `None`.
pub fn shard_count(value: i64) -> Option<NonZeroU32> {
    u32::try_from(value)
        .ok()
        .filter(|v| *v <= MAX_SHARDS)
        .and_then(NonZeroU32::new)
}

impl From<LimitSettings> for Limit {
    fn from(s: LimitSettings) -> Self {
        Self::new(s.capacity, s.refill_per_second)
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
    /// The tenant's display name in logs and metric labels.
    pub name: Option<TenantName>,
}

/// A rule as a source states it, not yet checked: every source (file,
/// database row, change event, snapshot, admin request) fills one in and
/// calls [`RuleSpec::validate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSpec {
    /// Tenant id as written.
    pub tenant: String,
    /// Route id as written.
    pub route: String,
    /// Burst size as written.
    pub capacity: i64,
    /// Tokens per second as written.
    pub refill_per_second: i64,
    /// Sub-buckets as written (1 when the source does not say).
    pub shards: i64,
    /// Exact mode.
    pub exact: bool,
    /// Mode as written (`enforce` or `shadow`); `None` when the source
    /// does not say: enforce.
    pub mode: Option<String>,
    /// Display name as written, if any.
    pub name: Option<String>,
}

/// One field of a [`RuleSpec`] that is not valid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldProblem {
    /// The field, named as in the rules file and the admin API.
    pub field: &'static str,
    /// What is wrong, with the value found.
    pub message: String,
}

impl std::fmt::Display for FieldProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Largest capacity or refill, as shown in messages.
const I32_MAX: u32 = i32::MAX.unsigned_abs();

impl RuleSpec {
    /// A spec with one bucket, no exact mode, enforced, and no name.
    pub fn new(tenant: &str, route: &str, capacity: i64, refill_per_second: i64) -> Self {
        Self {
            tenant: tenant.to_owned(),
            route: route.to_owned(),
            capacity,
            refill_per_second,
            shards: 1,
            exact: false,
            mode: None,
            name: None,
        }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// Every invalid field, in the order tenant, route, capacity,
    /// refill_per_second, shards, mode, name.
    pub fn validate(self) -> Result<Rule, Vec<FieldProblem>> {
        let mut problems = Vec::new();
        let mut bad = |field, message: String| problems.push(FieldProblem { field, message });
        let tenant = TenantId::parse(&self.tenant)
            .map_err(|e| bad("tenant", format!("{:?} {e}", self.tenant)))
            .ok();
        let route = RouteId::parse(&self.route)
            .map_err(|e| bad("route", format!("{:?} {e}", self.route)))
            .ok();
        let mut number = |field, value: i64, valid: fn(i64) -> Option<NonZeroU32>, max: u32| {
            let checked = valid(value);
            if checked.is_none() {
                bad(field, format!("must be between 1 and {max}, found {value}"));
            }
            checked
        };
        let capacity = number("capacity", self.capacity, positive_i32, I32_MAX);
        let refill = number(
            "refill_per_second",
            self.refill_per_second,
            positive_i32,
            I32_MAX,
        );
        let shards = number("shards", self.shards, shard_count, MAX_SHARDS);
        let mode = match self.mode.as_deref() {
            None => Mode::Enforce,
            Some(text) => Mode::parse(text).unwrap_or_else(|| {
                bad(
                    "mode",
                    format!("must be \"enforce\" or \"shadow\", found {text:?}"),
                );
                Mode::Enforce
            }),
        };
        let name = match self.name.as_deref().map(TenantName::parse) {
            None => None,
            Some(Ok(name)) => Some(name),
            Some(Err(e)) => {
                bad("name", format!("{:?} {e}", self.name.unwrap_or_default()));
                None
            }
        };
        match (tenant, route, capacity, refill, shards) {
            (Some(tenant), Some(route), Some(capacity), Some(refill_per_second), Some(shards))
                if problems.is_empty() =>
            {
                Ok(Rule {
                    tenant,
                    route,
                    limit: Limit {
                        capacity,
                        refill_per_second,
                        shards,
                        exact: self.exact,
                        mode,
                    },
                    name,
                })
            }
            _ => Err(problems),
        }
    }
}

impl From<&Rule> for RuleSpec {
    fn from(rule: &Rule) -> Self {
        Self {
            tenant: rule.tenant.to_string(),
            route: rule.route.to_string(),
            capacity: i64::from(rule.limit.capacity.get()),
            refill_per_second: i64::from(rule.limit.refill_per_second.get()),
            shards: i64::from(rule.limit.shards.get()),
            exact: rule.limit.exact,
            mode: Some(rule.limit.mode.as_str().to_owned()),
            name: rule.name.as_ref().map(ToString::to_string),
        }
    }
}

/// Where a snapshot came from, for `/ready`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotOrigin {
    /// Source kind: `file`, `database`, `snapshot` (saved copy) or
    /// `default` (nothing loaded yet).
    pub source: &'static str,
    /// Unix seconds when the rules were read from that source.
    pub loaded_at_unix: u64,
}

/// What a snapshot keeps per rule.
#[derive(Debug, Clone)]
struct Entry {
    /// The limit.
    limit: Limit,
    /// The tenant's display name, if the rule gives one.
    name: Option<TenantName>,
}

/// All rules in force, plus the default for pairs without one.
#[derive(Debug, Clone)]
pub struct RuleSet {
    /// `tenant/route` → limit and name.
    rules: HashMap<Arc<str>, Entry>,
    /// Limit for pairs without a rule.
    default: Limit,
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
        let mut set = Self {
            rules: HashMap::new(),
            default,
            origin,
        };
        for rule in rules {
            set.upsert(&rule);
        }
        set
    }

    /// Sets the rule of `rule.tenant` on `rule.route`.
    pub fn upsert(&mut self, rule: &Rule) {
        // Validated ids always fit.
        if let Some(key) = pair_key(
            &mut [0; PAIR_KEY_BUF],
            rule.tenant.as_str(),
            rule.route.as_str(),
        ) {
            self.rules.insert(
                Arc::from(key),
                Entry {
                    limit: rule.limit,
                    name: rule.name.clone(),
                },
            );
        }
    }

    /// Removes the rule of `tenant` on `route`, if any.
    pub fn remove(&mut self, tenant: &TenantId, route: &RouteId) {
        if let Some(key) = pair_key(&mut [0; PAIR_KEY_BUF], tenant.as_str(), route.as_str()) {
            self.rules.remove(key);
        }
    }

    /// Replaces the provenance (after an incremental change).
    pub fn set_origin(&mut self, origin: SnapshotOrigin) {
        self.origin = origin;
    }

    /// The limit for `tenant` on `route`: its rule, or the default.
    pub fn limit_for(&self, tenant: &str, route: &str) -> Limit {
        self.rule_for(tenant, route).unwrap_or(self.default)
    }

    /// The explicit rule for `tenant` on `route`, if there is one.
    pub fn rule_for(&self, tenant: &str, route: &str) -> Option<Limit> {
        let mut buf = [0; PAIR_KEY_BUF];
        let key = pair_key(&mut buf, tenant, route)?;
        self.rules.get(key).map(|entry| entry.limit)
    }

    /// The rule of `tenant` on `route`, if there is one.
    pub fn find(&self, tenant: &TenantId, route: &RouteId) -> Option<Rule> {
        let mut buf = [0; PAIR_KEY_BUF];
        let key = pair_key(&mut buf, tenant.as_str(), route.as_str())?;
        self.rules.get(key).map(|entry| Rule {
            tenant: tenant.clone(),
            route: route.clone(),
            limit: entry.limit,
            name: entry.name.clone(),
        })
    }

    /// Every rule, in no particular order.
    pub fn rules(&self) -> impl Iterator<Item = Rule> + '_ {
        self.rules.iter().filter_map(|(key, entry)| {
            let (tenant, route) = key.split_once(PAIR_SEP)?;
            Some(Rule {
                tenant: TenantId::parse(tenant).ok()?,
                route: RouteId::parse(route).ok()?,
                limit: entry.limit,
                name: entry.name.clone(),
            })
        })
    }

    /// The tenant of every rule with the name that rule gives (a tenant
    /// with several rules appears once per rule).
    pub fn tenants(&self) -> impl Iterator<Item = (&str, Option<&TenantName>)> + '_ {
        self.rules.iter().filter_map(|(key, entry)| {
            key.split_once(PAIR_SEP)
                .map(|(tenant, _)| (tenant, entry.name.as_ref()))
        })
    }

    /// Number of explicit rules.
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// Whether there are no explicit rules.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The default limit.
    pub fn default_limit(&self) -> Limit {
        self.default
    }

    /// Where and when these rules were read.
    pub fn origin(&self) -> SnapshotOrigin {
        self.origin
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(c: u32, r: u32) -> Limit {
        Limit::new(NonZeroU32::new(c).unwrap(), NonZeroU32::new(r).unwrap())
    }

    fn rule(t: &str, r: &str, l: Limit) -> Rule {
        Rule {
            tenant: TenantId::parse(t).unwrap(),
            route: RouteId::parse(r).unwrap(),
            limit: l,
            name: None,
        }
    }

    #[test]
    fn a_spec_reports_every_bad_field_at_once() {
        let spec = RuleSpec {
            shards: 65,
            mode: Some("dry-run".into()),
            name: Some("_x".into()),
            ..RuleSpec::new("{x}", "a:b", 0, 3_000_000_000)
        };
        let fields: Vec<_> = spec
            .validate()
            .unwrap_err()
            .iter()
            .map(|p| p.field)
            .collect();
        assert_eq!(
            fields,
            [
                "tenant",
                "route",
                "capacity",
                "refill_per_second",
                "shards",
                "mode",
                "name"
            ]
        );
    }

    #[test]
    fn a_rule_that_does_not_say_is_enforced() {
        let rule = RuleSpec::new("acme", "search", 20, 10).validate().unwrap();
        assert_eq!(rule.limit.mode, Mode::Enforce);
    }

    #[test]
    fn a_valid_spec_becomes_a_rule_and_back() {
        let spec = RuleSpec {
            shards: 4,
            exact: true,
            mode: Some("shadow".into()),
            name: Some("Acme EU".into()),
            ..RuleSpec::new("acme", "search", 20, 10)
        };
        let rule = spec.clone().validate().unwrap();
        assert_eq!(rule.limit.shards.get(), 4);
        assert_eq!(rule.limit.mode, Mode::Shadow);
        assert_eq!(rule.name.as_ref().unwrap().as_str(), "Acme EU");
        assert_eq!(RuleSpec::from(&rule), spec);
    }

    const ORIGIN: SnapshotOrigin = SnapshotOrigin {
        source: "file",
        loaded_at_unix: 0,
    };

    #[test]
    fn explicit_rules_win_and_the_default_covers_the_rest() {
        let set = RuleSet::new(
            vec![rule("shop-a", "create-order", limit(200, 100))],
            limit(20, 10),
            ORIGIN,
        );
        assert_eq!(set.limit_for("shop-a", "create-order"), limit(200, 100));
        assert_eq!(set.limit_for("shop-a", "other"), limit(20, 10));
        assert_eq!(set.limit_for("shop-b", "create-order"), limit(20, 10));
        assert_eq!(
            set.limit_for(&"x".repeat(200), "create-order"),
            limit(20, 10)
        );
        assert_eq!(set.len(), 1);
    }

    #[test]
    fn tenant_and_route_boundaries_do_not_collide() {
        let set = RuleSet::new(
            vec![rule("a", "b.c", limit(1, 1)), rule("a.b", "c", limit(2, 2))],
            limit(9, 9),
            ORIGIN,
        );
        assert_eq!(set.limit_for("a", "b.c"), limit(1, 1));
        assert_eq!(set.limit_for("a.b", "c"), limit(2, 2));
    }

    #[test]
    fn upsert_and_remove_change_single_rules() {
        let mut set = RuleSet::new(vec![rule("t", "r", limit(5, 1))], limit(20, 10), ORIGIN);
        set.upsert(&rule("t", "r", limit(7, 2)));
        set.upsert(&rule("u", "r", limit(3, 3)));
        assert_eq!(set.limit_for("t", "r"), limit(7, 2));
        set.remove(
            &TenantId::parse("t").unwrap(),
            &RouteId::parse("r").unwrap(),
        );
        assert_eq!(set.limit_for("t", "r"), limit(20, 10));
        let mut all: Vec<_> = set.rules().map(|r| r.tenant.to_string()).collect();
        all.sort();
        assert_eq!(all, vec!["u"]);
    }
}
