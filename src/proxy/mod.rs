//! Everything between a client and an upstream: the gateway's listeners
//! and what they answer.
//!
//! The parts, each a folder or file:
//! - `listen` — serving connections: the worker threads and their accept
//!   loops, TLS, HTTP/1.1 and HTTP/2 with their deadlines and bounds,
//!   shutdown;
//! - `entry` — the three entry points a connection's requests come in
//!   by: the proxy (route, identify, limit, forward), Envoy's rate limit
//!   service (gRPC) and the HTTP check;
//! - `upstream` — the upstream side: pooled connections, forwarding,
//!   hop-by-hop headers;
//! - beside them what they share: the route table ([`route`]), the one
//!   decision step (`decide`) and the rate-limit headers it yields
//!   ([`headers`]), per-tenant slots for exchanges in flight (`slots`),
//!   request and response bodies (`body`) and the budget for bodies read
//!   whole (`budget`), a connection as its requests see it (`client`), worker-local
//!   wake-ups (`signal`),
//!   answers given before a body was read (`early`), the one mapping from
//!   a failure to an answer ([`error`]), the access log ([`access`]), and
//!   usage settled after the answer on a `usage_header` route (`usage`).

pub mod access;
pub mod error;
pub mod headers;
pub mod route;

mod body;
mod budget;
mod client;
mod decide;
mod early;
mod entry;
mod listen;
mod signal;
mod slots;
mod upstream;
mod usage;

pub use listen::{ProxyServer, Serving};
pub use upstream::Forwarder;

use std::rc::Rc;
use std::sync::Arc;

use hyper::header::HeaderName;

use crate::bucket::Limiter;
use crate::clock::SharedClock;
use crate::config::{CheckSettings, RlsSettings};
use crate::region::shares::SharesHandle;
use crate::rules::RulesHandle;
use crate::telemetry::{Metrics, RequestCounters};
use access::AccessLog;
use route::RouteTable;
use slots::Slots;

/// The header that identifies the tenant.
pub const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// State shared by every proxy worker.
pub struct ProxyState {
    /// Route table with per-route metrics.
    pub routes: RouteTable,
    /// Rules in force.
    pub rules: RulesHandle,
    /// This region's share of every limit.
    pub shares: SharesHandle,
    /// Series outside any route.
    pub metrics: Metrics,
    /// Requests by route, tenant and outcome.
    pub requests: Arc<RequestCounters>,
    /// Times upstream calls.
    pub clock: SharedClock,
    /// `[limits] shadow`: every rule in shadow mode.
    pub shadow: bool,
    /// The access log, when `log.access` is on.
    pub access: Option<AccessLog>,
    /// Envoy's rate limit service, when served.
    pub rls: Option<RlsSettings>,
    /// The HTTP check, when served.
    pub check: Option<CheckSettings>,
}

/// One proxy worker: the state every worker shares, and the worker's own
/// limiter (its bucket client), upstream connections and exchanges in
/// flight.
pub struct Worker {
    /// Shared by every worker.
    pub state: Arc<ProxyState>,
    /// Decides, through this worker's bucket client.
    pub limiter: Limiter,
    /// This worker's upstream connections.
    pub forwarder: Forwarder,
    /// This worker's exchanges in flight, per tenant.
    slots: Rc<Slots>,
}

impl Worker {
    /// A worker over `state`, deciding through `limiter`, forwarding
    /// through `forwarder`, with the in-flight bounds of `upstream`.
    pub fn new(
        state: Arc<ProxyState>,
        limiter: Limiter,
        forwarder: Forwarder,
        upstream: &crate::config::UpstreamSettings,
    ) -> Self {
        Self {
            state,
            limiter,
            forwarder,
            slots: Slots::new(upstream),
        }
    }
}
