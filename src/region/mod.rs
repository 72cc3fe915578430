//! Multi-region limits: region files, each region's share of every limit,
//! and the rebalancer that moves shares with traffic.
//!
//! Each region has its own Redis and holds a share of every limit, so no
//! request waits on another region. [`shares`] publishes this region's
//! shares for the request path; [`split`] is the pure arithmetic the
//! [`rebalancer`] applies from Prometheus demand.

pub mod model;
pub mod prom;
pub mod rebalancer;
pub mod shares;
pub mod split;
