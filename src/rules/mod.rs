//! Per-tenant rules: model, sources and the published cache.
//!
//! The request path only ever sees [`RulesHandle::snapshot`]; loading,
//! watching, following PostgreSQL and reloading happen in [`cache`], off
//! the request path.

pub mod cache;
pub mod database;
pub mod file;
pub mod handle;
pub mod limits;
pub mod model;
pub mod snapshot;
pub mod spec;

pub use handle::{RulesError, RulesHandle};
pub use limits::{LimitKind, MAX_LIMITS, Window};
pub use model::{InForce, Limit, Rule, RuleSet};
