//! The entry points beside the proxy: `[rls]` (Envoy's rate limit
//! service) and `[check]` (the HTTP check for nginx and Traefik). Each is
//! off while its `listen` is empty.

use std::net::SocketAddr;

use super::raw::{RawCheck, RawRls};
use super::settings::{CheckSettings, RlsSettings, ServerSettings};
use super::validate::Check;

/// The listen address at `key`, when set; it must differ from the proxy's
/// and the admin listener's.
fn listen(c: &mut Check, key: &str, value: &str, server: &ServerSettings) -> Option<SocketAddr> {
    if value.is_empty() {
        return None;
    }
    let addr = c.socket(key, value);
    if addr.port() != 0 && (addr == server.listen || addr == server.admin_listen) {
        c.bad(
            key,
            "must differ from server.listen and server.admin_listen",
        );
    }
    Some(addr)
}

/// `[rls]`.
pub(super) fn rls(c: &mut Check, raw: &RawRls, server: &ServerSettings) -> Option<RlsSettings> {
    let listen = listen(c, "rls.listen", &raw.listen, server)?;
    for (key, value) in [
        ("rls.tenant_key", &raw.tenant_key),
        ("rls.route_key", &raw.route_key),
        ("rls.charge_key", &raw.charge_key),
        ("rls.request_id_key", &raw.request_id_key),
        ("rls.release_key", &raw.release_key),
    ] {
        if value.is_empty() {
            c.bad(key, "must name a descriptor entry key");
        }
    }
    // Each entry key means one thing: each differs from those before it.
    let keys = [
        ("rls.tenant_key", &raw.tenant_key),
        ("rls.route_key", &raw.route_key),
        ("rls.charge_key", &raw.charge_key),
        ("rls.request_id_key", &raw.request_id_key),
        ("rls.release_key", &raw.release_key),
    ];
    for (i, (key, value)) in keys.iter().enumerate() {
        let earlier: Vec<&str> = keys[..i]
            .iter()
            .filter(|(_, v)| v == value)
            .map(|(k, _)| *k)
            .collect();
        if !earlier.is_empty() {
            c.bad(*key, format!("must differ from {}", earlier.join(" and ")));
        }
    }
    Some(RlsSettings {
        listen,
        tenant_key: raw.tenant_key.clone(),
        route_key: raw.route_key.clone(),
        charge_key: raw.charge_key.clone(),
        request_id_key: raw.request_id_key.clone(),
        release_key: raw.release_key.clone(),
        domain: Some(raw.domain.clone()).filter(|d| !d.is_empty()),
    })
}

/// `[check]`.
pub(super) fn check(
    c: &mut Check,
    raw: &RawCheck,
    server: &ServerSettings,
) -> Option<CheckSettings> {
    let listen = listen(c, "check.listen", &raw.listen, server)?;
    let refused_status = c
        .range("check.refused_status", raw.refused_status, 400, 499)
        .and_then(|s| u16::try_from(s).ok())
        .unwrap_or(403);
    Some(CheckSettings {
        listen,
        refused_status,
    })
}
