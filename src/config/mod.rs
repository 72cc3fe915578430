//! Gateway settings: the TOML file, environment overrides and validation.
//!
//! Owns everything between "bytes of a config file" and a checked
//! [`Config`]. Loading takes the file contents and an environment map as
//! arguments, so tests never touch the real process environment.
//!
//! Steps, each reporting every problem it finds before giving up:
//! 1. parse TOML;
//! 2. apply `TOLLGATE__<SECTION>__<KEY>` overrides (and
//!    `TOLLGATE__ROUTES__<n>__<KEY>` for route entries), typed by the schema;
//! 3. compare keys and value types with the schema (the serialized defaults),
//!    so every unknown key and wrong type is listed;
//! 4. validate values into typed settings (`settings.rs`).
//!
//! Invariant: a [`Config`] that exists is valid; nothing downstream re-checks it.

mod bucket_store;
mod entries;
mod proxying;
mod raw;
mod routes;
mod settings;
mod validate;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use toml::{Table, Value};

pub use bucket_store::redis_target;
use raw::{RawConfig, RawRoute};
pub use settings::unknown_route;
pub use settings::{
    AdminSettings, BreakerSettings, CheckSettings, ClientSettings, Config, FallbackSettings,
    InstanceSettings, LeaseSettings, LimitSettings, ListenerTlsFiles, LogFormat, LogSettings,
    MetricsSettings, Pace, RebalancerSettings, RedisCredentials, RedisSettings, RedisTarget,
    RedisTlsFiles, RlsSettings, RouteSpec, RuleSource, RulesSettings, ServerSettings,
    UpstreamSettings, UsageSpec,
};
pub use validate::database_url;

/// Prefix of environment variables that override config keys.
pub const ENV_PREFIX: &str = "TOLLGATE__";

/// One bad key or value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Where: a dotted key (`server.listen`, `routes[0].upstream`) or an
    /// environment variable name.
    pub key: String,
    /// What is wrong, for a human.
    pub message: String,
}

impl Problem {
    /// A problem at `key`.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file that was asked for.
        path: PathBuf,
        /// The I/O failure.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("config is not valid TOML: {0}")]
    Syntax(String),
    /// One or more keys are unknown, mistyped or out of range.
    #[error("{}", ProblemList(.0))]
    Invalid(Vec<Problem>),
}

impl ConfigError {
    /// Every individual problem, for printing one per line.
    pub fn problems(&self) -> Vec<String> {
        match self {
            Self::Invalid(list) => list.iter().map(ToString::to_string).collect(),
            other => vec![other.to_string()],
        }
    }
}

/// Display helper: "N problem(s) in the configuration: a; b; c".
struct ProblemList<'a>(&'a [Problem]);

impl fmt::Display for ProblemList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len();
        write!(
            f,
            "{n} problem{} in the configuration",
            if n == 1 { "" } else { "s" }
        )?;
        for p in self.0 {
            write!(f, "\n  {p}")?;
        }
        Ok(())
    }
}

/// `url` with the password of its user information replaced by `***`,
/// for logs and messages (`redis://:secret@h:6379` →
/// `redis://:***@h:6379`); a URL without one comes back unchanged.
pub fn redact_url(url: &str) -> std::borrow::Cow<'_, str> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.into();
    };
    // The user information ends at the last `@`: a password may hold a
    // raw `/`, `?`, `#` or `@`, and hiding a little too much beats
    // showing a secret.
    let Some(at) = rest.rfind('@') else {
        return url.into();
    };
    match rest[..at].split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***{}", &rest[at..]).into(),
        None => url.into(),
    }
}

/// The `TOLLGATE__*` variables of the running process.
pub fn process_env() -> BTreeMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX))
        .collect()
}

/// Reads and validates the config file at `path`, with `env` overrides.
///
/// # Errors
/// [`ConfigError`] listing everything wrong with the file.
pub fn load_file(path: &Path, env: &BTreeMap<String, String>) -> Result<Config, ConfigError> {
    let contents = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    load_in(&contents, env, path.parent())
}

/// Parses and validates `contents`, with `env` overrides; relative paths
/// are relative to the working directory.
///
/// # Errors
/// [`ConfigError`] listing everything wrong with the configuration.
pub fn load(contents: &str, env: &BTreeMap<String, String>) -> Result<Config, ConfigError> {
    load_in(contents, env, None)
}

