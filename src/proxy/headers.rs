//! Rate-limit response headers.
//!
//! Owns the header names and the arithmetic shown to clients:
//! `X-RateLimit-Limit` / `X-RateLimit-Remaining`, the IETF
//! draft-ietf-httpapi-ratelimit-headers pair `RateLimit-Policy` and
//! `RateLimit`, and `Retry-After` on rejections. Seconds are always rounded
//! up from the real wait, and a rejection never says less than 1 second and
//! always says 0 remaining. Under several limits, `RateLimit-Policy` lists
//! each (named after its rule: the route id, or `*` for the tenant-wide
//! rule, with `.<i>` for the rule's further limits) and the other fields
//! report the most restrictive one: the refusing limit with the longest
//! wait, or else the one with the fewest requests left. A worker keeps
//! the two values that depend only on a policy and its limit for the last
//! few policies it reported.

use std::cell::RefCell;

use hyper::body::Bytes;
use hyper::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};

use crate::bucket::{GroupLimit, GroupVerdict, LimitVerdict, Verdict};

/// `X-RateLimit-Limit`: the capacity in force for this request.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`: tokens left after this request, floored.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `RateLimit-Policy`: `"<policy>";q=<capacity>;w=<seconds to refill>`.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`: `"<policy>";r=<remaining>;t=<seconds until a token>`.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Whole seconds until `ms` have passed, rounded up, at least 1.
pub fn retry_after_seconds(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

/// The limit the headers report (the most restrictive one), in numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Binding {
    /// The limit, after shares and fallback division (`None` only for a
    /// group with no limit, which rules never make).
    pub limit: Option<GroupLimit>,
    /// Requests left (0 on a refusal).
    pub remaining: u64,
    /// Whole seconds until the next request may pass (0 when allowed).
    pub wait: u64,
}

/// The headers of one limiter verdict, ready to attach to any response.
#[derive(Clone)]
pub struct RateLimitHeaders {
    /// The values of `X-RateLimit-Limit`, `X-RateLimit-Remaining`,
    /// `RateLimit-Policy` and `RateLimit`, in that order: slices of one
    /// buffer, so that a request's headers cost one allocation (this runs
    /// for every request).
    values: [HeaderValue; 4],
    /// `Retry-After`, on a rejection.
    retry_after: Option<HeaderValue>,
    /// What they report.
    binding: Binding,
}

/// The names of [`RateLimitHeaders::values`], in order.
static NAMES: [HeaderName; 4] = [
    X_RATELIMIT_LIMIT,
    X_RATELIMIT_REMAINING,
    RATELIMIT_POLICY,
    RATELIMIT,
];

impl RateLimitHeaders {
    /// Headers for `verdict` under the policy named `policy` (the route id,
    /// already restricted to a header-safe charset). A `shadowed` refusal
    /// is forwarded anyway: it reports the bucket as a refusal does (0
    /// remaining, the wait in `RateLimit`) but carries no `Retry-After`.
    pub fn new(policy: &str, verdict: &Verdict, shadowed: bool) -> Self {
        let decision = &verdict.decision;
        let capacity = u64::from(verdict.spec.capacity.get());
        // A rejection says 0 remaining: none are left for this request.
        let (remaining, wait) = if decision.allowed {
            (decision.remaining, 0)
        } else {
            (0, retry_after_seconds(decision.retry_after_ms))
        };
        let window = verdict.spec.window_seconds();
        let [limit, policy_value] =
            POLICIES.with_borrow_mut(|policies| policies.values(policy, capacity, window));
        let mut values = Values::with_capacity(policy.len() + 32);
        values.number(remaining);
        values.list([((policy, None), [("r", remaining), ("t", wait)])]);
        let [remaining_value, ratelimit] = values.finish();
        Self {
            values: [limit, remaining_value, policy_value, ratelimit],
            retry_after: (!decision.allowed && !shadowed).then(|| HeaderValue::from(wait)),
            binding: Binding {
                limit: Some(GroupLimit::Bucket(verdict.spec)),
                remaining,
                wait,
            },
        }
    }

