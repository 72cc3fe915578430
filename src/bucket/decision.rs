//! The outcome of asking a bucket for tokens.
//!
//! Owns what a bucket is asked ([`Ask`]: one request's cost, or a lease
//! batch) and what it answers ([`Grant`], carrying the request's
//! [`Decision`]), whatever holds the bucket: Redis, the in-process fallback
//! or a test's fake store.
//!
//! A rejection is a [`Decision`] with `allowed == false`, never an error.
//! An error from Redis means "could not decide": the caller falls back to
//! the local limiter instead of failing the request.

use std::num::NonZeroU32;

use crate::rules::Window;

/// The slowest refill a bucket in force has (tokens per second): however
/// a limit is shared and divided, the bucket script's numbers then stay
/// far inside what its arithmetic holds exactly (for a capacity up to
/// `i32::MAX`, a refill time under 2.2 × 10^15 ms and a bucket state under
/// 2.2 × 10^18 µs, below 2^63), and `Retry-After` and `RateLimit-Policy`
/// stay finite.
pub const MIN_REFILL_PER_SECOND: f64 = 1e-3;

/// The token bucket in force for one decision: the rule's limit after any
/// regional share or fallback division.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketSpec {
    /// Burst size in tokens.
    pub capacity: NonZeroU32,
    /// Tokens added per second; always finite and at least
    /// [`MIN_REFILL_PER_SECOND`].
    pub refill_per_second: f64,
}

impl BucketSpec {
    /// The bucket of a whole limit.
    pub fn of(capacity: NonZeroU32, refill_per_second: NonZeroU32) -> Self {
        Self {
            capacity,
            refill_per_second: f64::from(refill_per_second.get()),
        }
    }

    /// This bucket's `share` (0 < share ≤ 1): capacity × share (floored, at
    /// least 1) and refill × share (at least [`MIN_REFILL_PER_SECOND`]).
    pub fn scaled(&self, share: f64) -> Self {
        if share >= 1.0 || share.is_nan() || share <= 0.0 {
            return *self;
        }
        // Saturating float-to-int cast of a finite, non-negative value.
        let capacity = (f64::from(self.capacity.get()) * share).floor() as u32;
        Self {
            capacity: NonZeroU32::new(capacity).unwrap_or(NonZeroU32::MIN),
            refill_per_second: (self.refill_per_second * share).max(MIN_REFILL_PER_SECOND),
        }
    }

    /// This bucket split `n` ways: capacity / n (floored, at least 1) and
    /// refill / n (at least [`MIN_REFILL_PER_SECOND`]).
    pub fn divided(&self, n: NonZeroU32) -> Self {
        let capacity = NonZeroU32::new(self.capacity.get() / n.get()).unwrap_or(NonZeroU32::MIN);
        Self {
            capacity,
            refill_per_second: (self.refill_per_second / f64::from(n.get()))
                .max(MIN_REFILL_PER_SECOND),
        }
    }

    /// Seconds to refill an empty bucket, rounded up (the `w` of
    /// `RateLimit-Policy`).
    pub fn window_seconds(&self) -> u64 {
        // Saturating float-to-int cast; the value is finite and positive.
        (f64::from(self.capacity.get()) / self.refill_per_second).ceil() as u64
    }
}

/// One limit of a group decision (the several limits in force for one
/// request), after any regional share or fallback division.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GroupLimit {
    /// A token bucket.
    Bucket(BucketSpec),
    /// At most `quota` requests per window.
    Quota {
        /// Requests per window.
        quota: NonZeroU32,
        /// The window.
        window: Window,
    },
    /// At most `slots` requests in flight at once: a take holds one slot
    /// (whatever the cost) for `holder` until it is released or its
    /// lease runs out unrenewed; a charge leaves it alone. The holder
    /// rides here, not in the [`Ask`], so that an ask stays small: it is
    /// copied on every decision, slots or not.
    Slots {
        /// Requests in flight at most.
        slots: NonZeroU32,
        /// Who holds (or gives back, or renews) a slot.
        holder: Holder,
    },
}

impl GroupLimit {
    /// This limit's `share` (0 < share ≤ 1): a bucket as
    /// [`BucketSpec::scaled`], a quota × share (floored, at least 1).
    pub fn scaled(&self, share: f64) -> Self {
        match *self {
            Self::Bucket(spec) => Self::Bucket(spec.scaled(share)),
            Self::Quota { quota, window } if share > 0.0 && share < 1.0 => {
                // Saturating float-to-int cast of a finite, non-negative value.
                let scaled = (f64::from(quota.get()) * share).floor() as u32;
                Self::Quota {
                    quota: NonZeroU32::new(scaled).unwrap_or(NonZeroU32::MIN),
                    window,
                }
            }
            Self::Slots { slots, holder } if share > 0.0 && share < 1.0 => {
                // Saturating float-to-int cast of a finite, non-negative value.
                let scaled = (f64::from(slots.get()) * share).floor() as u32;
                Self::Slots {
                    slots: NonZeroU32::new(scaled).unwrap_or(NonZeroU32::MIN),
                    holder,
                }
            }
            whole @ (Self::Quota { .. } | Self::Slots { .. }) => whole,
        }
    }

