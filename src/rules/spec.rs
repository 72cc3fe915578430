//! A rule as its sources state it, and the one validation of a rule.
//!
//! Owns [`RuleSpec`] and [`LimitSpec`], the one declaration of a rule's
//! fields: the rules file, a change event's payload, the saved snapshot
//! and an admin request all read this shape (unknown fields refused), and
//! a database row is converted to it; [`RuleSpec::validate`] turns it into
//! a [`Rule`] or names every bad field. Adding a field to rules is one edit
//! here (plus a migration for the database's column).

use std::num::NonZeroU32;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::limits::{LimitKind, MAX_LIMITS, Window};
use super::model::{Limit, MAX_SHARDS, Mode, Rule};
use crate::key::{RouteId, TenantId, TenantName};

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

/// One `[[rule.limit]]` (or one entry of an admin request's `limits`) as
/// written: a bucket (`capacity` and `refill_per_second`), a quota
/// (`quota` with `window` or `window_seconds`) or a concurrency limit
/// (`concurrent`).
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
    /// Requests in flight at once, for a concurrency limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrent: Option<i64>,
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
            LimitKind::Concurrent { slots } => Self {
                concurrent: Some(i64::from(slots.get())),
                ..Self::default()
            },
        }
    }
}

/// A rule as every source states it, not yet checked: the one shape read
/// from a `[[rule]]` of the rules file, a change event's payload, the
/// saved snapshot and an admin request (whose path gives `tenant` and
/// `route`), and filled in from a database row. Unknown fields are
/// refused; [`RuleSpec::validate`] checks the values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    /// Tenant id as written.
    pub tenant: String,
    /// Route id as written.
    pub route: String,
    /// Burst size as written; `None` when the first of `limits` is the
    /// rule's bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<i64>,
    /// Tokens per second as written (with `capacity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill_per_second: Option<i64>,
    /// Further limits as written: `[[rule.limit]]` tables in the rules
    /// file, a `limits` list elsewhere.
    #[serde(default, alias = "limit", skip_serializing_if = "Vec::is_empty")]
    pub limits: Vec<LimitSpec>,
    /// Sub-buckets as written (1 when the source does not say).
    #[serde(default = "one_shard")]
    pub shards: i64,
    /// Exact mode.
    #[serde(default)]
    pub exact: bool,
    /// Mode as written (`enforce` or `shadow`); `None` when the source
    /// does not say: enforce.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Display name as written, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// `shards` when a source does not say.
fn one_shard() -> i64 {
    1
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
        let mut concurrent = false;
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
                if let LimitKind::Concurrent { .. } = kind {
                    if concurrent {
                        bad(
                            "limits.concurrent",
                            "a rule holds at most one concurrency limit".into(),
                        );
                    }
                    concurrent = true;
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
        // quotas (or a concurrency limit) first keeps every limit among
        // its further ones.
        let first = match kinds.first() {
            Some(&LimitKind::Bucket {
                capacity,
                refill_per_second,
            }) => Some((true, capacity, refill_per_second, 1)),
            Some(_) => Some((false, NonZeroU32::MIN, NonZeroU32::MIN, 0)),
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

/// Checks one further limit: exactly one of the three shapes.
fn limit_kind(bad: &mut impl FnMut(&'static str, String), spec: &LimitSpec) -> Option<LimitKind> {
    let bucket = spec.capacity.is_some() || spec.refill_per_second.is_some();
    let quota = spec.quota.is_some() || spec.window.is_some() || spec.window_seconds.is_some();
    let concurrent = spec.concurrent.is_some();
    match (bucket, quota, concurrent) {
        (false, false, true) => {
            let slots = number(
                bad,
                "limits.concurrent",
                spec.concurrent,
                positive_i32,
                I32_MAX,
            );
            Some(LimitKind::Concurrent { slots: slots? })
        }
        (true, false, false) => {
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
        (false, true, false) => {
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
                "a limit is either capacity and refill_per_second, a quota with its window, \
                 or concurrent"
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::model::{RuleSet, SnapshotOrigin, limits_of};

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
        let at_once = |n| LimitSpec {
            concurrent: Some(n),
            ..LimitSpec::default()
        };
        assert_eq!(fields(vec![at_once(0)], 1), ["limits.concurrent"]);
        assert_eq!(
            fields(vec![at_once(2), at_once(3)], 1),
            ["limits.concurrent"]
        );
        let with_quota = LimitSpec {
            concurrent: Some(2),
            ..quota(5, "day")
        };
        assert_eq!(fields(vec![with_quota], 1), ["limits"]);
    }

    #[test]
    fn a_concurrency_limit_reads_from_toml_and_travels_back() {
        let spec: RuleSpec =
            toml::from_str("tenant = \"acme\"\nroute = \"chat\"\n[[limit]]\nconcurrent = 4\n")
                .unwrap();
        let rule = spec.clone().validate().unwrap();
        assert!(!rule.limit.bucket, "a concurrency limit is no first bucket");
        let kinds: Vec<LimitKind> = rule.limits().collect();
        assert_eq!(
            kinds,
            [LimitKind::Concurrent {
                slots: NonZeroU32::new(4).unwrap()
            }]
        );
        assert_eq!(RuleSpec::from(&rule).limits, spec.limits);
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
        let default = Limit::new(NonZeroU32::new(20).unwrap(), NonZeroU32::new(10).unwrap());
        let origin = SnapshotOrigin {
            source: "file",
            loaded_at_unix: 0,
        };
        let set = RuleSet::new(vec![rule], default, origin);
        assert!(!set.in_force("acme", "search").is_single());
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
}
