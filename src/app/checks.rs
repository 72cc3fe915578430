//! What `check-config` verifies beyond the configuration file itself: the
//! region files, the rules file, and the Redis client's files (password,
//! CA, client certificate) it names; and what `serve` tells at start about
//! the upstreams it will need (`warn_unreachable_upstreams`).

use std::sync::Arc;

use crate::config::{Config, RuleSource};
use crate::redis_client::RedisConnector;
use crate::region;
use crate::region::model::{RegionSpec, Regions};
use crate::rules;

/// Checks what the config file only names: the region files, when a region
/// is set, the rules file, when rules come from one (a database is not
/// contacted: the gateway serves without it), and the Redis client's files,
/// read as the gateway reads them (Redis is not contacted). Returns a
/// one-line summary.
///
/// # Errors
/// One line per problem, from all of them at once.
pub fn check(config: &Config) -> Result<String, Vec<String>> {
    let mut problems = Vec::new();
    let (regions, redis) = match regions(config) {
        Ok(None) => (String::new(), Some(config.redis.clone())),
        Ok(Some((region, all))) => (
            format!(", region {} of {}", region.id, all.all.len()),
            Some(region.redis_settings(&config.redis)),
        ),
        Err(found) => {
            problems.extend(found);
            (String::new(), None)
        }
    };
    if let Some(settings) = redis
        && let Err(e) = RedisConnector::new(&settings)
    {
        problems.push(e.to_string());
    }
    let rules = match &config.rules.source {
        RuleSource::Database(_) => "rules from PostgreSQL".to_owned(),
        RuleSource::File(path) => match rules::file::read(path)
            .and_then(|contents| rules::file::parse_for(path, &contents, &config.rules.routes))
        {
            Ok(file) => format!("{} rules in {}", file.rules.len(), path.display()),
            Err(rules::file::RuleFileError::Invalid {
                path,
                problems: found,
            }) => {
                problems.extend(
                    found
                        .into_iter()
                        .map(|p| format!("{}: {p}", path.display())),
                );
                String::new()
            }
            Err(e) => {
                problems.push(e.to_string());
                String::new()
            }
        },
    };
    if problems.is_empty() {
        Ok(format!("{rules}{regions}"))
    } else {
        Err(problems)
    }
}

/// This instance's region and every region, when `instance.region` is set.
///
/// # Errors
/// One line per problem with the region files or the region id.
pub(super) fn regions(config: &Config) -> Result<Option<(RegionSpec, Arc<Regions>)>, Vec<String>> {
    let Some(id) = &config.instance.region else {
        return Ok(None);
    };
    let all = region::model::load_dir(&config.regions_dir).map_err(|e| e.problems)?;
    let Some(this) = all.get(id).cloned() else {
        return Err(vec![format!(
            "instance.region: no region {id:?} in {} (found: {})",
            config.regions_dir.display(),
            all.ids().collect::<Vec<_>>().join(", ")
        )]);
    };
    Ok(Some((this, Arc::new(all))))
}

/// Tries each upstream of `routes` once, within `timeout`, and warns
/// about every one that does not accept a connection (its routes will
/// answer 502 until it does): the first thing a newcomer's gateway needs
/// that the gateway cannot start itself.
pub(super) async fn warn_unreachable_upstreams(
    routes: Vec<crate::config::RouteSpec>,
    timeout: std::time::Duration,
) {
    let mut by_address: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for route in &routes {
        let (authority, port) = route.upstream_authority();
        by_address
            .entry(format!("{}:{port}", authority.host()))
            .or_default()
            .push(route.id.to_string());
    }
    for (address, ids) in by_address {
        let connected =
            tokio::time::timeout(timeout, tokio::net::TcpStream::connect(address.as_str())).await;
        if !matches!(connected, Ok(Ok(_))) {
            tracing::warn!(
                upstream = %address,
                routes = %ids.join(", "),
                "No upstream accepts connections at this address: its routes answer 502 until one does."
            );
        }
    }
}
