//! Rules and the immutable snapshot the request path reads.
//!
//! Owns [`Limit`], [`Rule`] and [`RuleSet`]; a rule as its sources state
//! it, and its one validation, are [`super::spec`]'s. A rule's
//! first limit is a token bucket ([`Limit`], with the rule's options);
//! further limits ([`LimitKind`]: buckets or quotas) ride beside it, and a
//! rule for route `*` holds for every route of its tenant ([`InForce`]). A `RuleSet`
//! is built per load and never changed once published; the cache swaps
//! whole snapshots, so a lookup is one hash probe with no lock and no
//! allocation (the composite key is assembled in a stack buffer).
//!
//! Memory: one map entry per rule, keyed `tenant/route` (`/` never occurs in
//! an id), so 100,000 rules stay in the low tens of MB.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use super::limits::{LimitKind, MAX_LIMITS};
use super::spec::FieldProblem;
use crate::config::LimitSettings;
use crate::key::{ALL_ROUTES, PAIR_KEY_BUF, PAIR_SEP, RouteId, TenantId, TenantName, pair_key};

/// Most sub-buckets one rule may be split into.
pub const MAX_SHARDS: u32 = 64;

/// A rate limit and how it is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// Whether the rule has a first token bucket: `false` for a rule whose
    /// limits are all further ones (quotas first), whose `capacity` and
    /// `refill_per_second` then mean nothing.
    pub bucket: bool,
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
            bucket: true,
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

impl From<LimitSettings> for Limit {
    fn from(s: LimitSettings) -> Self {
        Self::new(s.capacity, s.refill_per_second)
    }
}

/// Limits beside a rule's first bucket; `None` when there are none.
pub type More = Option<Arc<[LimitKind]>>;

/// The limits of one (tenant, route) pair, or of a tenant on every route
/// (route [`RouteId::all`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// The tenant (API key).
    pub tenant: TenantId,
    /// The route id, or [`RouteId::all`].
    pub route: RouteId,
    /// Its first limit, a token bucket, with the rule's options.
    pub limit: Limit,
    /// Its further limits (at most [`MAX_LIMITS`] in all).
    pub more: More,
    /// The tenant's display name in logs and metric labels.
    pub name: Option<TenantName>,
}

impl Rule {
    /// Every limit of the rule, its first bucket (if any) first.
    pub fn limits(&self) -> impl Iterator<Item = LimitKind> + '_ {
        limits_of(self.limit, &self.more).map(|(_, kind)| kind)
    }
}

/// Every limit of a rule whose first limit is `first`, with its place:
/// 0 for the first bucket (when the rule has one), `i` for `more[i - 1]`.
pub fn limits_of(first: Limit, more: &More) -> impl Iterator<Item = (usize, LimitKind)> + '_ {
    let bucket = first.bucket.then_some(LimitKind::Bucket {
        capacity: first.capacity,
        refill_per_second: first.refill_per_second,
    });
    let further = more.iter().flat_map(|m| m.iter().copied());
    bucket
        .map(|b| (0, b))
        .into_iter()
        .chain(further.enumerate().map(|(i, kind)| (i + 1, kind)))
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
    /// The first limit.
    limit: Limit,
    /// Further limits.
    more: More,
    /// The tenant's display name, if the rule gives one.
    name: Option<TenantName>,
}

/// Every limit in force for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct InForce {
    /// The route's rule, or the default.
    pub limit: Limit,
    /// The route rule's further limits.
    pub more: More,
    /// Whether the route has a rule of its own (else the default applies).
    pub has_rule: bool,
    /// The tenant-wide rule, if the tenant has one: its first limit and
    /// further ones.
    pub tenant_wide: Option<(Limit, More)>,
}

impl InForce {
    /// Whether only the first bucket of the route's rule is in force: no
    /// further limit and no tenant-wide rule.
    pub fn is_single(&self) -> bool {
        self.limit.bucket && self.more.is_none() && self.tenant_wide.is_none()
    }

    /// Whether a rule names the tenant: one for the route, or a
    /// tenant-wide one (else only the default applies to it).
    pub fn names_tenant(&self) -> bool {
        self.has_rule || self.tenant_wide.is_some()
    }
}

