//! The limiter's order, on a fake store and tokio's paused time: breaker,
//! over-limit cache, leases (single-flight fetch, background top-up),
//! store, fallback; and sub-buckets.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;

use super::{Limiter, LimiterCore, Verdict};
use crate::breaker::{BreakerGate, State};
use crate::bucket::store::fake::{FakeStore, Fault};
use crate::bucket::{HotKeys, LocalBuckets};
use crate::clock::{SharedClock, TokioClock};
use crate::cluster::LiveInstances;
use crate::config::LeaseSettings;
use crate::key::{RouteId, TenantId};
use crate::redis_client::{NodeAddr, Topology};
use crate::rules::Limit;
use crate::telemetry::{DecisionSource, Metrics};

/// Bound on one store call.
const TIMEOUT: Duration = Duration::from_millis(50);

/// A limiter on a fake store, two live instances, leases as configured by
/// default; its clock is tokio's (paused by the caller).
struct Setup {
    limiter: Limiter<FakeStore>,
    store: FakeStore,
    gate: Arc<BreakerGate>,
}

fn setup() -> Setup {
    let clock: SharedClock = TokioClock::shared();
    let lease = LeaseSettings {
        enabled: true,
        window: Duration::from_millis(100),
        max_batch: 50,
        min_rate_per_second: 100.0,
    };
    let metrics = Metrics::new();
    let topology = Arc::new(Topology::single(NodeAddr::new("fake", 6379)));
    let gate = topology.layout().shards[0].gate.clone();
    let core = Arc::new(LimiterCore::new(
        LocalBuckets::new(1000, clock.clone()),
        HotKeys::new(lease, 1000, clock.clone(), metrics.clone()),
        Arc::new(LiveInstances::new(NonZeroU32::new(2).unwrap())),
        Some(topology),
        clock.clone(),
        metrics,
    ));
    let store = FakeStore::new(clock, TIMEOUT, gate.clone());
    Setup {
        limiter: Limiter::new(Some(store.clone()), core),
        store,
        gate,
    }
}

fn limit(capacity: u32, refill: u32) -> Limit {
    Limit::new(
        NonZeroU32::new(capacity).unwrap(),
        NonZeroU32::new(refill).unwrap(),
    )
}

async fn check(s: &Setup, limit: Limit) -> Verdict {
    s.limiter
        .check(
            &TenantId::parse("t").unwrap(),
            &RouteId::parse("r").unwrap(),
            limit,
            1.0,
            NonZeroU32::MIN,
        )
        .await
}

const KEY: &str = "rl2:{t}:r";

#[actix_web::test]
async fn with_the_breaker_open_the_local_share_decides_without_the_store() {
    tokio::time::pause();
    let s = setup();
    s.gate.publish(State::Open);
    let v = check(&s, limit(10, 1)).await;
    assert_eq!(v.source, DecisionSource::Local);
    assert_eq!(v.spec.capacity.get(), 5, "1/N of 10 with N = 2");
    assert!(s.store.calls().is_empty());
}

#[actix_web::test]
async fn a_store_that_fails_sends_the_decision_to_the_local_share_and_tells_the_breaker() {
    tokio::time::pause();
    let s = setup();
    for fault in [Fault::Dropped, Fault::NoScript, Fault::Slow(TIMEOUT)] {
        s.store.fail_next(fault);
        let started = tokio::time::Instant::now();
        let v = check(&s, limit(10, 1)).await;
        assert_eq!(v.source, DecisionSource::Local, "{fault:?}");
        assert_eq!(v.spec.capacity.get(), 5, "{fault:?}");
        // The timer wheel rounds up to the next millisecond.
        assert!(
            started.elapsed() <= TIMEOUT + Duration::from_millis(1),
            "{fault:?} waited {:?}",
            started.elapsed()
        );
        assert_eq!(s.gate.drain().failures, 1, "{fault:?}");
    }
}

#[actix_web::test]
async fn a_slow_store_within_its_timeout_still_decides() {
    tokio::time::pause();
    let s = setup();
    s.store.fail_next(Fault::Slow(TIMEOUT / 2));
    let v = check(&s, limit(10, 1)).await;
    assert_eq!(v.source, DecisionSource::Redis);
    assert_eq!(v.decision.remaining, 9);
    assert_eq!(s.gate.drain().successes, 1);
}