    /// This limit split `n` ways: a bucket as [`BucketSpec::divided`], a
    /// quota / n (floored, at least 1).
    pub fn divided(&self, n: NonZeroU32) -> Self {
        match *self {
            Self::Bucket(spec) => Self::Bucket(spec.divided(n)),
            Self::Quota { quota, window } => Self::Quota {
                quota: NonZeroU32::new(quota.get() / n.get()).unwrap_or(NonZeroU32::MIN),
                window,
            },
            Self::Slots { slots, holder } => Self::Slots {
                slots: NonZeroU32::new(slots.get() / n.get()).unwrap_or(NonZeroU32::MIN),
                holder,
            },
        }
    }

    /// Requests the limit admits at most at once (`q` of
    /// `RateLimit-Policy`): the capacity, the quota or the slots.
    pub fn size(&self) -> u64 {
        match self {
            Self::Bucket(spec) => u64::from(spec.capacity.get()),
            Self::Quota { quota, .. } => u64::from(quota.get()),
            Self::Slots { slots, .. } => u64::from(slots.get()),
        }
    }

    /// Its window in seconds (`w` of `RateLimit-Policy`); 0 for slots,
    /// which count requests at once, not over time.
    pub fn window_seconds(&self) -> u64 {
        match self {
            Self::Bucket(spec) => spec.window_seconds(),
            Self::Quota { window, .. } => window.nominal_seconds(),
            Self::Slots { .. } => 0,
        }
    }

    /// Whether it is a concurrency limit.
    pub fn is_slots(&self) -> bool {
        matches!(self, Self::Slots { .. })
    }

    /// The same limit, its slots (if it is a concurrency limit) held by
    /// `holder`.
    pub fn held_by(self, holder: Holder) -> Self {
        match self {
            Self::Slots { slots, .. } => Self::Slots { slots, holder },
            other => other,
        }
    }

    /// Who holds its slots, for a concurrency limit.
    pub fn holder(&self) -> Option<Holder> {
        match self {
            Self::Slots { holder, .. } => Some(*holder),
            _ => None,
        }
    }
}

/// What one group call got: the same count taken from every limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupGrant {
    /// Tokens taken from each limit (0 when the request was refused).
    pub granted: u32,
    /// Each limit's decision about the request's own cost, in order;
    /// `allowed` is the group's.
    pub decisions: Vec<Decision>,
    /// Milliseconds until another call like this one could be granted its
    /// minimum: the longest of the limits' waits.
    pub block_ms: u64,
}

/// What a bucket answered for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request's tokens were taken.
    pub allowed: bool,
    /// Tokens left after this request, floored.
    pub remaining: u64,
    /// Milliseconds until enough tokens exist for a request like this one:
    /// for a rejection, until it could pass (≥ 1); for an admission, until
    /// the next one could (0 while tokens remain).
    pub retry_after_ms: u64,
}

/// Whether an [`Ask`] may be refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AskKind {
    /// Tokens taken only when they exist: a request, a lease.
    Take,
    /// `want` tokens taken whatever the bucket holds (usage reported
    /// after the fact): the bucket may go into debt, down to minus its
    /// size, and later asks wait until the refill has paid it back.
    Charge,
    /// `want` tokens given back (a reservation not used up), never
    /// above the bucket's size.
    Refund,
    /// The holder's concurrency slots given back; buckets and quotas
    /// untouched.
    Release,
    /// The holder's concurrency slots kept for another lease; a slot
    /// already lost (its lease ran out) is not taken again.
    Renew,
}

/// Who holds a request's concurrency slots, and how long a hold lasts
/// unless renewed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Holder {
    /// Unique among the holds alive in the cluster: a count mixed with
    /// this process's random seed, or a hash of the request's own name.
    pub id: u64,
    /// Milliseconds a slot is held after it was taken or last renewed.
    pub lease_ms: u32,
}

/// What one script call asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// Most tokens to take (a request's cost, or a lease batch; the
    /// amount of a charge or refund).
    pub want: u32,
    /// Fewest tokens worth a lease.
    pub min: u32,
    /// The request's own cost: taken alone when fewer than `min` exist.
    pub need: u32,
    /// Whether it may be refused.
    pub kind: AskKind,
}

impl Ask {
    /// One request's `cost`, no lease.
    pub fn single(cost: u32) -> Self {
        Self::lease(cost, cost, cost)
    }

    /// Up to `want` tokens, at least `min`, or when fewer than `min` exist
    /// but at least `need`, exactly `need`.
    pub fn lease(want: u32, min: u32, need: u32) -> Self {
        Self {
            want,
            min,
            need,
            kind: AskKind::Take,
        }
    }

