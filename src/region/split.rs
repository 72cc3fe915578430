//! How the rebalancer moves shares: a pure function, property-tested.
//!
//! Given each region's current share and observed demand, it computes the
//! demand-proportional target (every region keeping at least the floor),
//! then moves the current shares toward it by the smoothing fraction, with
//! no region moving more than the maximum step. The move is one uniform
//! fraction of the way from current to target, so shares keep summing to 1
//! and never drop below the floor.

use super::model::MIN_SHARE;

/// Knobs of one rebalancing round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplitParams {
    /// Fraction of the way to the target moved per round (0 < s ≤ 1).
    pub smoothing: f64,
    /// Largest change of any one share per round (0 < m ≤ 1).
    pub max_step: f64,
    /// Smallest share any region keeps (regions × floor ≤ 1; never below
    /// [`MIN_SHARE`]).
    pub floor: f64,
}

/// New shares for regions whose current shares are `current` (summing to
/// 1) and whose demand (requests/s) is `demand`, index for index.
///
/// `None` when there is no demand to go by (every share stays).
pub fn rebalance(current: &[f64], demand: &[f64], p: SplitParams) -> Option<Vec<f64>> {
    let total: f64 = demand.iter().map(|d| d.max(0.0)).sum();
    if current.len() != demand.len() || current.is_empty() || total.is_nan() || total <= 0.0 {
        return None;
    }
    // Never below the smallest share a region may hold.
    let floor = p.floor.clamp(MIN_SHARE, 1.0 / current.len() as f64);
    let target = with_floor(demand.iter().map(|d| d.max(0.0) / total).collect(), floor);
    let largest_move = current
        .iter()
        .zip(&target)
        .map(|(c, t)| (t - c).abs())
        .fold(0.0, f64::max);
    if largest_move == 0.0 {
        return Some(current.to_vec());
    }
    let k = p.smoothing.clamp(0.0, 1.0).min(p.max_step / largest_move);
    Some(
        current
            .iter()
            .zip(&target)
            .map(|(c, t)| c + k * (t - c))
            .collect(),
    )
}

/// Raises every share below `floor` to it, taking the difference from the
/// others in proportion to their size, until none is below.
fn with_floor(mut shares: Vec<f64>, floor: f64) -> Vec<f64> {
    loop {
        let pinned: Vec<bool> = shares.iter().map(|s| *s <= floor).collect();
        let free: f64 = shares
            .iter()
            .zip(&pinned)
            .filter(|(_, p)| !**p)
            .map(|(s, _)| s)
            .sum();
        let pinned_count = pinned.iter().filter(|p| **p).count() as f64;
        if pinned_count == 0.0 || free <= 0.0 {
            return shares;
        }
        let scale = (1.0 - floor * pinned_count) / free;
        let mut changed = false;
        for (s, p) in shares.iter_mut().zip(&pinned) {
            if *p {
                changed |= *s != floor;
                *s = floor;
            } else {
                *s *= scale;
            }
        }
        if !changed {
            return shares;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: SplitParams = SplitParams {
        smoothing: 0.5,
        max_step: 0.2,
        floor: 0.05,
    };

    #[test]
    fn shares_move_toward_the_demand_ratio() {
        let mut shares: Vec<f64> = vec![0.5, 0.5];
        let mut rounds = 0;
        while (shares[0] - 0.7).abs() > 0.05 + 1e-9 {
            shares = rebalance(&shares, &[70.0, 30.0], P).unwrap();
            rounds += 1;
        }
        assert_eq!(rounds, 2, "{shares:?}");
        let mut s = shares;
        for _ in 0..30 {
            s = rebalance(&s, &[70.0, 30.0], P).unwrap();
        }
        assert!((s[0] - 0.7).abs() < 1e-6, "{s:?}");
    }

    #[test]
    fn a_region_without_demand_keeps_the_floor() {
        let mut s: Vec<f64> = vec![0.5, 0.5];
        for _ in 0..50 {
            s = rebalance(&s, &[100.0, 0.0], P).unwrap();
        }
        assert!(
            (s[1] - 0.05).abs() < 1e-6 && (s[0] - 0.95).abs() < 1e-6,
            "{s:?}"
        );
    }

    #[test]
    fn no_step_exceeds_the_maximum() {
        let next = rebalance(
            &[0.9, 0.1],
            &[0.0, 100.0],
            SplitParams {
                smoothing: 1.0,
                ..P
            },
        )
        .unwrap();
        assert!(
            (next[0] - 0.7).abs() < 1e-9 && (next[1] - 0.3).abs() < 1e-9,
            "{next:?}"
        );
    }

    #[test]
    fn without_demand_nothing_moves() {
        assert_eq!(rebalance(&[0.7, 0.3], &[0.0, 0.0], P), None);
        assert_eq!(rebalance(&[0.7, 0.3], &[1.0], P), None);
    }

    proptest! {
        #[test]
        fn shares_sum_to_one_stay_above_the_floor_and_move_at_most_the_step(
            raw in proptest::collection::vec(0.01f64..1.0, 2..6),
            demand in proptest::collection::vec(0.0f64..1000.0, 6),
            smoothing in 0.01f64..1.0,
            max_step in 0.01f64..1.0,
            floor in 0.0f64..0.15,
        ) {
            let n = raw.len();
            let floor = floor.min(1.0 / n as f64);
            // A valid starting point: above the floor, summing to 1.
            let sum: f64 = raw.iter().sum();
            let spare = 1.0 - floor * n as f64;
            let current: Vec<f64> = raw.iter().map(|r| floor + spare * r / sum).collect();
            let p = SplitParams { smoothing, max_step, floor };
            if let Some(next) = rebalance(&current, &demand[..n], p) {
                let total: f64 = next.iter().sum();
                prop_assert!((total - 1.0).abs() < 1e-9, "sum {total}");
                for (c, x) in current.iter().zip(&next) {
                    prop_assert!(*x >= floor - 1e-9, "{x} below floor {floor}");
                    prop_assert!((x - c).abs() <= max_step + 1e-9, "step {} > {max_step}", (x - c).abs());
                }
            }
        }
    }
}
