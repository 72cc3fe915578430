//! Token-bucket arithmetic, the in-process twin of `lua/token_bucket.lua`
//! (the local fallback and the tests' fake store both use it).
//!
//! Pure functions over a [`TokenState`] and an explicit `now`, so the math is
//! tested with a hand-advanced clock. The rules match the script exactly:
//! refill `min(capacity, tokens + elapsed × rate)`, a cost above capacity is
//! clamped to capacity, a rejection changes nothing and reports the real
//! time until the deficit is refilled, rounded up to whole milliseconds; an
//! admission that leaves less than one more request's tokens reports when
//! the next could pass.

use super::decision::{Ask, BucketSpec, Decision, Grant};

/// The two numbers a bucket keeps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenState {
    /// Tokens available at `updated_ms` (fractional).
    pub tokens: f64,
    /// Time of the last change, in the owning clock's milliseconds.
    pub updated_ms: u64,
}

impl TokenState {
    /// A full bucket as of `now_ms`.
    pub fn full(spec: &BucketSpec, now_ms: u64) -> Self {
        Self {
            tokens: f64::from(spec.capacity.get()),
            updated_ms: now_ms,
        }
    }

    /// Tokens available at `now_ms` after refilling.
    pub fn available(&self, spec: &BucketSpec, now_ms: u64) -> f64 {
        let elapsed_ms = now_ms.saturating_sub(self.updated_ms) as f64;
        let refilled = self.tokens + elapsed_ms * spec.refill_per_second / 1000.0;
        refilled.min(f64::from(spec.capacity.get()))
    }

    /// Refills to `now_ms` and tries to take `cost` tokens.
    pub fn take(&mut self, spec: &BucketSpec, cost: u32, now_ms: u64) -> Decision {
        self.grant(spec, Ask::single(cost), now_ms).decision
    }

    /// Refills to `now_ms` and takes tokens as `ask` says, exactly as
    /// `lua/token_bucket.lua` does: `want` (clamped to the capacity) when
    /// at least `min` exist (all whole tokens up to `want`), else `need`
    /// alone when that many exist, else nothing. A rejection changes
    /// nothing.
    pub fn grant(&mut self, spec: &BucketSpec, ask: Ask, now_ms: u64) -> Grant {
        let rate = spec.refill_per_second;
        let want = f64::from(ask.want).min(f64::from(spec.capacity.get()));
        let min = f64::from(ask.min).min(want);
        let need = f64::from(ask.need).min(min);
        let tokens = self.available(spec, now_ms);
        // Milliseconds until `n` tokens exist when `tokens` do, rounded up.
        let wait = |n: f64, tokens: f64| {
            if tokens >= n {
                0
            } else {
                // Saturating float-to-int cast of a finite, positive value.
                ((n - tokens) * 1000.0 / rate).ceil() as u64
            }
        };
        if tokens < need {
            return Grant {
                granted: 0,
                decision: Decision {
                    allowed: false,
                    remaining: tokens.floor() as u64,
                    retry_after_ms: wait(need, tokens).max(1),
                },
                block_ms: wait(min, tokens).max(1),
            };
        }
        let granted = if tokens >= min {
            want.min(tokens.floor())
        } else {
            need
        };
        self.tokens = tokens - granted;
        self.updated_ms = now_ms;
        Grant {
            granted: granted as u32,
            decision: Decision {
                allowed: true,
                remaining: self.tokens.floor() as u64,
                retry_after_ms: wait(need, self.tokens),
            },
            block_ms: wait(min, self.tokens),
        }
    }

    /// Refills to `now_ms` and charges `amount` tokens whatever the bucket
    /// holds (gives them back when negative), as `lua/token_bucket.lua`
    /// does: the count stays between minus the capacity (a debt the
    /// refill pays back) and the capacity. Always allowed; the wait is
    /// until one token exists.
    pub fn charge(&mut self, spec: &BucketSpec, amount: i64, now_ms: u64) -> Decision {
        let size = f64::from(spec.capacity.get());
        self.tokens = (self.available(spec, now_ms) - amount as f64).clamp(-size, size);
        self.updated_ms = now_ms;
        Decision {
            allowed: true,
            // Saturating float-to-int casts: 0 for a debt.
            remaining: self.tokens.floor() as u64,
            retry_after_ms: if self.tokens >= 1.0 {
                0
            } else {
                ((1.0 - self.tokens) * 1000.0 / spec.refill_per_second).ceil() as u64
            },
        }
    }

