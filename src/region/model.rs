//! Regions: their files, and this instance's place among them.
//!
//! Owns the `regions/<id>.toml` format: a region's id, its Redis, and the
//! share of every limit it holds until told otherwise. All region files of
//! a deployment are loaded together, so a gateway knows every region the
//! rebalancer divides limits between.
//!
//! Invariants: ids are unique and in the id charset, each file is named
//! after its id, every default share is in [`MIN_SHARE`, 1], and the
//! defaults sum to 1.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::{self, RedisSettings, RedisTarget};
use crate::key::validate_id;

/// Tolerance when checking that shares sum to 1.
pub const SUM_TOLERANCE: f64 = 1e-6;

/// The smallest share of a limit a region may hold (0.1 %). Below it a
/// limit refills in geological time, and the bucket script's arithmetic
/// on it would overflow; every share read (region file, admin API,
/// `region_share` row) is checked against it ([`check_share`]).
pub const MIN_SHARE: f64 = 0.001;

/// `share`, when it is a number in [[`MIN_SHARE`], 1].
///
/// # Errors
/// A message saying what is wrong.
pub fn check_share(share: f64) -> Result<f64, String> {
    if share.is_finite() && (MIN_SHARE..=1.0).contains(&share) {
        Ok(share)
    } else {
        Err(format!(
            "must be a number in [{MIN_SHARE}, 1], found {share}"
        ))
    }
}

/// One region, as its file describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct RegionSpec {
    /// Region id (the file name without `.toml`).
    pub id: String,
    /// Share of every limit held here unless a `region_share` row says
    /// otherwise.
    pub default_share: f64,
    /// The region's Redis (local-only when its file names none).
    pub redis: RedisTarget,
}

impl RegionSpec {
    /// The gateway's Redis settings with this region's target.
    pub fn redis_settings(&self, base: &RedisSettings) -> RedisSettings {
        RedisSettings {
            target: self.redis.clone(),
            ..base.clone()
        }
    }
}

/// Every region of a deployment.
#[derive(Debug, Clone, PartialEq)]
pub struct Regions {
    /// All regions, sorted by id.
    pub all: Vec<RegionSpec>,
}

impl Regions {
    /// The region called `id`.
    pub fn get(&self, id: &str) -> Option<&RegionSpec> {
        self.all.iter().find(|r| r.id == id)
    }

    /// Region ids, sorted.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.all.iter().map(|r| r.id.as_str())
    }
}

/// Why the region files could not be used.
#[derive(Debug, thiserror::Error)]
#[error("{}", .problems.join("\n  "))]
pub struct RegionError {
    /// One line per problem.
    pub problems: Vec<String>,
}

/// A region file as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRegion {
    id: String,
    default_share: f64,
    #[serde(default)]
    redis: RawRegionRedis,
}

/// `[redis]` of a region file.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawRegionRedis {
    #[serde(default)]
    url: String,
    #[serde(default)]
    cluster_nodes: Vec<String>,
    #[serde(default)]
    sentinel_nodes: Vec<String>,
    #[serde(default)]
    sentinel_master: String,
}

/// Loads every `*.toml` in `dir`, reporting every problem at once.
///
/// # Errors
/// [`RegionError`] listing unreadable or invalid files, duplicate ids and
/// default shares that do not sum to 1.
pub fn load_dir(dir: &Path) -> Result<Regions, RegionError> {
    let mut problems = Vec::new();
    let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect(),
        Err(e) => {
            return Err(RegionError {
                problems: vec![format!(
                    "cannot read the regions directory {}: {e}",
                    dir.display()
                )],
            });
        }
    };
    files.sort();
    let mut all = Vec::new();
    for path in files {
        match parse(&path) {
            Ok(region) => all.push(region),
            Err(mut p) => problems.append(&mut p),
        }
    }
    if all.is_empty() && problems.is_empty() {
        problems.push(format!("no region files (*.toml) in {}", dir.display()));
    }
    let sum: f64 = all.iter().map(|r| r.default_share).sum();
    if !all.is_empty() && (sum - 1.0).abs() > SUM_TOLERANCE {
        problems.push(format!("the default shares sum to {sum}, not 1"));
    }
    if problems.is_empty() {
        Ok(Regions { all })
    } else {
        Err(RegionError { problems })
    }
}

/// Parses and checks one region file.
fn parse(path: &Path) -> Result<RegionSpec, Vec<String>> {
    let at = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| vec![format!("{at}: {e}")])?;
    let raw: RawRegion = toml::from_str(&text).map_err(|e| vec![format!("{at}: {e}")])?;
    let mut problems = Vec::new();
    if let Err(e) = validate_id(&raw.id) {
        problems.push(format!("{at}: id {:?} {e}", raw.id));
    }
    if path.file_stem().and_then(|s| s.to_str()) != Some(raw.id.as_str()) {
        problems.push(format!("{at}: the file must be named {}.toml", raw.id));
    }
    if let Err(message) = check_share(raw.default_share) {
        problems.push(format!("{at}: default_share {message}"));
    }
    let redis = config::redis_target(
        &raw.redis.url,
        &raw.redis.cluster_nodes,
        &raw.redis.sentinel_nodes,
        &raw.redis.sentinel_master,
    )
    .unwrap_or_else(|found| {
        problems.extend(found.into_iter().map(|p| format!("{at}: {p}")));
        RedisTarget::LocalOnly
    });
    if problems.is_empty() {
        Ok(RegionSpec {
            id: raw.id,
            default_share: raw.default_share,
            redis,
        })
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_regions_split_70_30() {
        let regions = load_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("regions")).unwrap();
        let shares: Vec<(&str, f64)> = regions
            .all
            .iter()
            .map(|r| (r.id.as_str(), r.default_share))
            .collect();
        assert_eq!(shares, vec![("eu-west", 0.7), ("us-east", 0.3)]);
    }

    #[test]
    fn every_problem_is_reported() {
        let dir = std::env::temp_dir().join(format!("tollgate-regions-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.toml"), "id = \"a\"\ndefault_share = 0.5\n").unwrap();
        std::fs::write(dir.join("b.toml"), "id = \"wrong\"\ndefault_share = 0.7\n").unwrap();
        std::fs::write(dir.join("c.toml"), "id = \"c\"\ndefault_share = 1e-300\n").unwrap();
        let err = load_dir(&dir).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(err.problems.len(), 3, "{err}");
        assert!(err.problems[0].contains("must be named wrong.toml"));
        assert!(err.problems[1].contains("default_share must be a number in [0.001, 1]"));
        assert!(err.problems[2].contains("sum to"));
    }
}
