//! Rules and the immutable snapshot the request path reads.
//!
//! Owns [`Limit`], [`Rule`], [`RuleSet`] and [`RuleSpec`], the one
//! validation of a rule, whatever it came from: the rules file, a database
//! row or change event, the saved snapshot or an admin request. A rule's
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

use serde::{Deserialize, Serialize};

use super::limits::{LimitKind, MAX_LIMITS, Window};
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

/// One `[[rule.limit]]` (or one entry of an admin request's `limits`) as
/// written: a bucket (`capacity` and `refill_per_second`) or a quota
/// (`quota` with `window` or `window_seconds`).
/// The same shape in every source that states one (TOML, JSON).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    /// Burst size, for a bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<i64>,
    /// Tokens per second, for a bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill_per_second: Option<i64>,
    /// Requests per window, for a quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<i64>,
    /// `minute`, `hour`, `day` or `month`, for a quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    /// A fixed window's length in seconds, for a quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_seconds: Option<i64>,
}

impl From<LimitKind> for LimitSpec {
    fn from(kind: LimitKind) -> Self {
        match kind {
            LimitKind::Bucket {
                capacity,
                refill_per_second,
            } => Self {
                capacity: Some(i64::from(capacity.get())),
                refill_per_second: Some(i64::from(refill_per_second.get())),
                ..Self::default()
            },
            LimitKind::Quota { quota, window } => Self {
                quota: Some(i64::from(quota.get())),
                window: window.name().map(str::to_owned),
                window_seconds: match window {
                    Window::Seconds(s) => Some(i64::from(s.get())),
                    _ => None,
                },
                ..Self::default()
            },
        }
    }
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
    /// Burst size as written; `None` when the first of `limits` is the
    /// rule's bucket.
    pub capacity: Option<i64>,
    /// Tokens per second as written (with `capacity`).
    pub refill_per_second: Option<i64>,
    /// Further limits as written (`[[rule.limit]]`, or `limits`).
    pub limits: Vec<LimitSpec>,
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
            capacity: Some(capacity),
            refill_per_second: Some(refill_per_second),
            limits: Vec::new(),
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
    /// refill_per_second, limits, shards, mode, name.
    pub fn validate(self) -> Result<Rule, Vec<FieldProblem>> {
        let mut problems = Vec::new();
        let mut bad = |field, message: String| problems.push(FieldProblem { field, message });
        let tenant = TenantId::parse(&self.tenant)
            .map_err(|e| bad("tenant", format!("{:?} {e}", self.tenant)))
            .ok();
        let route = RouteId::parse_scope(&self.route)
            .map_err(|e| bad("route", format!("{:?} {e}", self.route)))
            .ok();
        let mut kinds = Vec::with_capacity(self.limits.len() + 1);
        match (self.capacity, self.refill_per_second) {
            (None, None) if !self.limits.is_empty() => {}
            (capacity, refill) => {
                let capacity = number(&mut bad, "capacity", capacity, positive_i32, I32_MAX);
                let refill = number(&mut bad, "refill_per_second", refill, positive_i32, I32_MAX);
                if let (Some(capacity), Some(refill_per_second)) = (capacity, refill) {
                    kinds.push(LimitKind::Bucket {
                        capacity,
                        refill_per_second,
                    });
                }
            }
        }
        let mut windows = Vec::new();
        for spec in &self.limits {
            if let Some(kind) = limit_kind(&mut bad, spec) {
                if let LimitKind::Quota { window, .. } = kind {
                    if windows.contains(&window) {
                        bad(
                            "limits.window",
                            "two quotas of one rule share a window".into(),
                        );
                    }
                    windows.push(window);
                }
                kinds.push(kind);
            }
        }
        if kinds.len() > MAX_LIMITS {
            bad(
                "limits",
                format!(
                    "at most {MAX_LIMITS} limits per rule, found {}",
                    kinds.len()
                ),
            );
        }
        // The first bucket, when the rule starts with one; a rule of
        // quotas first keeps every limit among its further ones.
        let first = match kinds.first() {
            Some(&LimitKind::Bucket {
                capacity,
                refill_per_second,
            }) => Some((true, capacity, refill_per_second, 1)),
            Some(LimitKind::Quota { .. }) => Some((false, NonZeroU32::MIN, NonZeroU32::MIN, 0)),
            None => None,
        };
        let shards = number(
            &mut bad,
            "shards",
            Some(self.shards),
            shard_count,
            MAX_SHARDS,
        );
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
        match (tenant, route, first, shards) {
            (
                Some(tenant),
                Some(route),
                Some((bucket, capacity, refill_per_second, skip)),
                Some(shards),
            ) if problems.is_empty() => {
                let more = (kinds.len() > skip).then(|| Arc::from(&kinds[skip..]));
                Ok(Rule {
                    tenant,
                    route,
                    limit: Limit {
                        bucket,
                        capacity,
                        refill_per_second,
                        shards,
                        exact: self.exact,
                        mode,
                    },
                    more,
                    name,
                })
            }
            _ => Err(problems),
        }
    }
}

