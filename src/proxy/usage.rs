//! Usage settled after the answer, on a route with `usage_header`.
//!
//! Owns the three steps of such a request besides its decision: the
//! reservation it takes up front ([`reservation`]: `reserve`, or the
//! request's `reserve_header` capped by `max_reserve`), the usage its
//! answer reports (a whole number in the usage header of the response
//! head, else of its trailers), and the [`Settlement`]: one charge of
//! usage − reservation (a refund when negative), run on the worker after
//! the answer has gone on, never delaying it.
//!
//! An answer that reports no usage (none, or not a whole number; an
//! upstream error or timeout; a client that leaves before the trailers)
//! keeps its reservation charged: what was reserved is what it cost. So
//! does a request whose gateway dies before settling. A request let
//! through in shadow mode reserved nothing: its whole usage is charged.

use std::num::NonZeroU32;
use std::sync::Arc;

use hyper::HeaderMap;

use super::ProxyState;
use super::decide::charge_now;
use crate::bucket::Limiter;
use crate::config::UsageSpec;
use crate::key::{RouteId, TenantId};
use crate::telemetry::UsageKind;

/// The tokens a request on `usage`'s route reserves: its reservation
/// header's whole number (at least 1, at most `max_reserve`) when the
/// route names one and the request sends it, else `reserve`.
///
/// # Errors
/// When the reservation header is sent more than once or is not a whole
/// number.
pub(super) fn reservation(headers: &HeaderMap, usage: &UsageSpec) -> Result<NonZeroU32, ()> {
    let Some(name) = &usage.reserve_header else {
        return Ok(usage.reserve);
    };
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => Ok(usage.reserve),
        (Some(value), None) => {
            let asked = whole(value.as_bytes()).ok_or(())?;
            let capped = asked.clamp(1, u64::from(usage.max_reserve.get()));
            Ok(NonZeroU32::new(u32::try_from(capped).unwrap_or(1)).unwrap_or(NonZeroU32::MIN))
        }
        (Some(_), Some(_)) => Err(()),
    }
}

/// The usage `headers` report under `name`: one whole number.
pub(super) fn reported(headers: &HeaderMap, name: &hyper::header::HeaderName) -> Option<u64> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (Some(value), None) => whole(value.as_bytes()),
        _ => None,
    }
}

/// A whole number of at most 19 digits, optionally padded with spaces.
fn whole(raw: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(raw).ok()?.trim();
    if text.is_empty() || text.len() > 19 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// What settling one request's usage needs, once its answer reports it;
/// dropped unsettled (no usage reported, an error, an abort), its
/// reservation is counted as expired: kept as the request's cost.
pub(in crate::proxy) struct Settlement {
    /// What it settles with; `None` once settled.
    parts: Option<Parts>,
}

/// The parts of a [`Settlement`].
struct Parts {
    /// The worker's limiter.
    limiter: Limiter,
    /// The rules, shares and counters.
    state: Arc<ProxyState>,
    /// Whose usage.
    tenant: TenantId,
    /// On which route.
    route: RouteId,
    /// The usage header, looked up in the trailers when the head has none.
    header: hyper::header::HeaderName,
    /// Tokens taken up front: none for a request let through in shadow
    /// mode, which took nothing.
    reserved: u32,
}

impl Settlement {
    /// The settlement of a request by `tenant` on `route` (whose answers
    /// report usage under `header`) that took `reserved` tokens up front.
    pub(super) fn new(
        limiter: &Limiter,
        state: &Arc<ProxyState>,
        tenant: &TenantId,
        route: &RouteId,
        header: &hyper::header::HeaderName,
        reserved: u32,
    ) -> Self {
        Self {
            parts: Some(Parts {
                limiter: limiter.clone(),
                state: Arc::clone(state),
                tenant: tenant.clone(),
                route: route.clone(),
                header: header.clone(),
                reserved,
            }),
        }
    }

    /// Settles with the usage `headers` report (a response's head or its
    /// trailers); `self` back when they report none.
    pub(in crate::proxy) fn settle_from(mut self, headers: &HeaderMap) -> Option<Self> {
        let used = self
            .parts
            .as_ref()
            .and_then(|p| reported(headers, &p.header));
        match (used, self.parts.take()) {
            (Some(used), Some(parts)) => {
                parts.settle(used);
                None
            }
            (_, parts) => {
                self.parts = parts;
                Some(self)
            }
        }
    }
}

impl Drop for Settlement {
    fn drop(&mut self) {
        if let Some(parts) = &self.parts
            && parts.reserved > 0
            && let Ok(route) = parts.state.routes.named(parts.route.as_str())
        {
            let reserved = u64::from(parts.reserved);
            route.metrics.usage(UsageKind::Expired, reserved);
        }
    }
}

impl Parts {
    /// Charges `used` − the reservation (gives back the difference when
    /// less was used) in the background on this worker.
    fn settle(self, used: u64) {
        let amount = i64::try_from(used)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::from(self.reserved));
        if amount == 0 {
            return;
        }
        actix_web::rt::spawn(async move {
            let Self {
                limiter,
                state,
                tenant,
                route,
                ..
            } = self;
            charge_now(&state, &limiter, &tenant, &route, amount).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::{HeaderName, HeaderValue};

    fn usage(reserve_header: Option<&'static str>) -> UsageSpec {
        UsageSpec {
            header: HeaderName::from_static("x-usage"),
            reserve: NonZeroU32::new(10).unwrap(),
            reserve_header: reserve_header.map(HeaderName::from_static),
            max_reserve: NonZeroU32::new(100).unwrap(),
        }
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn the_reservation_is_the_routes_or_the_header_capped_by_max_reserve() {
        let plain = usage(None);
        let asked = usage(Some("x-reserve"));
        let of = |u: &UsageSpec, h: &HeaderMap| reservation(h, u).map(NonZeroU32::get);
        assert_eq!(of(&plain, &headers(&[("x-reserve", "50")])), Ok(10));
        assert_eq!(of(&asked, &headers(&[])), Ok(10));
        assert_eq!(of(&asked, &headers(&[("x-reserve", " 50 ")])), Ok(50));
        assert_eq!(of(&asked, &headers(&[("x-reserve", "5000")])), Ok(100));
        assert_eq!(of(&asked, &headers(&[("x-reserve", "0")])), Ok(1));
        for bad in ["-1", "1e3", "", "12a", "99999999999999999999"] {
            assert_eq!(
                of(&asked, &headers(&[("x-reserve", bad)])),
                Err(()),
                "{bad:?}"
            );
        }
        let twice = headers(&[("x-reserve", "5"), ("x-reserve", "6")]);
        assert_eq!(of(&asked, &twice), Err(()));
    }

    #[test]
    fn usage_is_one_whole_number() {
        let name = HeaderName::from_static("x-usage");
        assert_eq!(reported(&headers(&[("x-usage", "42")]), &name), Some(42));
        assert_eq!(reported(&headers(&[]), &name), None);
        assert_eq!(reported(&headers(&[("x-usage", "4.2")]), &name), None);
        let twice = headers(&[("x-usage", "1"), ("x-usage", "2")]);
        assert_eq!(reported(&twice, &name), None);
    }
}
