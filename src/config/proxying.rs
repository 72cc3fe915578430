//! The proxy's settings: its listener (`[server]`, TLS included), its
//! upstreams (`[upstream]`) and the pace its clients must keep
//! (`[client]`).
//!
//! Certificate and CA files are checked here by loading them as the
//! gateway will (`crate::tls`), so a configuration that passes
//! `check-config` never fails on its TLS files at start.

use std::path::PathBuf;

use super::raw::{RawClient, RawServer, RawUpstream};
use super::settings::{
    ClientSettings, ListenerTlsFiles, Pace, RouteSpec, ServerSettings, UpstreamSettings,
};
use super::validate::Check;
use crate::tls;

/// `[server]`.
pub(super) fn server(c: &mut Check, raw: &RawServer) -> ServerSettings {
    let listen = c.socket("server.listen", &raw.listen);
    let admin_listen = c.socket("server.admin_listen", &raw.admin_listen);
    if listen == admin_listen && listen.port() != 0 {
        c.bad("server.admin_listen", "must differ from server.listen");
    }
    let workers = match c.range("server.workers", raw.workers, 0, 1024) {
        Some(0) => std::thread::available_parallelism().map_or(1, usize::from),
        Some(n) => usize::try_from(n).unwrap_or(1),
        None => 1,
    };
    ServerSettings {
        listen,
        admin_listen,
        workers,
        shutdown_timeout: c.seconds(
            "server.shutdown_timeout_seconds",
            raw.shutdown_timeout_seconds,
            3600,
        ),
        h2c: raw.h2c,
        tls: listener_tls(c, raw),
    }
}

/// The listener's certificate files, when both are set and load.
fn listener_tls(c: &mut Check, raw: &RawServer) -> Option<ListenerTlsFiles> {
    let reload = c.seconds("server.tls_reload_seconds", raw.tls_reload_seconds, 86_400);
    match (raw.tls_cert_file.is_empty(), raw.tls_key_file.is_empty()) {
        (true, true) => None,
        (false, true) => {
            c.bad(
                "server.tls_key_file",
                "must be set with server.tls_cert_file",
            );
            None
        }
        (true, false) => {
            c.bad(
                "server.tls_cert_file",
                "must be set with server.tls_key_file",
            );
            None
        }
        (false, false) => {
            let files = ListenerTlsFiles {
                cert: PathBuf::from(&raw.tls_cert_file),
                key: PathBuf::from(&raw.tls_key_file),
                reload,
            };
            match tls::check_listener_files(&files.cert, &files.key) {
                Ok(()) => Some(files),
                Err(e) => {
                    c.bad("server.tls_cert_file", e.to_string());
                    None
                }
            }
        }
    }
}

/// `[upstream]`; `routes` tell whether any upstream is `https://`, which
/// needs trusted roots.
pub(super) fn upstream(c: &mut Check, raw: &RawUpstream, routes: &[RouteSpec]) -> UpstreamSettings {
    let ca_file = Some(PathBuf::from(&raw.ca_file)).filter(|p| !p.as_os_str().is_empty());
    let tls_upstreams = routes.iter().any(RouteSpec::is_tls);
    if (tls_upstreams || ca_file.is_some())
        && let Err(e) = tls::check_ca_file(ca_file.as_deref())
    {
        c.bad("upstream.ca_file", e.to_string());
    }
    let pool = count(
        c,
        "upstream.max_connections_per_worker",
        raw.max_connections_per_worker,
    );
    let per_tenant = count32(
        c,
        "upstream.max_connections_per_tenant",
        raw.max_connections_per_tenant,
    );
    let without_rule = count32(
        c,
        "upstream.max_connections_without_rule",
        raw.max_connections_without_rule,
    );
    UpstreamSettings {
        connect_timeout: c.millis(
            "upstream.connect_timeout_ms",
            raw.connect_timeout_ms,
            600_000,
        ),
        timeout: c.millis("upstream.timeout_ms", raw.timeout_ms, 3_600_000),
        max_connections_per_worker: pool,
        max_connections_per_tenant: half_the_pool(
            c,
            "upstream.max_connections_per_tenant",
            per_tenant,
            pool,
            "one tenant cannot hold every upstream connection",
        ),
        max_connections_without_rule: half_the_pool(
            c,
            "upstream.max_connections_without_rule",
            without_rule,
            pool,
            "tenants with a rule keep the other half",
        ),
        idle_timeout: c.millis("upstream.idle_timeout_ms", raw.idle_timeout_ms, 3_600_000),
        ca_file,
    }
}

