//! One rate-limit decision, as every entry point takes it.
//!
//! Owns the step from (tenant, route, cost) to an answer, and from
//! (tenant, route, usage) to a charge: the rules in
//! force, this region's share, the limiter (one limit or several), shadow
//! mode, and the rate-limit headers that report it. The proxy, Envoy's
//! rate limit service and the HTTP check all decide here, so leases, the
//! over-limit cache, the breaker's fallback, shares and policies apply to
//! each alike.

use std::num::NonZeroU32;

use super::headers::RateLimitHeaders;
use super::{ProxyState, Worker};
use crate::bucket::limiter::holder_id;
use crate::bucket::{GroupVerdict, Limiter, SlotHold};
use crate::key::{RouteId, TenantId};
use crate::rules::InForce;
use crate::rules::model::Mode;
use crate::telemetry::{DecisionSource, Outcome, UsageKind};

/// What a decision came to.
pub(super) struct Decided {
    /// Refused, and enforced (not in shadow mode).
    pub(super) refused: bool,
    /// Refused by limits in shadow mode only: let through, and counted.
    pub(super) shadowed: bool,
    /// Whether the request's cost was taken: when admitted, and when let
    /// through in shadow mode beside enforced limits that took it (not
    /// when every limit in force refused or is in shadow mode).
    pub(super) took: bool,
    /// Which limiter decided.
    pub(super) source: DecisionSource,
    /// The headers that report it.
    pub(super) headers: RateLimitHeaders,
    /// The request's concurrency slots, when its limits hold any and it
    /// was admitted: held until this is dropped.
    pub(super) held: Option<SlotHold>,
}

impl Decided {
    /// Keeps the request's concurrency slots, if it took any, for one
    /// lease (`limits.slot_lease_ms`) unless released before: for a
    /// gateway that asks before a request and tells its end, if at all,
    /// in a later call.
    pub(super) fn keep_slots_for_lease(&mut self) {
        if let Some(held) = self.held.take() {
            held.keep_until_lease_ends();
        }
    }

    /// The outcome label of a decision that is the whole answer (nothing
    /// is forwarded after it).
    pub(super) fn outcome(&self) -> Outcome {
        match (self.refused, self.shadowed) {
            (true, _) => Outcome::Rejected,
            (false, true) => Outcome::ShadowRejected,
            (false, false) => Outcome::Allowed,
        }
    }
}

/// Takes `cost` for `tenant` on `route` under `in_force` (the rules the
/// caller looked up), through `worker`'s limiter; a concurrency slot is
/// held for `holder` (a fresh one when `None`).
pub(super) async fn decide(
    worker: &Worker,
    tenant: &TenantId,
    route: &RouteId,
    in_force: &InForce,
    cost: NonZeroU32,
    holder: Option<u64>,
) -> Decided {
    let state = &*worker.state;
    let share = share_now(state, tenant, route);
    if in_force.is_single() {
        let verdict = worker
            .limiter
            .check(tenant, route, in_force.limit, share, cost)
            .await;
        let refused = !verdict.decision.allowed;
        let shadowed = refused && (state.shadow || in_force.limit.mode == Mode::Shadow);
        Decided {
            refused: refused && !shadowed,
            shadowed,
            took: !refused,
            source: verdict.source,
            headers: RateLimitHeaders::new(route.as_str(), &verdict, shadowed),
            held: None,
        }
    } else {
        let verdict = worker
            .limiter
            .check_group(tenant, route, in_force, share, cost, holder)
            .await;
        let refused = !verdict.allowed;
        let shadowed = refused && (state.shadow || verdict.refused_in_shadow_only());
        Decided {
            refused: refused && !shadowed,
            shadowed,
            took: verdict.took(),
            source: verdict.source,
            headers: RateLimitHeaders::for_group(route.as_str(), &verdict, shadowed),
            held: verdict.held,
        }
    }
}

/// The limits in force now for `tenant` on `route`.
fn in_force_now(state: &ProxyState, tenant: &TenantId, route: &RouteId) -> InForce {
    state
        .rules
        .snapshot()
        .in_force(tenant.as_str(), route.as_str())
}

/// This region's share now of `tenant`'s limits on `route`.
fn share_now(state: &ProxyState, tenant: &TenantId, route: &RouteId) -> f64 {
    state
        .shares
        .snapshot()
        .share_for(tenant.as_str(), route.as_str())
}

/// Charges `amount` (gives it back when negative) for `tenant` on `route`
/// under the rules in force now, whatever the limits hold: usage reported
/// after the fact. Never refused; the headers report what is left.
pub(super) async fn charge_now(
    state: &ProxyState,
    limiter: &Limiter,
    tenant: &TenantId,
    route: &RouteId,
    amount: i64,
) -> Decided {
    let in_force = in_force_now(state, tenant, route);
    let share = share_now(state, tenant, route);
    let verdict = limiter
        .charge(tenant, route, &in_force, share, amount)
        .await;
    if let Ok(configured) = state.routes.named(route.as_str()) {
        let kind = if amount < 0 {
            UsageKind::Refunded
        } else {
            UsageKind::Charged
        };
        configured.metrics.usage(kind, amount.unsigned_abs());
    }
    after_the_fact(route, verdict)
}

/// What a call after a request (a charge, a release) answers on `route`
/// from its `verdict`: never refused, but a budget left with nothing (or
/// in debt) is reported as a refusal would be, with the wait until the
/// next request could pass. Such a call is about budgets: concurrency
/// slots are not its to show.
fn after_the_fact(route: &RouteId, mut verdict: GroupVerdict) -> Decided {
    verdict.limits.retain(|l| !l.limit.is_slots());
    verdict.allowed = verdict
        .limits
        .iter()
        .all(|l| l.decision.retry_after_ms == 0);
    Decided {
        refused: false,
        shadowed: false,
        took: false,
        source: verdict.source,
        headers: RateLimitHeaders::for_group(route.as_str(), &verdict, false),
        held: None,
    }
}

/// [`decide`] under the rules in force now for `tenant` on `route`, for
/// a gateway that asks before a request (Envoy's rate limit service, the
/// HTTP check); a concurrency slot is held for the request named
/// `request`, if it names itself, so that [`release_now`] can give it
/// back. The caller keeps the slot ([`Decided::keep_slots_for_lease`]) or
/// drops it at once.
pub(super) async fn decide_now(
    worker: &Worker,
    tenant: &TenantId,
    route: &RouteId,
    cost: NonZeroU32,
    request: Option<&str>,
) -> Decided {
    let in_force = in_force_now(&worker.state, tenant, route);
    let holder = request.map(|r| holder_id(tenant, r));
    decide(worker, tenant, route, &in_force, cost, holder).await
}

/// Gives back the concurrency slots that the request named `request`
/// holds for `tenant` on `route`, and reads what its budgets hold, in one
/// call; the answer says whether the limits in force hold any slots.
pub(super) async fn release_now(
    worker: &Worker,
    tenant: &TenantId,
    route: &RouteId,
    request: &str,
) -> (Decided, bool) {
    let state = &worker.state;
    let in_force = in_force_now(state, tenant, route);
    let share = share_now(state, tenant, route);
    let verdict = worker
        .limiter
        .release_slots(tenant, route, &in_force, share, holder_id(tenant, request))
        .await;
    let slotted = verdict.limits.iter().any(|l| l.limit.is_slots());
    (after_the_fact(route, verdict), slotted)
}
