//! `[redis]`: which Redis deployment holds bucket state, and how tollgate
//! authenticates to it.
//!
//! Owns the checks of Redis URLs and targets, used for the gateway's own
//! `[redis]` section and for region files alike ([`redis_target`]), so a
//! URL is judged by one rule wherever it is written. Files (password, CA,
//! client certificate) are only named here; they are read, for
//! `check-config` and for serving alike, by the Redis client
//! (`crate::redis_client`).
//!
//! Invariant: no URL that turns certificate checks off (`#insecure`)
//! passes, and no message repeats a password.

use std::path::PathBuf;

use super::Problem;
use super::raw::RawRedis;
use super::redact_url;
use super::settings::{RedisCredentials, RedisSettings, RedisTarget, RedisTlsFiles};
use super::validate::Check;

/// `[redis]`.
pub(super) fn redis(c: &mut Check, raw: &RawRedis) -> RedisSettings {
    let target = match redis_target(
        &raw.url,
        &raw.cluster_nodes,
        &raw.sentinel_nodes,
        &raw.sentinel_master,
    ) {
        Ok(target) => target,
        Err(problems) => {
            c.problems.extend(problems);
            RedisTarget::LocalOnly
        }
    };
    let data_credentials = credentials(c, "redis", &raw.username, &raw.password_file);
    let sentinel_credentials = credentials(
        c,
        "redis.sentinel",
        &raw.sentinel_username,
        &raw.sentinel_password_file,
    );
    // A URL's password is for the servers it names: the data nodes, or the
    // sentinels.
    let sentinel = matches!(target, RedisTarget::Sentinel { .. });
    let (key, file) = if sentinel {
        ("redis.sentinel_password_file", &raw.sentinel_password_file)
    } else {
        ("redis.password_file", &raw.password_file)
    };
    if !file.is_empty() && target.urls().iter().any(|u| url_password(u)) {
        c.bad(key, "a Redis URL holds a password too; set only one");
    }
    let tls = RedisTlsFiles {
        ca_file: path(&raw.ca_file),
        client: match (path(&raw.tls_cert_file), path(&raw.tls_key_file)) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            (Some(_), None) => {
                c.bad("redis.tls_key_file", "must be set with redis.tls_cert_file");
                None
            }
            (None, Some(_)) => {
                c.bad("redis.tls_cert_file", "must be set with redis.tls_key_file");
                None
            }
        },
    };
    RedisSettings {
        target,
        timeout: c.millis("redis.timeout_ms", raw.timeout_ms, 60_000),
        connect_timeout: c.millis("redis.connect_timeout_ms", raw.connect_timeout_ms, 60_000),
        max_keys_per_call: c
            .range("redis.max_keys_per_call", raw.max_keys_per_call, 1, 1024)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(1),
        max_calls_in_flight: c
            .range("redis.max_calls_in_flight", raw.max_calls_in_flight, 1, 16)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(1),
        credentials: data_credentials,
        sentinel_credentials,
        tls,
    }
}

/// A path, unless `value` is empty.
fn path(value: &str) -> Option<PathBuf> {
    Some(PathBuf::from(value)).filter(|p| !p.as_os_str().is_empty())
}

/// `<prefix>_username` / `<prefix>_password_file` (or `username` /
/// `password_file` for the `redis` prefix).
fn credentials(
    c: &mut Check,
    prefix: &str,
    username: &str,
    password_file: &str,
) -> RedisCredentials {
    let key = |name: &str| match prefix.strip_prefix("redis.") {
        Some(sub) => format!("redis.{sub}_{name}"),
        None => format!("redis.{name}"),
    };
    if username
        .chars()
        .any(|ch| ch.is_whitespace() || ch.is_control())
        || username.len() > 256
    {
        c.bad(
            key("username"),
            "must be at most 256 characters, without spaces or control characters",
        );
    }
    RedisCredentials {
        username: Some(username.to_owned()).filter(|u| !u.is_empty()),
        password_file: path(password_file),
    }
}

/// Whether `url` carries a password in its user information.
fn url_password(url: &str) -> bool {
    redis::IntoConnectionInfo::into_connection_info(url)
        .is_ok_and(|info| info.redis_settings().password().is_some())
}

