//! Route entries: each `[[routes]]` table checked into a [`RouteSpec`].
//!
//! Owns what makes a route usable: a valid, unique id, methods, a path
//! prefix in normal form, an `http://` or `https://` upstream, a cost,
//! and for a route whose answers report their usage, its reservation.

use std::collections::HashSet;

use std::num::NonZeroU32;

use hyper::header::HeaderName;
use hyper::{Method, Uri};

use super::raw::RawRoute;
use super::settings::{RouteSpec, UsageSpec};
use super::validate::Check;
use crate::key::RouteId;
use crate::path::normalize;

/// Validates one route entry; `None` when it is unusable.
pub(super) fn route(
    c: &mut Check,
    i: usize,
    r: &RawRoute,
    seen: &mut HashSet<String>,
) -> Option<RouteSpec> {
    let at = |key: &str| format!("routes[{i}].{key}");
    let before = c.problems.len();

    let id = match RouteId::parse(&r.id) {
        Ok(id) => Some(id),
        Err(e) => {
            c.bad(at("id"), format!("{:?} {e}", r.id));
            None
        }
    };
    if !r.id.is_empty() && !seen.insert(r.id.clone()) {
        c.bad(at("id"), format!("duplicate route id {:?}", r.id));
    }

    let methods = r
        .methods
        .iter()
        .filter_map(
            |m| match Method::from_bytes(m.to_ascii_uppercase().as_bytes()) {
                Ok(method) => Some(method),
                Err(_) => {
                    c.bad(at("methods"), format!("{m:?} is not an HTTP method"));
                    None
                }
            },
        )
        .collect();

    if !r.path_prefix.starts_with('/') {
        c.bad(
            at("path_prefix"),
            format!("must start with '/', found {:?}", r.path_prefix),
        );
    } else {
        match normalize(&r.path_prefix) {
            Ok(normal) if normal == r.path_prefix => {}
            Ok(normal) => c.bad(
                at("path_prefix"),
                format!(
                    "must be written as requests are matched: {:?}, not {:?}",
                    normal, r.path_prefix
                ),
            ),
            Err(e) => c.bad(
                at("path_prefix"),
                format!("{:?} is refused in requests ({e})", r.path_prefix),
            ),
        }
    }
    let path_prefix = match r.path_prefix.trim_end_matches('/') {
        "" => "/".to_owned(),
        p => p.to_owned(),
    };

    let (upstream_origin, upstream_base_path) = upstream(c, &at("upstream"), &r.upstream);
    let cost = c.positive_i32(&at("cost"), r.cost);
    let usage = usage(c, &at, r, cost);

    if c.problems.len() != before {
        return None;
    }
    Some(RouteSpec {
        id: id?,
        methods,
        path_prefix,
        upstream_origin,
        upstream_base_path,
        cost,
        usage,
    })
}

/// The usage settlement of a route: `None` without `usage_header`, where
/// the keys that only it gives meaning to are refused.
fn usage(
    c: &mut Check,
    at: &dyn Fn(&str) -> String,
    r: &RawRoute,
    cost: NonZeroU32,
) -> Option<UsageSpec> {
    let header = |c: &mut Check, key: &str, raw: &str| {
        HeaderName::from_bytes(raw.as_bytes())
            .map_err(|_| c.bad(at(key), format!("{raw:?} is not a header name")))
            .ok()
    };
    if r.usage_header.is_empty() {
        for (key, set) in [
            ("reserve", r.reserve != 0),
            ("reserve_header", !r.reserve_header.is_empty()),
            ("max_reserve", r.max_reserve != 0),
        ] {
            if set {
                c.bad(at(key), "means something only with usage_header");
            }
        }
        return None;
    }
    let usage_header = header(c, "usage_header", &r.usage_header);
    let reserve_header = match r.reserve_header.as_str() {
        "" => None,
        raw => header(c, "reserve_header", raw),
    };
    let reserve = match r.reserve {
        0 => cost,
        v => c.positive_i32(&at("reserve"), v),
    };
    let max_reserve = match r.max_reserve {
        0 => reserve,
        v => c.positive_i32(&at("max_reserve"), v),
    };
    if max_reserve < reserve {
        c.bad(
            at("max_reserve"),
            format!("must be at least the reserve ({reserve}), found {max_reserve}"),
        );
    }
    Some(UsageSpec {
        header: usage_header?,
        reserve,
        reserve_header,
        max_reserve,
    })
}

/// Splits an upstream URL into origin and base path.
fn upstream(c: &mut Check, key: &str, raw: &str) -> (String, String) {
    let parsed = raw.parse::<Uri>().ok().filter(|u| {
        matches!(u.scheme_str(), Some("http" | "https"))
            && u.authority().is_some_and(|a| !a.as_str().contains('@'))
            && u.query().is_none()
    });
    match parsed {
        Some(uri) => {
            let scheme = uri.scheme_str().unwrap_or_default();
            if scheme == "https"
                && let Err(e) = crate::tls::server_name(uri.host().unwrap_or_default())
            {
                c.bad(key, e);
            }
            let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
            let base = uri.path().trim_end_matches('/').to_owned();
            (format!("{scheme}://{authority}"), base)
        }
        None => {
            c.bad(
                key,
                format!("expected http[s]://host[:port][/base-path], found {raw:?}"),
            );
            (String::new(), String::new())
        }
    }
}
