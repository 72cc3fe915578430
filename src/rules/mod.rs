//! Per-tenant rules: model, sources and the published cache.
//!
//! The request path only ever sees [`RulesHandle::snapshot`]; loading,
//! watching, following PostgreSQL and reloading happen in [`cache`], off
//! the request path.

pub mod cache;
pub mod feed;
pub mod file;
pub mod limits;
pub mod model;
pub mod pg;
pub mod snapshot;

pub use cache::{RulesError, RulesHandle};
pub use limits::{LimitKind, MAX_LIMITS, Window};
pub use model::{InForce, Limit, Rule, RuleSet};
pub use pg::{RuleStore, RuleStoreError, StoredRule};