    /// Headers for a decision under several limits, on route `route`; a
    /// `shadowed` refusal carries no `Retry-After`.
    pub fn for_group(route: &str, verdict: &GroupVerdict, shadowed: bool) -> Self {
        // A limit's policy name: its rule's scope, then `.<i>` for a
        // further limit (written in place, not built per limit).
        let name = |l: &LimitVerdict| {
            let scope = if l.tenant_wide { "*" } else { route };
            (scope, (l.index > 0).then_some(l.index))
        };
        // Admitted, the binding limit is the one with the fewest left;
        // a concurrency limit's free slots say nothing of what is left
        // over time, so it binds only a rule of slots alone.
        let binding = if verdict.allowed {
            verdict
                .limits
                .iter()
                .min_by_key(|l| (l.limit.is_slots(), l.decision.remaining))
        } else {
            verdict
                .limits
                .iter()
                .max_by_key(|l| l.decision.retry_after_ms)
        };
        let (limit, remaining, wait, policy) = match binding {
            Some(l) if verdict.allowed => (Some(l.limit), l.decision.remaining, 0, name(l)),
            Some(l) => (
                Some(l.limit),
                0,
                retry_after_seconds(l.decision.retry_after_ms),
                name(l),
            ),
            None => (None, 0, 0, (route, None)),
        };
        let mut values = Values::with_capacity((route.len() + 40) * (verdict.limits.len() + 1));
        values.number(limit.map_or(0, |l| l.size()));
        values.number(remaining);
        values.list(verdict.limits.iter().map(|l| {
            let params = [("q", l.limit.size()), ("w", l.limit.window_seconds())];
            (name(l), params)
        }));
        values.list([(policy, [("r", remaining), ("t", wait)])]);
        Self {
            values: values.finish(),
            retry_after: (!verdict.allowed && !shadowed).then(|| HeaderValue::from(wait)),
            binding: Binding {
                limit,
                remaining,
                wait,
            },
        }
    }

    /// The limit these headers report, in numbers.
    pub fn binding(&self) -> Binding {
        self.binding
    }

    /// Every header, in order, `Retry-After` last when present.
    pub fn iter(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        NAMES
            .iter()
            .zip(&self.values)
            .chain(self.retry_after.iter().map(|value| (&RETRY_AFTER, value)))
    }

    /// Sets the headers on a response's `headers`, replacing any of the
    /// same names, `Retry-After` last when present. The values move into
    /// the map: nothing is copied, and nothing is left to drop.
    pub fn apply(self, headers: &mut HeaderMap) {
        // Room for all of them at once: the map grows at most once.
        headers.reserve(NAMES.len() + 1);
        for (name, value) in NAMES.iter().zip(self.values) {
            headers.insert(name.clone(), value);
        }
        if let Some(value) = self.retry_after {
            headers.insert(RETRY_AFTER, value);
        }
    }
}

/// How many policies a worker keeps the values of.
const POLICIES_KEPT: usize = 4;

thread_local! {
    /// The policies this thread met last.
    static POLICIES: RefCell<Policies> = RefCell::new(Policies::default());
}

/// The `X-RateLimit-Limit` and `RateLimit-Policy` values of the last few
/// policies a worker reported. They depend only on the policy's name and
/// its limit, which most requests share (every tenant under a route's
/// default rule), so such a request clones two values instead of writing,
/// checking and cutting them out again. A handful of entries, replaced in
/// turn: a changed limit makes new values, never grows the set.
#[derive(Default)]
struct Policies {
    /// The policies kept.
    kept: [Option<Policy>; POLICIES_KEPT],
    /// The entry the next new policy replaces.
    next: usize,
}

/// One policy's values.
struct Policy {
    /// Its name.
    name: Box<str>,
    /// Its limit's size.
    capacity: u64,
    /// Seconds its limit takes to refill.
    window: u64,
    /// `X-RateLimit-Limit` and `RateLimit-Policy`.
    values: [HeaderValue; 2],
}

impl Policies {
    /// `X-RateLimit-Limit` and `RateLimit-Policy` for the policy `name`
    /// whose limit holds `capacity` and refills in `window` seconds.
    fn values(&mut self, name: &str, capacity: u64, window: u64) -> [HeaderValue; 2] {
        let known = self.kept.iter().flatten().find(|policy| {
            policy.capacity == capacity && policy.window == window && *policy.name == *name
        });
        if let Some(policy) = known {
            return policy.values.clone();
        }
        let mut values = Values::with_capacity(name.len() + 40);
        values.number(capacity);
        values.list([((name, None), [("q", capacity), ("w", window)])]);
        let values = values.finish();
        self.kept[self.next] = Some(Policy {
            name: name.into(),
            capacity,
            window,
            values: values.clone(),
        });
        self.next = (self.next + 1) % POLICIES_KEPT;
        values
    }
}

