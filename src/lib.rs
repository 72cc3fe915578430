//! tollgate: a distributed, multi-region rate limiter for API gateways.
//!
//! # Map of the crate
//!
//! ```text
//!              X-Api-Key, method, path
//!   client ──▶ proxy (route → identify → limit → forward) ──▶ upstream
//!                 │ snapshots           ▲ Verdict
//!                 ▼                     │
//!   rules::RulesHandle ── rule   bucket::Limiter (per worker, shared core)
//!   region::shares ────── share    ├─ bucket::lease   hot keys: leases, over-limit cache
//!                                  ├─ breaker gate    (breaker actor drives it)
//!                                  ├─ bucket::redis   EVALSHA lua/token_bucket.lua
//!                                  └─ bucket::local   1/N fallback (N: cluster heartbeat)
//!   actors: RuleCache, share splitter, breaker prober, membership, rebalancer
//!   admin listener: /live /ready /metrics /admin/rules /admin/shares
//! ```
//!
//! Layers, lowest first; a module uses only its own layer or lower ones:
//! 1. [`config`], [`clock`], [`key`], [`path`], [`telemetry`]
//! 2. [`rules`], [`breaker`], [`redis_client`], [`cluster`], [`region`]
//! 3. [`bucket`]
//! 4. [`proxy`], [`admin`]
//! 5. [`app`], [`demo`]
//!
//! The binary (`src/main.rs`) only parses the command line and calls
//! [`app::run`], or [`demo::without_rules_file`] then [`demo::run`].

#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod breaker;
pub mod bucket;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod demo;
pub mod key;
pub mod path;
pub mod proxy;
pub mod redis_client;
pub mod region;
pub mod rules;
pub mod telemetry;
pub mod tls;