#[actix_web::test]
async fn a_connection_dropped_after_the_script_ran_falls_back_but_the_tokens_are_gone() {
    tokio::time::pause();
    let s = setup();
    s.store.fail_next(Fault::DroppedAfter);
    let l = limit(10, 1);
    assert_eq!(check(&s, l).await.source, DecisionSource::Local);
    let spec = crate::bucket::BucketSpec::of(l.capacity, l.refill_per_second);
    assert_eq!(s.store.tokens(KEY, &spec), Some(9.0));
}

#[actix_web::test]
async fn the_over_limit_cache_answers_without_the_store_until_the_retry_time() {
    tokio::time::pause();
    let s = setup();
    let l = limit(2, 1);
    assert!(check(&s, l).await.decision.allowed);
    let last = check(&s, l).await;
    assert_eq!(
        (last.decision.allowed, last.source),
        (true, DecisionSource::Redis)
    );
    // The last token went: no request can pass for 1 s.
    let cached = check(&s, l).await;
    assert_eq!(cached.source, DecisionSource::Cache);
    assert!(!cached.decision.allowed);
    assert_eq!(cached.decision.retry_after_ms, 1000);
    assert_eq!(s.store.calls().len(), 2);
    tokio::time::advance(Duration::from_millis(999)).await;
    assert_eq!(check(&s, l).await.source, DecisionSource::Cache);
    tokio::time::advance(Duration::from_millis(1)).await;
    let after = check(&s, l).await;
    assert_eq!(
        (after.decision.allowed, after.source),
        (true, DecisionSource::Redis)
    );
    assert_eq!(s.store.calls().len(), 3);
}

/// Sends requests 1 ms apart (1,000/s) until one is served from a lease;
/// returns how many were sent.
async fn until_leasing(s: &Setup, l: Limit) -> usize {
    for sent in 1..=500 {
        let v = check(s, l).await;
        assert!(v.decision.allowed);
        if v.source == DecisionSource::Lease {
            return sent;
        }
        tokio::time::advance(Duration::from_millis(1)).await;
    }
    panic!("the key never leased");
}

#[actix_web::test]
async fn a_hot_key_leases_batches_and_spends_them_without_the_store() {
    tokio::time::pause();
    let s = setup();
    let l = limit(1000, 1000);
    let warm_up = until_leasing(&s, l).await;
    assert!(warm_up <= 60, "took {warm_up} requests to lease");
    let calls_before = s.store.calls().len();
    let mut leased = 0;
    for _ in 0..200 {
        let v = check(&s, l).await;
        assert!(v.decision.allowed);
        leased += usize::from(v.source == DecisionSource::Lease);
        tokio::time::advance(Duration::from_millis(1)).await;
    }
    let calls = s.store.calls().len() - calls_before;
    assert!(leased >= 190, "{leased} of 200 from leases");
    assert!(calls <= 10, "{calls} store calls for 200 requests");
    assert!(
        s.store.calls()[calls_before..]
            .iter()
            .all(|(_, ask)| ask.want > 1),
        "every call is a lease"
    );
}

#[actix_web::test]
async fn a_low_lease_is_topped_up_in_the_background_and_waiters_share_one_fetch() {
    tokio::time::pause();
    let s = setup();
    let l = limit(1000, 1000);
    until_leasing(&s, l).await;
    // From now on the store is slow: a fetch takes 10 ms.
    for _ in 0..20 {
        s.store.fail_next(Fault::Slow(Duration::from_millis(10)));
    }
    let calls_before = s.store.calls().len();
    // Spend the lease at one instant: one request starts a top-up in the
    // background and goes on at once.
    let mut spent = 0;
    loop {
        let v = check(&s, l).await;
        if s.store.calls().len() > calls_before {
            break;
        }
        assert_eq!(v.source, DecisionSource::Lease);
        spent += 1;
        assert!(spent < 100, "no top-up was started");
    }
    assert_eq!(s.store.calls().len(), calls_before + 1, "one top-up");
    // Thirty more requests at the same instant: what is left of the lease
    // serves some, the rest wait for that one fetch instead of calling.
    let verdicts = join_all((0..30).map(|_| check(&s, l))).await;
    assert!(verdicts.iter().all(|v| v.decision.allowed));
    assert!(verdicts.iter().all(|v| v.source == DecisionSource::Lease));
    assert_eq!(
        s.store.calls().len(),
        calls_before + 1,
        "the waiters shared the one fetch"
    );
}