/// As [`load`], relative paths (from the file, the environment or the
/// defaults) taken from `base` when given: the directory of the file
/// `contents` came from, so a gateway finds its files whatever directory
/// it is started in.
fn load_in(
    contents: &str,
    env: &BTreeMap<String, String>,
    base: Option<&Path>,
) -> Result<Config, ConfigError> {
    let mut table: Table = contents
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::Syntax(e.to_string()))?;
    let schema = Schema::new();
    let mut problems = Vec::new();
    apply_env(&mut table, env, &schema, &mut problems);
    // Shape problems are reported and their entries dropped, so that the
    // values of every other key are still validated: one run lists all.
    let shape_from = problems.len();
    schema.prune(&mut table, &mut problems);
    let pruned: Vec<String> = problems[shape_from..]
        .iter()
        .map(|p| p.key.clone())
        .collect();
    // A dropped entry falls back to its default, which must not be reported
    // a second time.
    let reported = |key: &str| {
        pruned.iter().any(|p| {
            key.strip_prefix(p.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
        })
    };
    let raw: RawConfig = match Value::Table(table).try_into::<RawConfig>() {
        Ok(mut raw) => {
            if let Some(base) = base.filter(|b| !b.as_os_str().is_empty()) {
                raw.rebase_paths(base);
            }
            raw
        }
        Err(e) => {
            let e: toml::de::Error = e;
            problems.push(Problem::new("config", e.to_string()));
            return Err(ConfigError::Invalid(problems));
        }
    };
    match validate::validate(raw) {
        Ok(config) if problems.is_empty() => Ok(config),
        Ok(_) => Err(ConfigError::Invalid(problems)),
        Err(values) => {
            problems.extend(values.into_iter().filter(|p| !reported(&p.key)));
            Err(ConfigError::Invalid(problems))
        }
    }
}

/// Keys and value types, taken from the serialized defaults.
struct Schema {
    /// Every section and key with its default value.
    root: Table,
    /// Keys of one `[[routes]]` entry.
    route: Table,
}

impl Schema {
    fn new() -> Self {
        // unwrap: serializing plain structs of strings, integers and string
        // arrays into TOML cannot fail.
        let root = Table::try_from(RawConfig::default()).expect("defaults serialize");
        let route = Table::try_from(RawRoute::default()).expect("defaults serialize");
        Self { root, route }
    }

    /// The default value at `section.key`, or at `routes[].key`.
    fn default_at(&self, section: &str, key: &str) -> Option<&Value> {
        if section == "routes" {
            self.route.get(key)
        } else {
            self.root.get(section)?.as_table()?.get(key)
        }
    }

    /// The keys of `section` (of a route, for `routes`); none for an
    /// unknown section.
    fn keys_of<'a>(&'a self, section: &str) -> impl Iterator<Item = &'a String> {
        let table = if section == "routes" {
            Some(&self.route)
        } else {
            self.root.get(section).and_then(Value::as_table)
        };
        table.into_iter().flat_map(Table::keys)
    }

    /// Reports every unknown key and wrongly typed value in `table` and
    /// removes it, leaving a table that deserializes.
    fn prune(&self, table: &mut Table, problems: &mut Vec<Problem>) {
        table.retain(|section, value| {
            if section == "routes" {
                let Some(routes) = value.as_array_mut() else {
                    problems.push(Problem::new(
                        "routes",
                        "must be an array of [[routes]] tables",
                    ));
                    return false;
                };
                for (i, route) in routes.iter_mut().enumerate() {
                    let path = format!("routes[{i}]");
                    match route.as_table_mut() {
                        Some(t) => prune_keys(t, &self.route, &path, problems),
                        None => {
                            problems.push(Problem::new(path, "must be a table"));
                            // An empty entry keeps the later ones' indices.
                            *route = Value::Table(Table::new());
                        }
                    }
                }
                return true;
            }
            match (
                self.root.get(section).and_then(Value::as_table),
                value.as_table_mut(),
            ) {
                (None, _) => problems.push(Problem::new(
                    section,
                    format!("unknown section{}", did_you_mean(section, self.root.keys())),
                )),
                (Some(_), None) => {
                    problems.push(Problem::new(section, "must be a [section] table"))
                }
                (Some(expected), Some(t)) => {
                    prune_keys(t, expected, section, problems);
                    return true;
                }
            }
            false
        });
    }
}

/// Reports and removes the keys of one table that are unknown to its
/// schema or hold a value of the wrong type.
fn prune_keys(table: &mut Table, schema: &Table, path: &str, problems: &mut Vec<Problem>) {
    table.retain(|key, value| {
        let at = format!("{path}.{key}");
        let problem = match schema.get(key) {
            None => Some(format!("unknown key{}", did_you_mean(key, schema.keys()))),
            Some(expected) => type_mismatch(value, expected),
        };
        match problem {
            Some(message) => {
                problems.push(Problem::new(at, message));
                false
            }
            None => true,
        }
    });
}

