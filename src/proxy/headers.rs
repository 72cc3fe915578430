//! Rate-limit response headers.
//!
//! Owns the header names and the arithmetic shown to clients:
//! `X-RateLimit-Limit` / `X-RateLimit-Remaining`, the IETF
//! draft-ietf-httpapi-ratelimit-headers pair `RateLimit-Policy` and
//! `RateLimit`, and `Retry-After` on rejections. Seconds are always rounded
//! up from the real wait, and a rejection never says less than 1 second and
//! always says 0 remaining.

use hyper::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};

use crate::bucket::Verdict;

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

/// The headers of one limiter verdict, ready to attach to any response.
pub struct RateLimitHeaders {
    /// Header name/value pairs, in emission order (built without the
    /// formatter: this runs for every request).
    pairs: [(HeaderName, HeaderValue); 4],
    /// `Retry-After`, on a rejection.
    retry_after: Option<HeaderValue>,
}

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
        Self {
            pairs: [
                (X_RATELIMIT_LIMIT, HeaderValue::from(capacity)),
                (X_RATELIMIT_REMAINING, HeaderValue::from(remaining)),
                (
                    RATELIMIT_POLICY,
                    structured(policy, [("q", capacity), ("w", window)]),
                ),
                (
                    RATELIMIT,
                    structured(policy, [("r", remaining), ("t", wait)]),
                ),
            ],
            retry_after: (!decision.allowed && !shadowed).then(|| HeaderValue::from(wait)),
        }
    }

    /// Sets the headers on a response's `headers`, replacing any of the
    /// same names.
    pub fn apply(&self, headers: &mut HeaderMap) {
        for (name, value) in &self.pairs {
            headers.insert(name.clone(), value.clone());
        }
        if let Some(value) = &self.retry_after {
            headers.insert(RETRY_AFTER, value.clone());
        }
    }
}

/// `"<policy>";<k>=<v>;<k>=<v>`, a structured-field item with parameters.
fn structured(policy: &str, params: [(&str, u64); 2]) -> HeaderValue {
    let mut text = String::with_capacity(policy.len() + 32);
    text.push('"');
    text.push_str(policy);
    text.push('"');
    let mut digits = itoa::Buffer::new();
    for (key, value) in params {
        text.push(';');
        text.push_str(key);
        text.push('=');
        text.push_str(digits.format(value));
    }
    // unwrap-free: ids are restricted to `A-Za-z0-9._-` and the rest is
    // digits and punctuation, all valid in a header value.
    HeaderValue::try_from(text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let retry = h.retry_after.iter().map(|v| (&RETRY_AFTER, v));
        h.pairs
            .iter()
            .map(|(n, v)| (n, v))
            .chain(retry)
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.to_str().unwrap().to_owned())
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

    #[test]
    fn a_shadowed_refusal_reports_the_bucket_but_no_retry_after() {
        let h = RateLimitHeaders::new("p", &verdict(false, 0, 2_500), true);
        assert_eq!(get(&h, &X_RATELIMIT_REMAINING).as_deref(), Some("0"));
        assert_eq!(get(&h, &RATELIMIT).as_deref(), Some("\"p\";r=0;t=3"));
        assert_eq!(get(&h, &RETRY_AFTER), None);
    }
}
