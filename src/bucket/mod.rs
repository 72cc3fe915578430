//! Token buckets: the arithmetic, the shared store behind its seam
//! ([`SharedStore`], Redis in production), the local limiter, and the
//! hot-path [`Limiter`] that combines them.

pub mod coalesce;
pub mod decision;
pub mod keymap;
pub mod lease;
pub mod limiter;
pub mod local;
pub mod packed;
pub mod redis;
pub mod shard;
pub mod store;
pub mod tokens;

pub use coalesce::{CallLimits, Coalesced};
pub use decision::{Ask, BucketSpec, Decision, Grant, GroupLimit};
pub use lease::HotKeys;
pub use limiter::{
    GroupVerdict, LimitVerdict, Limiter, LimiterCore, RedisState, SlotHold, Verdict,
};
pub use local::LocalBuckets;
pub use redis::{RedisBucket, WarmWorkers};
pub use store::SharedStore;
