//! What `check-config` verifies beyond the configuration file itself: the
//! region files, the rules file, and the Redis client's files (password,
//! CA, client certificate) it names.

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