/// A policy's name in a list: its rule's scope and, for a rule's further
/// limit, its place.
type Member<'a> = (&'a str, Option<usize>);

/// A list item's two parameters, each a key and its number.
type Params<'a> = [(&'a str, u64); 2];

/// `N` header values, written one after the other into one buffer and
/// then cut apart.
struct Values<const N: usize> {
    /// Every value so far, back to back.
    text: String,
    /// Where each finished value ends in `text`.
    ends: [usize; N],
    /// How many values are finished.
    done: usize,
    /// Digits of the number being written.
    digits: itoa::Buffer,
}

impl<const N: usize> Values<N> {
    /// An empty buffer with room for `capacity` bytes.
    fn with_capacity(capacity: usize) -> Self {
        Self {
            text: String::with_capacity(capacity),
            ends: [0; N],
            done: 0,
            digits: itoa::Buffer::new(),
        }
    }

    /// Ends the value being written.
    fn end(&mut self) {
        self.ends[self.done] = self.text.len();
        self.done += 1;
    }

    /// A value that is the number `n`.
    fn number(&mut self, n: u64) {
        self.text.push_str(self.digits.format(n));
        self.end();
    }

    /// A value that is a list of structured-field items with parameters,
    /// `"<scope>[.<i>]";<k>=<v>;<k>=<v>` each, separated by `, `: each
    /// policy named by its scope and, for a rule's further limit, its
    /// place `i`.
    fn list<'a>(&mut self, members: impl IntoIterator<Item = (Member<'a>, Params<'a>)>) {
        let text = &mut self.text;
        for (i, ((scope, place), params)) in members.into_iter().enumerate() {
            if i > 0 {
                text.push_str(", ");
            }
            text.push('"');
            text.push_str(scope);
            if let Some(place) = place {
                text.push('.');
                text.push_str(self.digits.format(place));
            }
            text.push('"');
            for (key, value) in params {
                text.push(';');
                text.push_str(key);
                text.push('=');
                text.push_str(self.digits.format(value));
            }
        }
        self.end();
    }

    /// The values, sharing the buffer.
    fn finish(self) -> [HeaderValue; N] {
        let all = Bytes::from(self.text);
        let mut start = 0;
        self.ends.map(|end| {
            let value = all.slice(start..end);
            start = end;
            // unwrap-free: ids are restricted to `A-Za-z0-9._-` and the
            // rest is digits, `*` and punctuation, all valid in a header
            // value.
            HeaderValue::from_maybe_shared(value).unwrap_or_else(|_| HeaderValue::from_static(""))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::decision::GroupLimit;
    use crate::bucket::{BucketSpec, Decision};
    use crate::telemetry::DecisionSource;
    use std::num::NonZeroU32;

    fn verdict(allowed: bool, remaining: u64, retry_after_ms: u64) -> Verdict {
        Verdict {
            decision: Decision {
                allowed,
                remaining,
                retry_after_ms,
            },
            spec: BucketSpec::of(NonZeroU32::new(200).unwrap(), NonZeroU32::new(100).unwrap()),
            source: DecisionSource::Redis,
        }
    }

    fn get(h: &RateLimitHeaders, name: &HeaderName) -> Option<String> {
        let mut headers = HeaderMap::new();
        h.clone().apply(&mut headers);
        headers.get(name).map(|v| v.to_str().unwrap().to_owned())
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one_second() {
        assert_eq!(retry_after_seconds(0), 1);
        assert_eq!(retry_after_seconds(1), 1);
        assert_eq!(retry_after_seconds(10), 1);
        assert_eq!(retry_after_seconds(1000), 1);
        assert_eq!(retry_after_seconds(1001), 2);
        assert_eq!(retry_after_seconds(59_999), 60);
    }

    #[test]
    fn allowed_requests_carry_limit_remaining_and_ietf_fields() {
        let h = RateLimitHeaders::new("create-order", &verdict(true, 199, 0), false);
        assert_eq!(get(&h, &X_RATELIMIT_LIMIT).as_deref(), Some("200"));
        assert_eq!(get(&h, &X_RATELIMIT_REMAINING).as_deref(), Some("199"));
        assert_eq!(
            get(&h, &RATELIMIT_POLICY).as_deref(),
            Some("\"create-order\";q=200;w=2")
        );
        assert_eq!(
            get(&h, &RATELIMIT).as_deref(),
            Some("\"create-order\";r=199;t=0")
        );
        assert_eq!(get(&h, &RETRY_AFTER), None);
    }

    #[test]
    fn the_headers_replace_an_upstreams_own() {
        let mut headers = HeaderMap::new();
        headers.insert(X_RATELIMIT_LIMIT, HeaderValue::from_static("7"));
        headers.append(RATELIMIT, HeaderValue::from_static("\"u\";r=1;t=0"));
        headers.append(RATELIMIT, HeaderValue::from_static("\"v\";r=2;t=0"));
        headers.insert(RETRY_AFTER, HeaderValue::from_static("99"));
        let h = RateLimitHeaders::new("p", &verdict(false, 0, 2_500), false);
        h.apply(&mut headers);
        let all = |name| -> Vec<_> { headers.get_all(name).iter().collect() };
        assert_eq!(all(X_RATELIMIT_LIMIT), ["200"]);
        assert_eq!(all(X_RATELIMIT_REMAINING), ["0"]);
        assert_eq!(all(RATELIMIT_POLICY), ["\"p\";q=200;w=2"]);
        assert_eq!(all(RATELIMIT), ["\"p\";r=0;t=3"]);
        assert_eq!(all(RETRY_AFTER), ["3"]);
    }

    #[test]
    fn rejections_say_when_to_retry() {
        let h = RateLimitHeaders::new("create-order", &verdict(false, 0, 10), false);
        assert_eq!(get(&h, &X_RATELIMIT_REMAINING).as_deref(), Some("0"));
        assert_eq!(get(&h, &RETRY_AFTER).as_deref(), Some("1"));
        assert_eq!(
            get(&h, &RATELIMIT).as_deref(),
            Some("\"create-order\";r=0;t=1")
        );
        let h = RateLimitHeaders::new("p", &verdict(false, 0, 2_500), false);
        assert_eq!(get(&h, &RETRY_AFTER).as_deref(), Some("3"));
    }

    fn part(tenant_wide: bool, index: usize, limit: GroupLimit, d: Decision) -> LimitVerdict {
        LimitVerdict {
            limit,
            decision: d,
            tenant_wide,
            index,
            mode: crate::rules::model::Mode::Enforce,
        }
    }

    fn group(allowed: bool) -> GroupVerdict {
        let bucket = GroupLimit::Bucket(BucketSpec::of(
            NonZeroU32::new(20).unwrap(),
            NonZeroU32::new(10).unwrap(),
        ));
        let day = GroupLimit::Quota {
            quota: NonZeroU32::new(1000).unwrap(),
            window: crate::rules::Window::Day,
        };
        let d = |remaining, retry_after_ms| Decision {
            allowed,
            remaining,
            retry_after_ms,
        };
        GroupVerdict {
            allowed,
            limits: vec![
                part(false, 0, bucket, d(15, 0)),
                part(
                    false,
                    1,
                    day,
                    if allowed { d(3, 0) } else { d(0, 7_200_500) },
                ),
                part(true, 0, bucket, if allowed { d(9, 0) } else { d(0, 300) }),
            ],
            source: DecisionSource::Redis,
            held: None,
        }
    }

    #[test]
    fn every_policy_is_listed_and_the_most_restrictive_reported() {
        let h = RateLimitHeaders::for_group("search", &group(true), false);
        assert_eq!(
            get(&h, &RATELIMIT_POLICY).as_deref(),
            Some("\"search\";q=20;w=2, \"search.1\";q=1000;w=86400, \"*\";q=20;w=2")
        );
        assert_eq!(get(&h, &RATELIMIT).as_deref(), Some("\"search.1\";r=3;t=0"));
        assert_eq!(get(&h, &X_RATELIMIT_LIMIT).as_deref(), Some("1000"));
        assert_eq!(get(&h, &X_RATELIMIT_REMAINING).as_deref(), Some("3"));
        assert_eq!(get(&h, &RETRY_AFTER), None);
    }

    #[test]
    fn free_slots_bind_only_a_refusal_and_show_as_limits_at_once() {
        let mut admitted = group(true);
        let slots = GroupLimit::Slots {
            slots: NonZeroU32::new(4).unwrap(),
            holder: crate::bucket::decision::Holder::default(),
        };
        let part = admitted.limits[0];
        admitted.limits.push(LimitVerdict {
            limit: slots,
            index: 2,
            decision: Decision {
                allowed: true,
                remaining: 1,
                retry_after_ms: 0,
            },
            ..part
        });
        let h = RateLimitHeaders::for_group("search", &admitted, false);
        let policy = get(&h, &RATELIMIT_POLICY).unwrap();
        assert!(policy.ends_with(", \"search.2\";q=4;w=0"), "{policy}");
        assert_eq!(get(&h, &RATELIMIT).as_deref(), Some("\"search.1\";r=3;t=0"));
        let mut full = admitted;
        full.allowed = false;
        for l in &mut full.limits {
            l.decision.allowed = false;
            l.decision.retry_after_ms = 0;
        }
        let last = full.limits.len() - 1;
        full.limits[last].decision = Decision {
            allowed: false,
            remaining: 0,
            retry_after_ms: 1000,
        };
        let h = RateLimitHeaders::for_group("search", &full, false);
        assert_eq!(get(&h, &RATELIMIT).as_deref(), Some("\"search.2\";r=0;t=1"));
        assert_eq!(get(&h, &RETRY_AFTER).as_deref(), Some("1"));
    }

    #[test]
    fn a_refusal_waits_for_the_longest_of_the_refusing_limits() {
        let h = RateLimitHeaders::for_group("search", &group(false), false);
        assert_eq!(get(&h, &RETRY_AFTER).as_deref(), Some("7201"));
        assert_eq!(
            get(&h, &RATELIMIT).as_deref(),
            Some("\"search.1\";r=0;t=7201")
        );
        assert_eq!(get(&h, &X_RATELIMIT_REMAINING).as_deref(), Some("0"));
        let shadowed = RateLimitHeaders::for_group("search", &group(false), true);
        assert_eq!(get(&shadowed, &RETRY_AFTER), None);
    }

    #[test]
    fn a_shadowed_refusal_reports_the_bucket_but_no_retry_after() {
        let h = RateLimitHeaders::new("p", &verdict(false, 0, 2_500), true);
        assert_eq!(get(&h, &X_RATELIMIT_REMAINING).as_deref(), Some("0"));
        assert_eq!(get(&h, &RATELIMIT).as_deref(), Some("\"p\";r=0;t=3"));
        assert_eq!(get(&h, &RETRY_AFTER), None);
    }

    #[test]
    fn kept_policy_values_follow_a_changed_limit_and_every_policy_in_turn() {
        let with = |policy: &str, capacity: u32| {
            let mut v = verdict(true, 1, 0);
            v.spec = BucketSpec::of(
                NonZeroU32::new(capacity).unwrap(),
                NonZeroU32::new(100).unwrap(),
            );
            let h = RateLimitHeaders::new(policy, &v, false);
            (
                get(&h, &X_RATELIMIT_LIMIT).unwrap(),
                get(&h, &RATELIMIT_POLICY).unwrap(),
                get(&h, &RATELIMIT).unwrap(),
            )
        };
        let first = with("orders", 200);
        assert_eq!(with("orders", 200), first, "the same policy, kept");
        assert_eq!(first.1, "\"orders\";q=200;w=2");
        let changed = with("orders", 300);
        assert_eq!(changed.0, "300");
        assert_eq!(changed.1, "\"orders\";q=300;w=3");
        // More policies than are kept: each still reports its own.
        for round in 0..2 {
            for (i, name) in ["a", "b", "c", "d", "e", "f"].into_iter().enumerate() {
                let capacity = 10 + u32::try_from(i).unwrap();
                let (limit, policy, ratelimit) = with(name, capacity);
                assert_eq!(limit, capacity.to_string(), "{round} {name}");
                assert!(
                    policy.starts_with(&format!("\"{name}\";q={capacity};")),
                    "{policy}"
                );
                assert_eq!(ratelimit, format!("\"{name}\";r=1;t=0"));
            }
        }
    }
}