#[actix_web::test]
async fn a_sharded_rule_asks_one_sub_bucket_with_its_share() {
    tokio::time::pause();
    let s = setup();
    let mut l = limit(40, 4);
    l.shards = NonZeroU32::new(4).unwrap();
    for _ in 0..8 {
        let v = check(&s, l).await;
        assert_eq!(v.spec.capacity.get(), 40, "headers show the whole limit");
    }
    for (key, _) in s.store.calls() {
        let index: u32 = key
            .strip_prefix("rl2:t:r:")
            .and_then(|i| i.parse().ok())
            .unwrap_or_else(|| panic!("not a sub-bucket key: {key}"));
        assert!(index < 4);
    }
}

/// A rule of `limit` with a quota of `quota` per minute beside it.
fn with_quota(limit: Limit, quota: u32) -> crate::rules::InForce {
    let per_minute = crate::rules::LimitKind::Quota {
        quota: NonZeroU32::new(quota).unwrap(),
        window: crate::rules::Window::Minute,
    };
    crate::rules::InForce {
        limit,
        more: Some(Arc::from([per_minute])),
        has_rule: true,
        tenant_wide: None,
    }
}

async fn check_group(s: &Setup, in_force: &crate::rules::InForce) -> super::GroupVerdict {
    s.limiter
        .check_group(
            &TenantId::parse("t").unwrap(),
            &RouteId::parse("r").unwrap(),
            in_force,
            1.0,
            NonZeroU32::MIN,
            None,
        )
        .await
}

#[actix_web::test]
async fn several_limits_are_one_call_and_all_must_admit() {
    tokio::time::pause();
    let s = setup();
    let rule = with_quota(limit(100, 1), 2);
    for _ in 0..2 {
        let v = check_group(&s, &rule).await;
        assert!(v.allowed);
        assert_eq!(v.source, DecisionSource::Redis);
    }
    // The second took the quota's last request: the third is refused
    // without a call, each limit as Redis last reported it.
    let refused = check_group(&s, &rule).await;
    assert_eq!(
        (refused.allowed, refused.source),
        (false, DecisionSource::Cache)
    );
    assert_eq!(
        refused.limits[0].decision.remaining, 98,
        "the bucket kept its tokens"
    );
    assert!(refused.limits[1].decision.retry_after_ms > 0);
    assert_eq!(s.store.batch_sizes(), [2, 2], "one call of two keys each");
    assert_eq!(s.store.batches()[0], ["rl2:{t}:r", "rl2:{t}:r#1m"]);
    // The next minute's window starts from zero.
    tokio::time::advance(Duration::from_secs(60)).await;
    assert!(check_group(&s, &rule).await.allowed);
}

#[actix_web::test]
async fn with_the_breaker_open_each_limit_holds_its_local_share() {
    tokio::time::pause();
    let s = setup();
    s.gate.publish(State::Open);
    // Two live instances: 1/2 of a quota of 4 is 2 here.
    let rule = with_quota(limit(100, 1), 4);
    let admitted = {
        let mut n = 0;
        for _ in 0..5 {
            let v = check_group(&s, &rule).await;
            assert_eq!(v.source, DecisionSource::Local);
            n += usize::from(v.allowed);
        }
        n
    };
    assert_eq!(admitted, 2);
    assert!(s.store.batch_sizes().is_empty(), "Redis was not called");
}

#[actix_web::test]
async fn a_failed_group_call_is_decided_locally() {
    tokio::time::pause();
    let s = setup();
    s.store.fail_next(Fault::Dropped);
    let v = check_group(&s, &with_quota(limit(100, 1), 4)).await;
    assert!(v.allowed);
    assert_eq!(v.source, DecisionSource::Local);
}

