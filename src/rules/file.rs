//! The TOML rules file: parsing and change detection.
//!
//! Owns the `[[rule]]` file format (SPEC §11) and [`FileFingerprint`], which
//! tells the cache when the file changed. Parsing reports every bad entry at
//! once; a file with any bad entry is refused as a whole, so a typo never
//! half-applies.

use std::collections::HashSet;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::Deserialize;

use super::model::{Limit, MAX_SHARDS, Rule, positive_i32, shard_count};
use crate::key::{RouteId, TenantId};

/// Largest capacity or refill, as shown in messages.
const I32_MAX: u32 = i32::MAX.unsigned_abs();

/// Why the rules file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum RuleFileError {
    /// The file could not be read.
    #[error("cannot read rules file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O failure.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML or has unknown keys.
    #[error("rules file {path} is not valid: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// Some entries have bad values.
    #[error("rules file {path} has {} bad entr{}:\n  {}", .problems.len(), if .problems.len() == 1 { "y" } else { "ies" }, .problems.join("\n  "))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// One line per bad value.
        problems: Vec<String>,
    },
}

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RulesFile {
    #[serde(default)]
    rule: Vec<RawRule>,
}

/// One `[[rule]]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    tenant: String,
    route: String,
    capacity: i64,
    refill_per_second: i64,
    #[serde(default = "one")]
    shards: i64,
    #[serde(default)]
    exact: bool,
}

fn one() -> i64 {
    1
}

/// Reads and parses the rules file at `path`.
///
/// # Errors
/// [`RuleFileError`] when the file is unreadable or any entry is bad.
pub fn load(path: &Path) -> Result<Vec<Rule>, RuleFileError> {
    let contents = std::fs::read_to_string(path).map_err(|source| RuleFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(path, &contents)
}

/// Parses rules file `contents` (`path` is only used in messages).
///
/// # Errors
/// [`RuleFileError`] when the TOML is invalid or any entry is bad.
pub fn parse(path: &Path, contents: &str) -> Result<Vec<Rule>, RuleFileError> {
    let file: RulesFile = toml::from_str(contents).map_err(|e| RuleFileError::Syntax {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    let mut rules = Vec::with_capacity(file.rule.len());
    for (i, raw) in file.rule.into_iter().enumerate() {
        let before = problems.len();
        let tenant = TenantId::parse(&raw.tenant)
            .map_err(|e| problems.push(format!("rule[{i}].tenant: {:?} {e}", raw.tenant)))
            .ok();
        let route = RouteId::parse(&raw.route)
            .map_err(|e| problems.push(format!("rule[{i}].route: {:?} {e}", raw.route)))
            .ok();
        let mut check = |key: &str, value: i64, valid: fn(i64) -> Option<NonZeroU32>, max: u32| {
            let ok = valid(value);
            if ok.is_none() {
                problems.push(format!(
                    "rule[{i}].{key}: must be between 1 and {max}, found {value}"
                ));
            }
            ok
        };
        let capacity = check("capacity", raw.capacity, positive_i32, I32_MAX);
        let refill = check(
            "refill_per_second",
            raw.refill_per_second,
            positive_i32,
            I32_MAX,
        );
        let shards = check("shards", raw.shards, shard_count, MAX_SHARDS);
        if !seen.insert((raw.tenant.clone(), raw.route.clone())) {
            problems.push(format!(
                "rule[{i}]: a second rule for tenant {:?} on route {:?}",
                raw.tenant, raw.route
            ));
        }
        if let (
            true,
            Some(tenant),
            Some(route),
            Some(capacity),
            Some(refill_per_second),
            Some(shards),
        ) = (
            problems.len() == before,
            tenant,
            route,
            capacity,
            refill,
            shards,
        ) {
            rules.push(Rule {
                tenant,
                route,
                limit: Limit {
                    capacity,
                    refill_per_second,
                    shards,
                    exact: raw.exact,
                },
            });
        }
    }
    if problems.is_empty() {
        Ok(rules)
    } else {
        Err(RuleFileError::Invalid {
            path: path.to_path_buf(),
            problems,
        })
    }
}

/// What identifies one version of a file without reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileFingerprint {
    /// Modification time.
    modified: Option<SystemTime>,
    /// Size in bytes.
    len: u64,
}

impl FileFingerprint {
    /// The current fingerprint of `path`, or `None` when it cannot be read.
    pub fn of(path: &Path) -> Option<Self> {
        let meta = std::fs::metadata(path).ok()?;
        Some(Self {
            modified: meta.modified().ok(),
            len: meta.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_format() {
        let rules = parse(
            Path::new("r.toml"),
            r#"
[[rule]]
tenant = "shop-a"
route = "create-order"
capacity = 200
refill_per_second = 100
"#,
        )
        .unwrap();
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].tenant.as_str(), "shop-a");
        assert_eq!(rules[0].limit.capacity.get(), 200);
    }

    #[test]
    fn an_empty_file_holds_no_rules() {
        assert!(parse(Path::new("r.toml"), "").unwrap().is_empty());
    }

    #[test]
    fn every_bad_entry_is_reported_and_nothing_applies() {
        let err = parse(
            Path::new("r.toml"),
            r#"
[[rule]]
tenant = "{x}"
route = "a"
capacity = 0
refill_per_second = 1

[[rule]]
tenant = "ok"
route = "a"
capacity = 1
refill_per_second = 3000000000

[[rule]]
tenant = "ok"
route = "a"
capacity = 1
refill_per_second = 1
"#,
        )
        .unwrap_err();
        let RuleFileError::Invalid { problems, .. } = err else {
            panic!("expected Invalid, got {err}");
        };
        assert_eq!(problems.len(), 4, "{problems:#?}");
        assert!(problems[0].starts_with("rule[0].tenant"));
        assert!(problems[1].starts_with("rule[0].capacity"));
        assert!(problems[2].starts_with("rule[1].refill_per_second"));
        assert!(problems[3].starts_with("rule[2]: a second rule"));
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err = parse(
            Path::new("r.toml"),
            "[[rule]]\ntenant='a'\nroute='b'\ncapacity=1\nrefill_per_second=1\nburst=3\n",
        )
        .unwrap_err();
        assert!(matches!(err, RuleFileError::Syntax { .. }), "{err}");
    }

    #[test]
    fn the_shipped_rules_file_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/rules.toml");
        assert!(!load(&path).unwrap().is_empty());
    }
}
