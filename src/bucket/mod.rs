//! Token buckets: the arithmetic, the Redis script client, the local
//! limiter, and the hot-path [`Limiter`] that combines them.

pub mod decision;
pub mod keymap;
pub mod lease;
pub mod limiter;
pub mod local;
pub mod redis;
pub mod shard;
pub mod tokens;

pub use decision::{BucketSpec, Decision};
pub use lease::HotKeys;
pub use limiter::{Limiter, LimiterCore, RedisState, Verdict};
pub use local::LocalBuckets;
pub use redis::{Ask, Grant, RedisBucket, WarmWorkers};