/// Resolves a Redis target from its keys: `sentinel_nodes` (with
/// `sentinel_master`), else `cluster_nodes`, else `url` ("" = local-only).
/// Problems are keyed `redis.<key>`.
///
/// # Errors
/// Every problem with the URLs and the combination of keys.
pub fn redis_target(
    url: &str,
    cluster_nodes: &[String],
    sentinel_nodes: &[String],
    sentinel_master: &str,
) -> Result<RedisTarget, Vec<Problem>> {
    let mut problems = Vec::new();
    let target = if !sentinel_nodes.is_empty() {
        if !cluster_nodes.is_empty() {
            problems.push(Problem::new(
                "redis.sentinel_nodes",
                "cannot be set with redis.cluster_nodes: Sentinel and Cluster are different deployments",
            ));
        }
        if sentinel_master.is_empty() {
            problems.push(Problem::new(
                "redis.sentinel_master",
                "must name the primary the sentinels monitor (their `sentinel monitor <name> …`)",
            ));
        } else if sentinel_master
            .chars()
            .any(|ch| ch.is_whitespace() || ch.is_control())
        {
            problems.push(Problem::new(
                "redis.sentinel_master",
                format!("{sentinel_master:?} is not a master name"),
            ));
        }
        RedisTarget::Sentinel {
            nodes: node_list(&mut problems, "redis.sentinel_nodes", sentinel_nodes),
            master: sentinel_master.to_owned(),
        }
    } else if !cluster_nodes.is_empty() {
        RedisTarget::Cluster(node_list(
            &mut problems,
            "redis.cluster_nodes",
            cluster_nodes,
        ))
    } else if url.is_empty() {
        RedisTarget::LocalOnly
    } else {
        if let Err(message) = check_url(url) {
            problems.push(Problem::new("redis.url", message));
        }
        RedisTarget::Single(url.to_owned())
    };
    if !sentinel_master.is_empty() && sentinel_nodes.is_empty() {
        problems.push(Problem::new(
            "redis.sentinel_master",
            "is set, but redis.sentinel_nodes is empty",
        ));
    }
    if problems.is_empty() {
        Ok(target)
    } else {
        Err(problems)
    }
}

/// The URLs of a node list (`host:port` means `redis://host:port`), all
/// of one scheme.
fn node_list(problems: &mut Vec<Problem>, key: &str, nodes: &[String]) -> Vec<String> {
    let urls: Vec<String> = nodes
        .iter()
        .map(|node| {
            if node.contains("://") {
                node.clone()
            } else {
                format!("redis://{node}")
            }
        })
        .collect();
    for (i, url) in urls.iter().enumerate() {
        if let Err(message) = check_url(url) {
            problems.push(Problem::new(format!("{key}[{i}]"), message));
        }
    }
    let tls = urls.iter().filter(|u| u.starts_with("rediss://")).count();
    if tls != 0 && tls != urls.len() {
        problems.push(Problem::new(
            key,
            "mixes redis:// and rediss:// nodes; use one scheme for all",
        ));
    }
    urls
}

/// Checks one Redis URL: `redis://` or `rediss://` with a host, parsed as
/// the client will parse it, certificate checks on.
fn check_url(url: &str) -> Result<(), String> {
    let shown = redact_url(url);
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        return Err(format!(
            "expected redis://[user:password@]host:port[/db] or rediss://… (TLS), found {shown:?}"
        ));
    }
    if url.contains('#') {
        return Err(format!(
            "{shown:?} has a `#`: certificate checks cannot be turned off (#insecure; trust \
             the server's CA with redis.ca_file instead), and a `#` in a password is written %23"
        ));
    }
    match redis::IntoConnectionInfo::into_connection_info(url) {
        Ok(_) => Ok(()),
        // The client's message may quote the URL; say only what failed.
        Err(e) => Err(format!(
            "{shown:?} is not a usable Redis URL ({})",
            e.code().unwrap_or("invalid")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(problems: Vec<Problem>) -> Vec<String> {
        problems.into_iter().map(|p| p.key).collect()
    }

    #[test]
    fn tls_urls_are_targets_and_insecure_ones_are_refused() {
        assert_eq!(
            redis_target("rediss://u:p@cache.example:6380/2", &[], &[], ""),
            Ok(RedisTarget::Single(
                "rediss://u:p@cache.example:6380/2".into()
            ))
        );
        let problems = redis_target("rediss://h:6380/#insecure", &[], &[], "").unwrap_err();
        assert_eq!(problems[0].key, "redis.url");
        assert!(
            problems[0].message.contains("redis.ca_file"),
            "{problems:?}"
        );
        let problems = redis_target("http://h:6379", &[], &[], "").unwrap_err();
        assert!(problems[0].message.starts_with("expected redis://"));
    }

    #[test]
    fn a_password_in_a_bad_url_is_never_repeated() {
        let problems = redis_target("redis://u:s3cret@", &[], &[], "").unwrap_err();
        let text = format!("{problems:?}");
        assert!(!text.contains("s3cret"), "{text}");
    }

    #[test]
    fn node_lists_take_host_port_and_one_scheme() {
        assert_eq!(
            redis_target("", &["a:1".into(), "rediss://b:2".into()], &[], ""),
            Err(vec![Problem::new(
                "redis.cluster_nodes",
                "mixes redis:// and rediss:// nodes; use one scheme for all"
            )])
        );
        assert_eq!(
            redis_target(
                "redis://x:1",
                &[],
                &["s1:26379".into(), "s2:26379".into()],
                "mymaster"
            ),
            Ok(RedisTarget::Sentinel {
                nodes: vec!["redis://s1:26379".into(), "redis://s2:26379".into()],
                master: "mymaster".into()
            })
        );
    }

    #[test]
    fn sentinel_needs_its_master_and_excludes_cluster() {
        assert_eq!(
            keys(redis_target("", &["c:1".into()], &["s:1".into()], "").unwrap_err()),
            ["redis.sentinel_nodes", "redis.sentinel_master"]
        );
        assert_eq!(
            keys(redis_target("redis://h:1", &[], &[], "mymaster").unwrap_err()),
            ["redis.sentinel_master"]
        );
    }
}
