//! The last good rule set, saved on local disk.
//!
//! Owns the snapshot file format. A gateway that starts while PostgreSQL is
//! down serves the rules it last saw instead of only the default rule. The
//! file is replaced atomically (write to a temporary file, then rename), so
//! a crash mid-write never leaves a torn snapshot.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::model::{Rule, RuleSet};
use super::spec::RuleSpec;

/// Why a snapshot could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The file could not be read (or does not exist).
    #[error("cannot read rule snapshot {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O failure.
        #[source]
        source: io::Error,
    },
    /// The file is not a snapshot.
    #[error("rule snapshot {path} is corrupt: {message}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// The file as stored.
#[derive(Serialize, Deserialize)]
struct SnapshotFile {
    /// Unix seconds when the rules were read from the database.
    loaded_at_unix: u64,
    /// Every rule.
    rules: Vec<RuleSpec>,
}

/// Writes `set` to `path` atomically, creating parent directories.
///
/// # Errors
/// When the file cannot be written.
pub fn save(path: &Path, set: &RuleSet) -> io::Result<()> {
    let file = SnapshotFile {
        loaded_at_unix: set.origin().loaded_at_unix,
        rules: set.rules().map(|r| RuleSpec::from(&r)).collect(),
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    // A name of its own per process and save, so gateways sharing a
    // directory never write the same temporary file.
    static SAVES: AtomicU64 = AtomicU64::new(0);
    let tmp = path.with_extension(format!(
        "{}.{}.tmp",
        std::process::id(),
        SAVES.fetch_add(1, Ordering::Relaxed)
    ));
    let mut out = std::fs::File::create(&tmp)?;
    out.write_all(&serde_json::to_vec(&file).map_err(io::Error::other)?)?;
    out.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Reads the rules saved at `path` and when they were loaded.
///
/// # Errors
/// [`SnapshotError`] when the file is missing, unreadable or corrupt.
pub fn load(path: &Path) -> Result<(Vec<Rule>, u64), SnapshotError> {
    let bytes = std::fs::read(path).map_err(|source| SnapshotError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let corrupt = |message: String| SnapshotError::Corrupt {
        path: path.to_path_buf(),
        message,
    };
    let file: SnapshotFile = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
    let rules = file
        .rules
        .into_iter()
        .enumerate()
        .map(|(i, saved)| {
            saved.validate().map_err(|problems| {
                let problems: Vec<_> = problems.iter().map(ToString::to_string).collect();
                corrupt(format!("rule {i}: {}", problems.join("; ")))
            })
        })
        .collect::<Result<_, SnapshotError>>()?;
    Ok((rules, file.loaded_at_unix))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{RouteId, TenantId};
    use crate::rules::model::{Limit, SnapshotOrigin};

    #[test]
    fn a_saved_snapshot_loads_back() {
        let dir = std::env::temp_dir().join(format!("tollgate-snap-{}", std::process::id()));
        let path = dir.join("nested/rules.json");
        let limit = Limit {
            shards: std::num::NonZeroU32::new(4).unwrap(),
            exact: true,
            mode: crate::rules::model::Mode::Shadow,
            ..Limit::new(
                std::num::NonZeroU32::new(7).unwrap(),
                std::num::NonZeroU32::new(3).unwrap(),
            )
        };
        let rule = Rule {
            tenant: TenantId::parse("t").unwrap(),
            route: RouteId::parse("r").unwrap(),
            limit,
            more: None,
            name: Some(crate::key::TenantName::parse("Tee").unwrap()),
        };
        let day = crate::rules::LimitKind::Quota {
            quota: std::num::NonZeroU32::new(1000).unwrap(),
            window: crate::rules::Window::Day,
        };
        let wide = Rule {
            route: RouteId::all(),
            limit: Limit::new(
                std::num::NonZeroU32::new(50).unwrap(),
                std::num::NonZeroU32::new(5).unwrap(),
            ),
            more: Some(std::sync::Arc::from([day])),
            ..rule.clone()
        };
        let origin = SnapshotOrigin {
            source: "database",
            loaded_at_unix: 1234,
        };
        let set = RuleSet::new(vec![rule.clone(), wide.clone()], limit, origin);
        save(&path, &set).unwrap();
        let (mut rules, at) = load(&path).unwrap();
        rules.sort_by_key(|r| r.route.to_string());
        assert_eq!((rules, at), (vec![wide, rule], 1234));
        std::fs::write(&path, b"{not json").unwrap();
        assert!(matches!(load(&path), Err(SnapshotError::Corrupt { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(load(&path), Err(SnapshotError::Read { .. })));
    }
}