    /// Whether the bucket is full at `now_ms`, so forgetting it loses nothing.
    pub fn is_full(&self, spec: &BucketSpec, now_ms: u64) -> bool {
        self.available(spec, now_ms) >= f64::from(spec.capacity.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};
    use proptest::prelude::*;
    use std::num::NonZeroU32;
    use std::time::Duration;

    fn spec(capacity: u32, refill: f64) -> BucketSpec {
        BucketSpec {
            capacity: NonZeroU32::new(capacity).unwrap(),
            refill_per_second: refill,
        }
    }

    #[test]
    fn burst_to_capacity_then_reject_then_one_token_after_one_interval() {
        let clock = ManualClock::new(10_000);
        let s = spec(3, 2.0);
        let mut state = TokenState::full(&s, clock.now_ms());
        let remaining: Vec<_> = (0..3)
            .map(|_| state.take(&s, 1, clock.now_ms()))
            .map(|d| (d.allowed, d.remaining))
            .collect();
        assert_eq!(remaining, vec![(true, 2), (true, 1), (true, 0)]);

        let rejected = state.take(&s, 1, clock.now_ms());
        assert!(!rejected.allowed);
        assert_eq!(rejected.retry_after_ms, 500);

        clock.advance(Duration::from_millis(499));
        assert!(!state.take(&s, 1, clock.now_ms()).allowed);
        clock.advance(Duration::from_millis(1));
        let d = state.take(&s, 1, clock.now_ms());
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
    }

    #[test]
    fn a_charge_goes_into_debt_down_to_minus_the_capacity_and_a_refund_up_to_it() {
        let s = spec(10, 2.0);
        let mut state = TokenState::full(&s, 0);
        // 10 - 14: 4 in debt, 2.5 s until one token at 2/s.
        let d = state.charge(&s, 14, 0);
        assert_eq!((d.allowed, d.remaining, d.retry_after_ms), (true, 0, 2_500));
        let refused = state.take(&s, 1, 0);
        assert_eq!((refused.allowed, refused.retry_after_ms), (false, 2_500));
        // The refill pays the debt back first.
        assert!(state.take(&s, 1, 2_500).allowed);
        assert_eq!(state.charge(&s, 1_000, 2_500).retry_after_ms, 5_500);
        assert_eq!(state.tokens, -10.0, "at most one capacity in debt");
        assert_eq!(state.charge(&s, -1_000, 2_500).remaining, 10);
    }

    #[test]
    fn a_lease_takes_up_to_want_at_least_min_or_just_the_request() {
        let s = spec(10, 10.0);
        let ask = Ask::lease(8, 4, 1);
        let mut state = TokenState::full(&s, 0);
        let g = state.grant(&s, ask, 0);
        assert_eq!((g.granted, g.decision.remaining, g.block_ms), (8, 2, 200));
        // 2 left: fewer than min, at least need: just the request's token.
        let g = state.grant(&s, ask, 0);
        assert_eq!(
            (g.granted, g.decision.allowed, g.decision.remaining),
            (1, true, 1)
        );
        assert_eq!(g.block_ms, 300);
        let g = state.grant(&s, ask, 0);
        assert_eq!((g.granted, g.decision.remaining), (1, 0));
        let g = state.grant(&s, ask, 0);
        assert_eq!((g.granted, g.decision.allowed), (0, false));
        assert_eq!((g.decision.retry_after_ms, g.block_ms), (100, 400));
    }

    #[test]
    fn retry_after_uses_the_real_deficit_not_integer_division() {
        // 1 / refill would be 0 with integer math; the deficit gives 4 ms.
        let s = spec(1, 250.0);
        let mut state = TokenState::full(&s, 0);
        assert!(state.take(&s, 1, 0).allowed);
        assert_eq!(state.take(&s, 1, 0).retry_after_ms, 4);
        assert_eq!(state.take(&s, 1, 1).retry_after_ms, 3);
    }

    #[test]
    fn refill_never_exceeds_capacity() {
        let s = spec(5, 100.0);
        let mut state = TokenState::full(&s, 0);
        state.take(&s, 5, 0);
        assert_eq!(state.take(&s, 1, 1_000_000).remaining, 4);
    }

    #[test]
    fn cost_above_capacity_passes_only_when_full() {
        let s = spec(4, 1.0);
        let mut state = TokenState::full(&s, 0);
        let d = state.take(&s, 10, 0);
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
        let d = state.take(&s, 10, 1_000);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 3_000);
    }

    #[test]
    fn rejection_leaves_state_untouched() {
        let s = spec(1, 1.0);
        let mut state = TokenState::full(&s, 0);
        state.take(&s, 1, 0);
        let before = state;
        state.take(&s, 1, 300);
        assert_eq!(state, before);
    }

    proptest! {
        #[test]
        fn admitted_never_exceeds_capacity_plus_refill(
            capacity in 1u32..500,
            refill in 0.5f64..1000.0,
            gaps in proptest::collection::vec(0u64..50, 1..400),
        ) {
            let s = spec(capacity, refill);
            let mut state = TokenState::full(&s, 0);
            let mut now = 0;
            let mut admitted = 0u64;
            for gap in gaps {
                now += gap;
                let d = state.take(&s, 1, now);
                if d.allowed { admitted += 1; } else { prop_assert!(d.retry_after_ms >= 1); }
            }
            let bound = f64::from(capacity) + now as f64 * refill / 1000.0;
            prop_assert!(admitted as f64 <= bound + 1e-9);
        }
    }
}