/// `value` of `key`, at most half of a pool of `pool` connections (and at
/// least 1); a larger value is clamped, with a note saying `why`.
fn half_the_pool(c: &mut Check, key: &str, value: u32, pool: usize, why: &str) -> u32 {
    let half = u32::try_from(pool / 2).unwrap_or(u32::MAX).max(1);
    if value > half {
        c.notes.push(format!(
            "{key} = {value} is more than half of upstream.max_connections_per_worker = {pool}: \
             {half} are allowed, so that {why}"
        ));
        half
    } else {
        value
    }
}

/// The smallest body budget: one whole gRPC message (64 KiB) with its
/// 5-byte prefix, the largest body a listener reads whole.
const MIN_BODY_BUFFER: i64 = 64 * 1024 + 5;

/// A connection count in `1..=100_000`.
fn count(c: &mut Check, key: &str, value: i64) -> usize {
    c.range(key, value, 1, 100_000)
        .and_then(|n| usize::try_from(n).ok())
        .unwrap_or(1)
}

/// A connection count in `1..=100_000`, as `u32`.
fn count32(c: &mut Check, key: &str, value: i64) -> u32 {
    u32::try_from(count(c, key, value)).unwrap_or(1)
}

/// `[client]`.
pub(super) fn client(c: &mut Check, raw: &RawClient) -> ClientSettings {
    let min_bytes_per_second = c
        .range(
            "client.min_bytes_per_second",
            raw.min_bytes_per_second,
            0,
            1 << 40,
        )
        .unwrap_or(0);
    let header_timeout = c.millis("client.header_timeout_ms", raw.header_timeout_ms, 3_600_000);
    let h2_idle_timeout = c.millis(
        "client.h2_idle_timeout_ms",
        raw.h2_idle_timeout_ms,
        86_400_000,
    );
    if h2_idle_timeout <= header_timeout {
        c.bad(
            "client.h2_idle_timeout_ms",
            format!(
                "must be longer than client.header_timeout_ms ({} ms), found {} ms",
                header_timeout.as_millis(),
                h2_idle_timeout.as_millis()
            ),
        );
    }
    // A connection's budget must hold one whole body of the largest kind
    // read whole (a gRPC message: 64 KiB and its 5-byte prefix).
    let body_buffer_bytes_per_connection = c
        .range(
            "client.body_buffer_bytes_per_connection",
            raw.body_buffer_bytes_per_connection,
            MIN_BODY_BUFFER,
            1 << 30,
        )
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(1 << 20);
    let body_buffer_bytes = c
        .range(
            "client.body_buffer_bytes",
            raw.body_buffer_bytes,
            MIN_BODY_BUFFER,
            1 << 40,
        )
        .unwrap_or(64 << 20);
    if body_buffer_bytes < u64::from(body_buffer_bytes_per_connection) {
        c.bad(
            "client.body_buffer_bytes",
            format!(
                "must be at least client.body_buffer_bytes_per_connection ({body_buffer_bytes_per_connection}), found {body_buffer_bytes}"
            ),
        );
    }
    ClientSettings {
        header_timeout,
        h2_idle_timeout,
        h2_max_concurrent_streams: c
            .range(
                "client.h2_max_concurrent_streams",
                raw.h2_max_concurrent_streams,
                1,
                10_000,
            )
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(100),
        body_buffer_bytes_per_connection,
        body_buffer_bytes,
        read: Pace {
            timeout: c.millis("client.read_timeout_ms", raw.read_timeout_ms, 3_600_000),
            min_bytes_per_second,
        },
        write: Pace {
            timeout: c.millis("client.write_timeout_ms", raw.write_timeout_ms, 3_600_000),
            min_bytes_per_second,
        },
    }
}