/// All rules in force, plus the default for pairs without one.
#[derive(Debug, Clone)]
pub struct RuleSet {
    /// `tenant/route` → limit and name. Looked up on every request, so
    /// hashed by foldhash (seeded per process) rather than SipHash: its
    /// keys are the operator's rules, never a client's choice.
    rules: HashMap<Arc<str>, Entry, foldhash::fast::RandomState>,
    /// Limit for pairs without a rule.
    default: Limit,
    /// How many rules are tenant-wide (none: a lookup skips looking).
    tenant_wide: usize,
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
            rules: HashMap::default(),
            default,
            tenant_wide: 0,
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
            let earlier = self.rules.insert(
                Arc::from(key),
                Entry {
                    limit: rule.limit,
                    more: rule.more.clone(),
                    name: rule.name.clone(),
                },
            );
            if earlier.is_none() && rule.route.is_all() {
                self.tenant_wide += 1;
            }
        }
    }

    /// Removes the rule of `tenant` on `route`, if any.
    pub fn remove(&mut self, tenant: &TenantId, route: &RouteId) {
        if let Some(key) = pair_key(&mut [0; PAIR_KEY_BUF], tenant.as_str(), route.as_str())
            && self.rules.remove(key).is_some()
            && route.is_all()
        {
            self.tenant_wide -= 1;
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
        self.entry(tenant, route).map(|entry| entry.limit)
    }

    /// Every limit in force for a request of `tenant` on `route`: the
    /// route's rule (or the default) and the tenant-wide rule.
    pub fn in_force(&self, tenant: &str, route: &str) -> InForce {
        let own = self.entry(tenant, route);
        InForce {
            limit: own.map_or(self.default, |entry| entry.limit),
            more: own.and_then(|entry| entry.more.clone()),
            has_rule: own.is_some(),
            tenant_wide: (self.tenant_wide > 0)
                .then(|| self.entry(tenant, ALL_ROUTES))
                .flatten()
                .map(|entry| (entry.limit, entry.more.clone())),
        }
    }

    /// What keeps `rule` from standing beside this set's other rules of its
    /// tenant, if anything: more than [`MAX_LIMITS`] limits in force for one
    /// request (a route rule with its tenant's `*` rule, a `*` rule with
    /// the tenant's largest route rule or the default), or sub-buckets on
    /// a route rule whose requests are decided with a `*` rule's limits
    /// (those decisions hold every key in the tenant's one slot).
    pub fn conflict(&self, rule: &Rule) -> Option<FieldProblem> {
        let count = |e: &Entry| limits_of(e.limit, &e.more).count();
        let tenant = rule.tenant.as_str();
        let routes = || {
            self.rules.iter().filter_map(move |(key, entry)| {
                let (t, r) = key.split_once(PAIR_SEP)?;
                (t == tenant && r != ALL_ROUTES).then_some(entry)
            })
        };
        let wide = self.entry(tenant, ALL_ROUTES);
        let (in_force, sharded) = if rule.route.is_all() {
            let widest = routes().map(count).max().unwrap_or(0).max(1);
            let sharded = routes().any(|e| e.limit.shards.get() > 1);
            (rule.limits().count() + widest, sharded)
        } else {
            let sharded = wide.is_some() && rule.limit.shards.get() > 1;
            (rule.limits().count() + wide.map_or(0, count), sharded)
        };
        if in_force > MAX_LIMITS {
            return Some(FieldProblem {
                field: "limits",
                message: format!(
                    "with the tenant's other rules, {in_force} limits would be in force for a request (at most {MAX_LIMITS})"
                ),
            });
        }
        sharded.then(|| FieldProblem {
            field: "shards",
            message: "a route rule of a tenant with a \"*\" rule is not split into sub-buckets"
                .into(),
        })
    }

    /// The entry keyed `tenant/route`.
    fn entry(&self, tenant: &str, route: &str) -> Option<&Entry> {
        let mut buf = [0; PAIR_KEY_BUF];
        let key = pair_key(&mut buf, tenant, route)?;
        self.rules.get(key)
    }

    /// The rule of `tenant` on `route`, if there is one.
    pub fn find(&self, tenant: &TenantId, route: &RouteId) -> Option<Rule> {
        let mut buf = [0; PAIR_KEY_BUF];
        let key = pair_key(&mut buf, tenant.as_str(), route.as_str())?;
        self.rules.get(key).map(|entry| Rule {
            tenant: tenant.clone(),
            route: route.clone(),
            limit: entry.limit,
            more: entry.more.clone(),
            name: entry.name.clone(),
        })
    }

    /// Every rule, in no particular order.
    pub fn rules(&self) -> impl Iterator<Item = Rule> + '_ {
        self.rules.iter().filter_map(|(key, entry)| {
            let (tenant, route) = key.split_once(PAIR_SEP)?;
            Some(Rule {
                tenant: TenantId::parse(tenant).ok()?,
                route: RouteId::parse_scope(route).ok()?,
                limit: entry.limit,
                more: entry.more.clone(),
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
            more: None,
            name: None,
        }
    }

    #[test]
    fn a_tenant_wide_rule_is_in_force_beside_the_routes_own() {
        let mut wide = rule("acme", "x", limit(100, 1));
        wide.route = RouteId::all();
        let set = RuleSet::new(
            vec![wide.clone(), rule("acme", "search", limit(5, 5))],
            limit(20, 10),
            ORIGIN,
        );
        assert_eq!(set.conflict(&rule("acme", "x", limit(1, 1))), None);
        assert_eq!(set.conflict(&wide), None);
        let sharded = Rule {
            limit: Limit {
                shards: NonZeroU32::new(4).unwrap(),
                ..limit(8, 8)
            },
            ..rule("acme", "x", limit(1, 1))
        };
        assert_eq!(set.conflict(&sharded).map(|p| p.field), Some("shards"));
        let search = set.in_force("acme", "search");
        assert!(search.has_rule);
        assert_eq!(search.limit, limit(5, 5));
        assert_eq!(search.tenant_wide.map(|(l, _)| l), Some(limit(100, 1)));
        let other = set.in_force("acme", "other");
        assert!(!other.has_rule && !other.is_single());
        assert_eq!(other.limit, limit(20, 10));
        assert!(set.in_force("globex", "search").is_single());
        assert!(set.rules().any(|r| r.route.is_all()));
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
