//! The TOML rules file: parsing and change detection.
//!
//! Owns the `[[rule]]` file format (SPEC §11) and [`FileWatch`], which tells
//! the cache when the file changed and has held still since. Parsing
//! reports every bad entry at once; a file with any bad entry is refused as
//! a whole, so a typo never half-applies.
//!
//! A file is often read while it is being rewritten (`cat new > rules.toml`
//! truncates first). So a change is taken only once the file has kept the
//! same size and modification time for `rules.settle_ms`, and a file with
//! no `[[rule]]` at all never replaces rules in force unless it says so
//! with `rule = []` ([`RuleFile::declares_empty`]). Writing a temporary
//! file and renaming it over the old one is the safe way to update.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::Deserialize;

use std::num::NonZeroU32;

use super::model::{Limit, Rule, RuleSet, SnapshotOrigin};
use super::spec::RuleSpec;
use crate::config::unknown_route;
use crate::key::RouteId;

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
    /// The file holds no rule and does not say so on purpose, while rules
    /// are in force.
    #[error(
        "rules file {path} holds no rule; the rules in force stay (write `rule = []` to remove every rule)"
    )]
    Emptied {
        /// The file.
        path: PathBuf,
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
    /// `None` when the file has no `rule` key at all.
    rule: Option<Vec<RuleSpec>>,
}

/// A parsed rules file.
#[derive(Debug)]
pub struct RuleFile {
    /// Every rule, in file order.
    pub rules: Vec<Rule>,
    /// Whether the file says it holds no rule on purpose (`rule = []`),
    /// rather than holding no `rule` key at all (empty, or cut short).
    pub declares_empty: bool,
}