    /// The slots of a group's concurrency limits given back by their
    /// holders.
    pub fn release() -> Self {
        Self {
            kind: AskKind::Release,
            ..Self::single(0)
        }
    }

    /// The slots of a group's concurrency limits kept by their holders
    /// for another lease.
    pub fn renew() -> Self {
        Self {
            kind: AskKind::Renew,
            ..Self::single(0)
        }
    }

    /// `amount` tokens taken whatever the bucket holds, or given back when
    /// negative (saturating at `u32::MAX` either way).
    pub fn charge(amount: i64) -> Self {
        let n = u32::try_from(amount.unsigned_abs()).unwrap_or(u32::MAX);
        Self {
            want: n,
            min: n,
            need: n,
            kind: if amount < 0 {
                AskKind::Refund
            } else {
                AskKind::Charge
            },
        }
    }

    /// Whether this is a lease (a take whose want, min and need differ):
    /// the script then replies with `granted` and `block_ms` too, which
    /// for any other ask follow from the decision.
    pub fn is_lease(&self) -> bool {
        self.kind == AskKind::Take && !(self.want == self.min && self.min == self.need)
    }

    /// The signed amount of a charge (negative: a refund); `None` for
    /// any other ask.
    pub fn charged(&self) -> Option<i64> {
        match self.kind {
            AskKind::Take | AskKind::Release | AskKind::Renew => None,
            AskKind::Charge => Some(i64::from(self.want)),
            AskKind::Refund => Some(-i64::from(self.want)),
        }
    }
}

/// What one script call got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Tokens taken (0 when the request was rejected).
    pub granted: u32,
    /// The request's decision; `retry_after_ms` is about its own cost.
    pub decision: Decision,
    /// Milliseconds until another call like this one could be granted
    /// its minimum (the over-limit cache blocks the key that long).
    pub block_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[test]
    fn dividing_keeps_at_least_one_token() {
        let spec = BucketSpec::of(nz(20), nz(10));
        let third = spec.divided(nz(3));
        assert_eq!(third.capacity.get(), 6);
        assert!((third.refill_per_second - 10.0 / 3.0).abs() < 1e-9);
        assert_eq!(spec.divided(nz(50)).capacity.get(), 1);
    }

    #[test]
    fn a_regional_share_scales_capacity_and_refill() {
        let spec = BucketSpec::of(nz(200), nz(100)).scaled(0.7);
        assert_eq!(spec.capacity.get(), 140);
        assert!((spec.refill_per_second - 70.0).abs() < 1e-9);
        assert_eq!(BucketSpec::of(nz(1), nz(1)).scaled(0.3).capacity.get(), 1);
        assert_eq!(
            BucketSpec::of(nz(5), nz(5)).scaled(1.0),
            BucketSpec::of(nz(5), nz(5))
        );
    }

    #[test]
    fn no_share_or_division_makes_a_refill_slower_than_the_floor() {
        let widest = BucketSpec::of(nz(i32::MAX.unsigned_abs()), nz(1));
        for spec in [
            widest.scaled(5e-324),
            widest.scaled(1e-17),
            widest.divided(nz(u32::MAX)),
            widest.scaled(1e-3).divided(nz(1000)),
        ] {
            assert_eq!(spec.refill_per_second, MIN_REFILL_PER_SECOND, "{spec:?}");
            // What the script computes from it stays exact in a double
            // and below 2^63: the expiry (ms) and the time until full (µs).
            let capacity = f64::from(spec.capacity.get());
            assert!(2000.0 * capacity / spec.refill_per_second < 2f64.powi(53));
            assert!(capacity * 1e6 / spec.refill_per_second + 4e15 < 2f64.powi(63));
        }
    }

    #[test]
    fn a_regional_share_scales_a_quota_too() {
        let day = GroupLimit::Quota {
            quota: nz(10_000),
            window: Window::Day,
        };
        let GroupLimit::Quota { quota, .. } = day.scaled(0.7) else {
            panic!("a quota stays a quota");
        };
        assert_eq!(quota.get(), 7_000);
        assert_eq!(day.scaled(1.0), day);
        let one = GroupLimit::Quota {
            quota: nz(1),
            window: Window::Hour,
        };
        assert_eq!(one.scaled(0.3).size(), 1, "never below one request");
        assert_eq!(day.window_seconds(), 86_400);
    }

    #[test]
    fn window_is_time_to_refill_from_empty_rounded_up() {
        assert_eq!(BucketSpec::of(nz(200), nz(100)).window_seconds(), 2);
        assert_eq!(BucketSpec::of(nz(5), nz(2)).window_seconds(), 3);
        assert_eq!(BucketSpec::of(nz(1), nz(1000)).window_seconds(), 1);
    }
}
