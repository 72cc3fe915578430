//! tollgate: a distributed, multi-region rate limiter for API gateways.
//!
//! # Map of the crate
//!
//! ```text
//!              X-Api-Key, method, path        (HTTP/1.1, HTTP/2, TLS: tls)
//!   client ──▶ proxy::listen ──▶ proxy::entry: proxy | rls (gRPC) | check
//!                                  route → identify → limit → forward ──▶ proxy::upstream ──▶ upstream
//!                 │ snapshots           ▲ Verdict
//!                 ▼                     │
//!   rules::RulesHandle ── rule   bucket::Limiter (per worker, shared core)
//!   region::shares ────── share    ├─ bucket::lease     hot keys: leases, over-limit cache
//!                                  ├─ breaker gate      per primary (breaker actor drives it)
//!                                  ├─ bucket::coalesce  the worker's decision queue:
//!                                  │    decisions share EVALSHA lua/token_bucket.lua calls
//!                                  │    (bucket::redis over redis_client: one server,
//!                                  │    Sentinel or Cluster; TLS, ACL)
//!                                  └─ bucket::local     1/N fallback (N: cluster heartbeat)
//!   actors: RuleCache, share splitter, breaker prober, membership, rebalancer,
//!           topology watcher
//!   admin listener: /live /ready /metrics /admin/rules /admin/shares
//!   PostgreSQL: db (pool, migrations, LISTEN feeds, leader lock, rule and
//!               share stores) under RuleCache, splitter, rebalancer, admin
//! ```
//!
//! Layers, lowest first; a module uses only its own layer or lower ones:
//! 1. [`config`], [`clock`], [`key`], [`path`], [`json_body`], [`telemetry`],
//!    [`tls`]
//! 2. [`db`], [`rules`], [`breaker`], [`redis_client`], [`cluster`], [`region`]
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
pub mod db;
pub mod demo;
pub mod json_body;
pub mod key;
pub mod path;
pub mod proxy;
pub mod redis_client;
pub mod region;
pub mod rules;
pub mod telemetry;
pub mod tls;