#[actix_web::test]
async fn a_refused_group_is_refused_locally_until_its_longest_wait_ends() {
    tokio::time::pause();
    let s = setup();
    let rule = with_quota(limit(100, 1), 1);
    let took_the_last = check_group(&s, &rule).await;
    assert!(took_the_last.allowed);
    let wait = took_the_last.limits[1].decision.retry_after_ms;
    assert!(wait > 0 && wait <= 60_000);
    // Until the minute ends: no call, the wait counting down.
    tokio::time::advance(Duration::from_millis(wait / 2)).await;
    let cached = check_group(&s, &rule).await;
    assert_eq!(
        (cached.allowed, cached.source),
        (false, DecisionSource::Cache)
    );
    let left = cached.limits[1].decision.retry_after_ms;
    assert!(left <= wait - wait / 2 && left >= 1, "{left} of {wait}");
    assert_eq!(s.store.batch_sizes().len(), 1, "the cache answered alone");
    // A changed rule is not held by the old refusal.
    assert!(check_group(&s, &with_quota(limit(100, 1), 5)).await.allowed);
    // The next window: Redis is asked again.
    tokio::time::advance(Duration::from_millis(wait)).await;
    assert!(check_group(&s, &rule).await.allowed);
}

#[actix_web::test]
async fn a_hot_group_leases_one_batch_from_every_limit() {
    tokio::time::pause();
    let s = setup();
    // A bucket and a large minute quota: both roomy, the group hot.
    let rule = with_quota(limit(10_000, 10_000), 1_000_000);
    let (mut leased, mut warm) = (0, 0);
    for i in 0..1000 {
        if i == 200 {
            // The first 50 ms measure the group's rate.
            warm = s.store.calls().len();
        }
        let v = check_group(&s, &rule).await;
        assert!(v.allowed);
        leased += usize::from(v.source == DecisionSource::Lease);
        tokio::time::advance(Duration::from_micros(500)).await;
    }
    assert!(leased > 750, "{leased} of 1000 from leases");
    // 800 hot requests from batches of up to 50, topped up ahead: at most
    // a call per 30 requests, two keys each (one call per request without
    // leases).
    let calls = s.store.calls();
    assert!(
        calls.len() - warm <= 54,
        "{} keys asked",
        calls.len() - warm
    );
    // Each call took one count from both limits: the same ask for both.
    assert!(calls.chunks(2).all(|pair| pair[0].1 == pair[1].1));
    assert!(calls[warm..].iter().any(|(_, ask)| ask.is_lease()));
}

#[actix_web::test]
async fn a_sharded_rule_with_several_limits_is_decided_in_one_sub_group() {
    tokio::time::pause();
    let s = setup();
    let mut rule = with_quota(limit(100, 100), 400);
    rule.limit.shards = NonZeroU32::new(4).unwrap();
    let mut tags = std::collections::HashSet::new();
    for _ in 0..40 {
        let v = check_group(&s, &rule).await;
        assert!(v.allowed);
        // Headers see the whole limits; remaining is one sub-group's × 4.
        assert_eq!(v.limits[0].limit.size(), 100);
        assert!(v.limits[0].decision.remaining <= 100);
        assert_eq!(v.limits[0].decision.remaining % 4, 0);
    }
    for batch in s.store.batches() {
        let tag = batch[0].split('}').next().unwrap().to_owned();
        assert!(batch.iter().all(|k| k.starts_with(&tag)), "{batch:?}");
        tags.insert(tag);
    }
    assert_eq!(tags.len(), 4, "every sub-group is used: {tags:?}");
    assert!(tags.contains("rl2:{t/0"));
}

/// The rule of `limit` alone, as the rules answer for it.
fn alone(limit: Limit) -> crate::rules::InForce {
    crate::rules::InForce {
        limit,
        more: None,
        has_rule: true,
        tenant_wide: None,
    }
}

async fn charge(s: &Setup, in_force: &crate::rules::InForce, amount: i64) -> super::GroupVerdict {
    s.limiter
        .charge(
            &TenantId::parse("t").unwrap(),
            &RouteId::parse("r").unwrap(),
            in_force,
            1.0,
            amount,
        )
        .await
}