/// `; did you mean "<name>"?` for the candidate closest to `word` when it
/// is a likely typo (at most two edits away, and fewer edits than `word`
/// has characters), else nothing.
fn did_you_mean<S: AsRef<str>>(word: &str, candidates: impl IntoIterator<Item = S>) -> String {
    candidates
        .into_iter()
        .map(|c| (edit_distance(word, c.as_ref()), c))
        .filter(|(d, _)| *d <= 2 && *d < word.chars().count())
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| format!("; did you mean {:?}?", c.as_ref()))
        .unwrap_or_default()
}

/// Levenshtein distance: the fewest single-character insertions, deletions
/// and substitutions that turn `a` into `b`.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (diagonal + usize::from(ca != cb))
                .min(above + 1)
                .min(row[j] + 1);
            diagonal = above;
        }
    }
    row[b.len()]
}

/// Describes how `value` differs in type from `expected`, if it does.
fn type_mismatch(value: &Value, expected: &Value) -> Option<String> {
    let want = expected.type_str();
    if value.type_str() != want {
        return Some(format!(
            "expected {}, found {}",
            article(want),
            article(value.type_str())
        ));
    }
    if let Value::Array(items) = value {
        // Every array key in the schema is a list of strings.
        if let Some(bad) = items.iter().find(|v| !v.is_str()) {
            return Some(format!(
                "expected a list of strings, found {}",
                article(bad.type_str())
            ));
        }
    }
    None
}

/// "an integer", "a string", ...
fn article(kind: &str) -> String {
    let a = if kind.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    format!("{a} {kind}")
}

/// Applies every `TOLLGATE__…` variable to `table`, typed by the schema.
fn apply_env(
    table: &mut Table,
    env: &BTreeMap<String, String>,
    schema: &Schema,
    problems: &mut Vec<Problem>,
) {
    for (name, raw) in env {
        let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        let parts: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
        let (section, index, key) = match parts.as_slice() {
            [s, n, k] if s == "routes" => match n.parse::<usize>() {
                Ok(n) => (s.as_str(), Some(n), k.as_str()),
                Err(_) => {
                    problems.push(Problem::new(
                        name,
                        "route overrides look like TOLLGATE__ROUTES__<index>__<KEY>",
                    ));
                    continue;
                }
            },
            [s, k] if s != "routes" => (s.as_str(), None, k.as_str()),
            _ => {
                problems.push(Problem::new(name, "expected TOLLGATE__<SECTION>__<KEY>"));
                continue;
            }
        };
        let Some(expected) = schema.default_at(section, key) else {
            let hint = did_you_mean(
                &format!("{section}.{key}"),
                schema.keys_of(section).map(|k| format!("{section}.{k}")),
            );
            problems.push(Problem::new(
                name,
                format!("no config key {section}.{key}{hint}"),
            ));
            continue;
        };
        let value = match coerce(raw, expected) {
            Ok(v) => v,
            Err(message) => {
                problems.push(Problem::new(name, message));
                continue;
            }
        };
        let target = match index {
            None => table
                .entry(section)
                .or_insert_with(|| Value::Table(Table::new()))
                .as_table_mut(),
            Some(i) => table
                .get_mut("routes")
                .and_then(Value::as_array_mut)
                .and_then(|routes| routes.get_mut(i))
                .and_then(Value::as_table_mut),
        };
        match target {
            Some(t) => {
                t.insert(key.to_owned(), value);
            }
            None if index.is_some() => {
                problems.push(Problem::new(name, "no such [[routes]] entry in the file"));
            }
            None => problems.push(Problem::new(name, format!("[{section}] is not a table"))),
        }
    }
}

/// Turns an environment string into a TOML value of the expected type.
fn coerce(raw: &str, expected: &Value) -> Result<Value, String> {
    match expected {
        Value::Integer(_) => raw
            .trim()
            .parse::<i64>()
            .map(Value::Integer)
            .map_err(|_| format!("expected an integer, found {raw:?}")),
        Value::Boolean(_) => match raw.trim() {
            "true" => Ok(Value::Boolean(true)),
            "false" => Ok(Value::Boolean(false)),
            _ => Err(format!("expected true or false, found {raw:?}")),
        },
        Value::Array(_) => {
            let raw = raw.trim();
            if raw.starts_with('[') {
                format!("v = {raw}")
                    .parse::<Table>()
                    .ok()
                    .and_then(|mut t| t.remove("v"))
                    .ok_or_else(|| {
                        format!("expected a TOML list such as [\"a\", \"b\"], found {raw:?}")
                    })
            } else {
                let items = raw
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| Value::String(s.to_owned()))
                    .collect();
                Ok(Value::Array(items))
            }
        }
        _ => Ok(Value::String(raw.to_owned())),
    }
}

#[cfg(test)]
mod tests;