/// Checks one number of a spec: present, and valid by `valid`.
fn number(
    bad: &mut impl FnMut(&'static str, String),
    field: &'static str,
    value: Option<i64>,
    valid: fn(i64) -> Option<NonZeroU32>,
    max: u32,
) -> Option<NonZeroU32> {
    let Some(value) = value else {
        bad(field, "is missing".into());
        return None;
    };
    let checked = valid(value);
    if checked.is_none() {
        bad(field, format!("must be between 1 and {max}, found {value}"));
    }
    checked
}

/// Checks one further limit: exactly one of the two shapes.
fn limit_kind(bad: &mut impl FnMut(&'static str, String), spec: &LimitSpec) -> Option<LimitKind> {
    let bucket = spec.capacity.is_some() || spec.refill_per_second.is_some();
    let quota = spec.quota.is_some() || spec.window.is_some() || spec.window_seconds.is_some();
    match (bucket, quota) {
        (true, false) => {
            let capacity = number(bad, "limits.capacity", spec.capacity, positive_i32, I32_MAX);
            let refill = number(
                bad,
                "limits.refill_per_second",
                spec.refill_per_second,
                positive_i32,
                I32_MAX,
            );
            Some(LimitKind::Bucket {
                capacity: capacity?,
                refill_per_second: refill?,
            })
        }
        (false, true) => {
            let quota = number(bad, "limits.quota", spec.quota, positive_i32, I32_MAX);
            let window = match (spec.window.as_deref(), spec.window_seconds) {
                (Some(name), None) => Window::parse(name).or_else(|| {
                    bad(
                        "limits.window",
                        format!("must be minute, hour, day or month, found {name:?}"),
                    );
                    None
                }),
                (None, Some(_)) => number(
                    bad,
                    "limits.window_seconds",
                    spec.window_seconds,
                    positive_i32,
                    I32_MAX,
                )
                .map(Window::Seconds),
                _ => {
                    bad(
                        "limits.window",
                        "a quota needs exactly one of window and window_seconds".into(),
                    );
                    None
                }
            };
            Some(LimitKind::Quota {
                quota: quota?,
                window: window?,
            })
        }
        _ => {
            bad(
                "limits",
                "a limit is either capacity and refill_per_second, or a quota with its window"
                    .into(),
            );
            None
        }
    }
}

impl From<&Rule> for RuleSpec {
    fn from(rule: &Rule) -> Self {
        Self {
            tenant: rule.tenant.to_string(),
            route: rule.route.to_string(),
            capacity: rule
                .limit
                .bucket
                .then(|| i64::from(rule.limit.capacity.get())),
            refill_per_second: rule
                .limit
                .bucket
                .then(|| i64::from(rule.limit.refill_per_second.get())),
            limits: rule
                .more
                .iter()
                .flat_map(|m| m.iter().copied().map(LimitSpec::from))
                .collect(),
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
    /// `tenant/route` → limit and name.
    rules: HashMap<Arc<str>, Entry>,
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
            rules: HashMap::new(),
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
    fn a_spec_reports_every_bad_field_at_once() {
        let spec = RuleSpec {
            shards: 65,
            mode: Some("dry-run".into()),
            name: Some("_x".into()),
            ..RuleSpec::new("{x}", "a:b", 0, 3_000_000_000)
        };
        let spec = RuleSpec {
            limits: vec![LimitSpec {
                quota: Some(5),
                ..LimitSpec::default()
            }],
            ..spec
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
                "limits.window",
                "shards",
                "mode",
                "name"
            ]
        );
    }

    fn quota(n: i64, window: &str) -> LimitSpec {
        LimitSpec {
            quota: Some(n),
            window: Some(window.into()),
            ..LimitSpec::default()
        }
    }

    #[test]
    fn further_limits_travel_with_the_rule_and_back() {
        let spec = RuleSpec {
            limits: vec![
                quota(10_000, "day"),
                LimitSpec {
                    quota: Some(50),
                    window_seconds: Some(30),
                    ..LimitSpec::default()
                },
                LimitSpec {
                    capacity: Some(1_000),
                    refill_per_second: Some(1),
                    ..LimitSpec::default()
                },
            ],
            ..RuleSpec::new("acme", "*", 20, 10)
        };
        let rule = spec.clone().validate().unwrap();
        assert!(rule.route.is_all());
        assert_eq!(rule.limits().count(), 4);
        assert_eq!(
            RuleSpec::from(&rule),
            RuleSpec {
                mode: Some("enforce".into()),
                ..spec
            }
        );
    }

    #[test]
    fn the_first_bucket_may_come_from_the_limit_tables() {
        let bucket = LimitSpec {
            capacity: Some(5),
            refill_per_second: Some(1),
            ..LimitSpec::default()
        };
        let spec = RuleSpec {
            capacity: None,
            refill_per_second: None,
            limits: vec![bucket, quota(100, "hour")],
            ..RuleSpec::new("acme", "search", 0, 0)
        };
        let rule = spec.validate().unwrap();
        assert_eq!(rule.limit.capacity.get(), 5);
        assert_eq!(rule.more.as_deref().map(<[_]>::len), Some(1));
    }

    #[test]
    fn bad_limit_lists_are_refused_by_field() {
        let fields = |limits: Vec<LimitSpec>, shards: i64| -> Vec<&'static str> {
            let spec = RuleSpec {
                capacity: None,
                refill_per_second: None,
                limits,
                shards,
                ..RuleSpec::new("acme", "search", 0, 0)
            };
            spec.validate()
                .unwrap_err()
                .iter()
                .map(|p| p.field)
                .collect()
        };
        assert_eq!(fields(vec![quota(5, "week")], 1), ["limits.window"]);
        assert_eq!(fields(Vec::new(), 1), ["capacity", "refill_per_second"]);
        let mixed = LimitSpec {
            capacity: Some(1),
            quota: Some(1),
            ..LimitSpec::default()
        };
        assert_eq!(fields(vec![mixed], 1), ["limits"]);
        let nine = (0..9)
            .map(|i| LimitSpec {
                capacity: Some(i + 1),
                refill_per_second: Some(1),
                ..LimitSpec::default()
            })
            .collect();
        assert_eq!(fields(nine, 1), ["limits"]);
        let twice = vec![
            LimitSpec {
                capacity: Some(5),
                refill_per_second: Some(1),
                ..LimitSpec::default()
            },
            quota(1, "day"),
            quota(2, "day"),
        ];
        assert_eq!(fields(twice, 1), ["limits.window"]);
    }

    #[test]
    fn a_rule_of_quotas_only_has_no_first_bucket() {
        let spec = RuleSpec {
            capacity: None,
            refill_per_second: None,
            limits: vec![quota(100, "day"), quota(5, "minute")],
            ..RuleSpec::new("acme", "search", 0, 0)
        };
        let rule = spec.clone().validate().unwrap();
        assert!(!rule.limit.bucket);
        let places: Vec<usize> = limits_of(rule.limit, &rule.more).map(|(i, _)| i).collect();
        assert_eq!(
            places,
            [1, 2],
            "no further limit takes the first bucket's place"
        );
        assert_eq!(
            RuleSpec::from(&rule),
            RuleSpec {
                mode: Some("enforce".into()),
                ..spec
            }
        );
        let set = RuleSet::new(vec![rule], limit(20, 10), ORIGIN);
        assert!(!set.in_force("acme", "search").is_single());
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