/// Reads the rules file at `path`, unparsed.
///
/// # Errors
/// [`RuleFileError::Read`] when the file cannot be read.
pub fn read(path: &Path) -> Result<String, RuleFileError> {
    std::fs::read_to_string(path).map_err(|source| RuleFileError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads and parses the rules file at `path`.
///
/// # Errors
/// [`RuleFileError`] when the file is unreadable or any entry is bad.
pub fn load(path: &Path) -> Result<RuleFile, RuleFileError> {
    parse(path, &read(path)?)
}

/// Parses rules file `contents` for a gateway whose configured route ids
/// are `routes`: what every reader of the rules file in force calls.
///
/// # Errors
/// As [`parse`], and [`RuleFileError::Invalid`] listing as
/// `rule[i].route` each rule that names a route outside `routes`.
pub fn parse_for(
    path: &Path,
    contents: &str,
    routes: &[RouteId],
) -> Result<RuleFile, RuleFileError> {
    let file = parse(path, contents)?;
    check_routes(path, &file, routes)?;
    Ok(file)
}

/// Refuses `file` when a rule names a route outside `routes`: such a rule
/// would never apply, and is most likely a typo.
fn check_routes(path: &Path, file: &RuleFile, routes: &[RouteId]) -> Result<(), RuleFileError> {
    let problems: Vec<String> = file
        .rules
        .iter()
        .enumerate()
        .filter(|(_, rule)| !rule.route.is_all())
        .filter_map(|(i, rule)| {
            unknown_route(routes, rule.route.as_str()).map(|why| format!("rule[{i}].route: {why}"))
        })
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(RuleFileError::Invalid {
            path: path.to_path_buf(),
            problems,
        })
    }
}

/// Parses rules file `contents` (`path` is only used in messages).
///
/// # Errors
/// [`RuleFileError`] when the TOML is invalid or any entry is bad.
pub fn parse(path: &Path, contents: &str) -> Result<RuleFile, RuleFileError> {
    let file: RulesFile = toml::from_str(contents).map_err(|e| RuleFileError::Syntax {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let declares_empty = file.rule.as_ref().is_some_and(Vec::is_empty);
    let raw_rules = file.rule.unwrap_or_default();
    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    let mut rules = Vec::with_capacity(raw_rules.len());
    for (i, spec) in raw_rules.into_iter().enumerate() {
        if !seen.insert((spec.tenant.clone(), spec.route.clone())) {
            problems.push(format!(
                "rule[{i}]: a second rule for tenant {:?} on route {:?}",
                spec.tenant, spec.route
            ));
        }
        match spec.validate() {
            Ok(rule) => rules.push(rule),
            Err(found) => problems.extend(found.iter().map(|p| format!("rule[{i}].{p}"))),
        }
    }
    problems.extend(conflicts(&rules));
    if problems.is_empty() {
        Ok(RuleFile {
            rules,
            declares_empty,
        })
    } else {
        Err(RuleFileError::Invalid {
            path: path.to_path_buf(),
            problems,
        })
    }
}

/// One line per rule that cannot stand beside the file's other rules of
/// its tenant ([`RuleSet::conflict`]).
fn conflicts(rules: &[Rule]) -> Vec<String> {
    let origin = SnapshotOrigin {
        source: "file",
        loaded_at_unix: 0,
    };
    // The default only counts as one limit here; its size does not matter.
    let set = RuleSet::new(
        rules.iter().cloned(),
        Limit::new(NonZeroU32::MIN, NonZeroU32::MIN),
        origin,
    );
    rules
        .iter()
        .enumerate()
        .filter_map(|(i, rule)| set.conflict(rule).map(|p| format!("rule[{i}].{p}")))
        .collect()
}

/// What identifies one version of a file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// What the rules file did since the last look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileChange {
    /// Nothing since the last read.
    None,
    /// It changed and has not held still for long enough yet; look again
    /// after this many milliseconds.
    Settling(u64),
    /// It changed and has held still since: read it.
    Settled,
}

/// Change detection for the rules file, on fingerprints seen at given
/// times (milliseconds of the caller's clock).
#[derive(Debug)]
pub struct FileWatch {
    /// How long a changed file must hold still before it is read.
    settle_ms: u64,
    /// The fingerprint at the last read.
    read: Option<FileFingerprint>,
    /// A fingerprint differing from `read`, and since when it was seen.
    moving: Option<(Option<FileFingerprint>, u64)>,
}

impl FileWatch {
    /// A watch whose file was last read at fingerprint `read`.
    pub fn new(read: Option<FileFingerprint>, settle_ms: u64) -> Self {
        Self {
            settle_ms,
            read,
            moving: None,
        }
    }

    /// Whether the file, now at fingerprint `seen`, changed and has held
    /// still for the settle time at `now_ms`.
    pub fn look(&mut self, seen: Option<FileFingerprint>, now_ms: u64) -> FileChange {
        if seen == self.read {
            self.moving = None;
            return FileChange::None;
        }
        match self.moving {
            Some((moving, since)) if moving == seen => {
                let held = now_ms.saturating_sub(since);
                if held >= self.settle_ms {
                    FileChange::Settled
                } else {
                    FileChange::Settling(self.settle_ms - held)
                }
            }
            _ => {
                self.moving = Some((seen, now_ms));
                FileChange::Settling(self.settle_ms.max(1))
            }
        }
    }

    /// Records that the file was read at fingerprint `read`.
    pub fn was_read(&mut self, read: Option<FileFingerprint>) {
        self.read = read;
        self.moving = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` parsed as a rules file named `r.toml`.
    fn parse_toml(text: &str) -> Result<RuleFile, RuleFileError> {
        parse(Path::new("r.toml"), text)
    }

    fn fingerprint(len: u64) -> Option<FileFingerprint> {
        Some(FileFingerprint {
            modified: None,
            len,
        })
    }

    #[test]
    fn a_change_is_taken_only_once_the_file_has_held_still() {
        let mut watch = FileWatch::new(fingerprint(10), 300);
        assert_eq!(watch.look(fingerprint(10), 0), FileChange::None);
        // Truncated, then written in steps.
        assert_eq!(watch.look(fingerprint(0), 1_000), FileChange::Settling(300));
        assert_eq!(watch.look(fingerprint(5), 1_200), FileChange::Settling(300));
        assert_eq!(
            watch.look(fingerprint(12), 1_400),
            FileChange::Settling(300)
        );
        assert_eq!(
            watch.look(fingerprint(12), 1_600),
            FileChange::Settling(100)
        );
        assert_eq!(watch.look(fingerprint(12), 1_700), FileChange::Settled);
        watch.was_read(fingerprint(12));
        assert_eq!(watch.look(fingerprint(12), 5_000), FileChange::None);
        // A file that disappears is a change too.
        assert_eq!(watch.look(None, 6_000), FileChange::Settling(300));
    }

    #[test]
    fn a_change_reverted_before_it_settles_is_no_change() {
        let mut watch = FileWatch::new(fingerprint(10), 300);
        assert_eq!(watch.look(fingerprint(0), 0), FileChange::Settling(300));
        assert_eq!(watch.look(fingerprint(10), 100), FileChange::None);
        assert_eq!(watch.look(fingerprint(10), 1_000), FileChange::None);
    }

    #[test]
    fn only_rule_equals_empty_list_declares_an_empty_file() {
        let p = Path::new("r.toml");
        assert!(!parse(p, "").unwrap().declares_empty);
        assert!(!parse(p, "# only a comment\n").unwrap().declares_empty);
        assert!(parse(p, "rule = []\n").unwrap().declares_empty);
        assert!(parse(p, "rule = []\n").unwrap().rules.is_empty());
    }

    #[test]
    fn parses_the_documented_format() {
        let rules = parse_toml(
            r#"
[[rule]]
tenant = "shop-a"
route = "create-order"
capacity = 200
refill_per_second = 100
"#,
        )
        .unwrap()
        .rules;
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].tenant.as_str(), "shop-a");
        assert_eq!(rules[0].limit.capacity.get(), 200);
    }

    #[test]
    fn limit_tables_and_tenant_wide_rules_parse() {
        let routes = [RouteId::parse("search").unwrap()];
        let file = parse_for(
            Path::new("r.toml"),
            r#"
[[rule]]
tenant = "acme"
route = "search"
capacity = 20
refill_per_second = 10
[[rule.limit]]
quota = 10000
window = "day"

[[rule]]
tenant = "acme"
route = "*"
[[rule.limit]]
capacity = 100
refill_per_second = 50
[[rule.limit]]
quota = 30
window_seconds = 30
"#,
            &routes,
        )
        .unwrap();
        assert_eq!(file.rules[0].limits().count(), 2);
        assert!(file.rules[1].route.is_all());
        assert_eq!(file.rules[1].limit.capacity.get(), 100);
        assert_eq!(file.rules[1].limits().count(), 2);
    }

    #[test]
    fn more_than_eight_limits_in_force_together_are_refused() {
        let limits = |n: usize| "[[rule.limit]]\ncapacity = 5\nrefill_per_second = 1\n".repeat(n);
        let text = format!(
            "[[rule]]\ntenant='a'\nroute='*'\n{}[[rule]]\ntenant='a'\nroute='b'\n{}",
            limits(4),
            limits(5)
        );
        let RuleFileError::Invalid { problems, .. } = parse_toml(&text).unwrap_err() else {
            panic!("expected Invalid");
        };
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].starts_with("rule[0].limits: "), "{problems:?}");
        assert!(problems[1].starts_with("rule[1].limits: "), "{problems:?}");
    }

    #[test]
    fn a_rule_may_be_in_shadow_mode() {
        let parsed = |mode: &str| {
            parse_toml(&format!(
                "[[rule]]\ntenant='a'\nroute='b'\ncapacity=1\nrefill_per_second=1\n{mode}"
            ))
        };
        let shadow = parsed("mode = 'shadow'\n").unwrap().rules;
        assert_eq!(shadow[0].limit.mode, super::super::model::Mode::Shadow);
        let RuleFileError::Invalid { problems, .. } = parsed("mode = 'dry'\n").unwrap_err() else {
            panic!("expected Invalid");
        };
        assert_eq!(
            problems,
            ["rule[0].mode: must be \"enforce\" or \"shadow\", found \"dry\""]
        );
    }

    #[test]
    fn an_empty_file_holds_no_rules() {
        assert!(parse_toml("").unwrap().rules.is_empty());
    }

    #[test]
    fn every_bad_entry_is_reported_and_nothing_applies() {
        let err = parse_toml(
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
        let err = parse_toml(
            "[[rule]]\ntenant='a'\nroute='b'\ncapacity=1\nrefill_per_second=1\nburst=3\n",
        )
        .unwrap_err();
        assert!(matches!(err, RuleFileError::Syntax { .. }), "{err}");
    }

    #[test]
    fn the_shipped_rules_file_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/rules.toml");
        assert!(!load(&path).unwrap().rules.is_empty());
    }
}