#[actix_web::test]
async fn a_charge_puts_the_shared_bucket_in_debt_and_the_next_request_waits_for_it() {
    tokio::time::pause();
    let s = setup();
    let l = limit(10, 1);
    assert_eq!(check(&s, l).await.decision.remaining, 9);
    let charged = charge(&s, &alone(l), 15).await;
    assert!(charged.allowed, "a charge is never refused");
    assert_eq!(charged.source, DecisionSource::Redis);
    // 9 - 15: 6 in debt, 7 s until one token.
    assert_eq!(charged.limits[0].decision.retry_after_ms, 7_000);
    let spec = crate::bucket::BucketSpec::of(l.capacity, l.refill_per_second);
    assert_eq!(
        s.store.tokens(KEY, &spec),
        Some(-6.0),
        "the check's own key"
    );
    let refused = check(&s, l).await;
    assert!(!refused.decision.allowed);
    assert_eq!(refused.decision.retry_after_ms, 7_000);
    // A refund pays the debt back, never above the capacity.
    let refunded = charge(&s, &alone(l), -100).await;
    assert_eq!(refunded.limits[0].decision.remaining, 10);
    assert!(check(&s, l).await.decision.allowed);
}

#[actix_web::test]
async fn without_an_answer_from_redis_a_charge_is_taken_from_the_local_share() {
    tokio::time::pause();
    let s = setup();
    s.store.fail_next(Fault::Dropped);
    let l = limit(10, 1);
    let charged = charge(&s, &alone(l), 3).await;
    assert_eq!(charged.source, DecisionSource::Local);
    // 1/N of 10 with N = 2: 2 of 5 left.
    assert_eq!(charged.limits[0].decision.remaining, 2);
    s.gate.publish(State::Open);
    let charged = charge(&s, &alone(l), 100).await;
    assert_eq!(charged.source, DecisionSource::Local);
    assert!(
        !check(&s, l).await.decision.allowed,
        "the local share is in debt"
    );
}

/// A rule of `limit` with `slots` concurrency slots beside it.
fn with_slots(limit: Limit, slots: u32) -> crate::rules::InForce {
    let at_once = crate::rules::LimitKind::Concurrent {
        slots: NonZeroU32::new(slots).unwrap(),
    };
    crate::rules::InForce {
        more: Some(Arc::from([at_once])),
        ..with_quota(limit, 1)
    }
}

/// How many slot renewals `store` was asked for.
fn renewals(store: &FakeStore) -> usize {
    store
        .calls()
        .iter()
        .filter(|(_, ask)| ask.kind == crate::bucket::decision::AskKind::Renew)
        .count()
}

/// Lets spawned tasks (slot renewals and releases) run.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

#[actix_web::test]
async fn slots_are_held_and_renewed_while_their_guard_lives_and_given_back_after() {
    tokio::time::pause();
    let s = setup();
    let rule = with_slots(limit(1000, 1000), 2);
    let first = check_group(&s, &rule).await;
    let second = check_group(&s, &rule).await;
    for v in [&first, &second] {
        assert!(v.allowed && v.held.is_some(), "{v:?}");
        assert_eq!(v.source, DecisionSource::Redis);
    }
    let full = check_group(&s, &rule).await;
    assert!(!full.allowed && full.held.is_none(), "{full:?}");
    assert_eq!(full.limits[1].decision.retry_after_ms, 1000);
    // A minute is six leases: the holds are renewed, not lost.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!check_group(&s, &rule).await.allowed);
    assert!(
        renewals(&s.store) >= 2 * 17,
        "{} renewals",
        renewals(&s.store)
    );
    // A clone keeps them; the last one gives them back.
    let copy = first.clone();
    drop(first);
    settle().await;
    assert!(!check_group(&s, &rule).await.allowed);
    drop(copy);
    settle().await;
    let again = check_group(&s, &rule).await;
    assert!(again.allowed, "{again:?}");
    // Detached, a hold is no longer renewed: it ends with its lease.
    again.held.unwrap().keep_until_lease_ends();
    settle().await;
    let before = renewals(&s.store);
    assert!(!check_group(&s, &rule).await.allowed);
    tokio::time::sleep(Duration::from_secs(11)).await;
    // One renewal every 3.3 s: 3 or 4 in 11 s, as the phase falls.
    let renewed = renewals(&s.store) - before;
    assert!(
        (3..=4).contains(&renewed),
        "only the second hold renews: {renewed}"
    );
    assert!(check_group(&s, &rule).await.allowed);
}

#[actix_web::test]
async fn without_redis_slots_are_held_locally_at_one_nth_and_given_back() {
    tokio::time::pause();
    let s = setup();
    // Two live instances: one slot of two here.
    let rule = with_slots(limit(1000, 1000), 2);
    for _ in 0..4 {
        s.store.fail_next(Fault::Dropped);
    }
    let held = check_group(&s, &rule).await;
    assert_eq!((held.allowed, held.source), (true, DecisionSource::Local));
    assert!(held.held.is_some());
    let refused = check_group(&s, &rule).await;
    assert_eq!(
        (refused.allowed, refused.source),
        (false, DecisionSource::Local)
    );
    drop(held);
    settle().await;
    let again = check_group(&s, &rule).await;
    assert_eq!((again.allowed, again.source), (true, DecisionSource::Local));
}

#[actix_web::test]
async fn a_refusal_by_a_shadow_limit_alone_still_takes_from_the_enforced_ones() {
    tokio::time::pause();
    let s = setup();
    // The route's rule (enforced) holds 3; the tenant-wide one, in shadow
    // mode, holds 1.
    let mut wide = limit(1, 1);
    wide.mode = crate::rules::model::Mode::Shadow;
    let rule = crate::rules::InForce {
        limit: limit(3, 1),
        more: None,
        has_rule: true,
        tenant_wide: Some((wide, None)),
    };
    let mut verdicts = Vec::new();
    for _ in 0..4 {
        verdicts.push(check_group(&s, &rule).await);
    }
    assert!(verdicts[0].allowed, "{:?}", verdicts[0]);
    // The shadow limit is empty: let through, and the enforced bucket
    // still pays, down to 0.
    for (v, left) in verdicts[1..3].iter().zip([1, 0]) {
        assert!(!v.allowed && v.refused_in_shadow_only(), "{v:?}");
        let route = &v.limits[0];
        assert!(!route.tenant_wide && route.decision.allowed, "{v:?}");
        assert_eq!(route.decision.remaining, left, "{v:?}");
    }
    // The enforced bucket is empty: refused, whatever the shadow limit.
    assert!(!verdicts[3].refused_in_shadow_only(), "{:?}", verdicts[3]);
}

#[actix_web::test]
async fn a_tenant_wide_concurrency_limit_counts_every_route_together() {
    tokio::time::pause();
    let s = setup();
    let mut wide = limit(1, 1);
    wide.bucket = false;
    let at_once = crate::rules::LimitKind::Concurrent {
        slots: NonZeroU32::MIN,
    };
    let rule = crate::rules::InForce {
        tenant_wide: Some((wide, Some(Arc::from([at_once])))),
        ..with_quota(limit(1000, 1000), 1000)
    };
    let on = |route: &'static str| {
        let rule = rule.clone();
        let limiter = s.limiter.clone();
        async move {
            let (tenant, route) = (
                TenantId::parse("t").unwrap(),
                RouteId::parse(route).unwrap(),
            );
            limiter
                .check_group(&tenant, &route, &rule, 1.0, NonZeroU32::MIN, None)
                .await
        }
    };
    let held = on("a").await;
    assert!(held.allowed && held.held.is_some(), "{held:?}");
    let other = on("b").await;
    assert!(
        !other.allowed,
        "one request of the tenant at once: {other:?}"
    );
    assert!(other.limits.last().is_some_and(|l| l.tenant_wide));
    drop(held);
    settle().await;
    assert!(on("b").await.allowed);
}

#[actix_web::test]
async fn a_hold_whose_renewals_fail_past_its_lease_is_lost_and_its_slot_taken_by_another() {
    tokio::time::pause();
    let s = setup();
    let rule = with_slots(limit(1000, 1000), 2);
    let holds = [check_group(&s, &rule).await, check_group(&s, &rule).await];
    assert!(holds.iter().all(|v| v.allowed));
    // Redis unreachable for every renewal of the next 11 s (past the 10 s
    // lease): the holds end in Redis while their requests run.
    for _ in 0..6 {
        s.store.fail_next(Fault::Dropped);
    }
    tokio::time::sleep(Duration::from_secs(11)).await;
    let newcomer = check_group(&s, &rule).await;
    assert_eq!(
        (newcomer.allowed, newcomer.source),
        (true, DecisionSource::Redis),
        "a lost slot is free for another: {newcomer:?}"
    );
    // The old holds' next renewal (at 13.3 s) finds them lost: from then
    // on only the newcomer's renews, once every 3.3 s.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let before = renewals(&s.store);
    tokio::time::sleep(Duration::from_millis(3_400)).await;
    assert_eq!(renewals(&s.store) - before, 1, "only the newcomer renews");
}
