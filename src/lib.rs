//! tollgate: a distributed, multi-region rate limiter for API gateways.
//!
//! # Map of the crate
//!
//! ```text
//!              X-Api-Key, method, path
//!   client ──▶ proxy (route → identify → limit → forward) ──▶ upstream
//!                          │            ▲
//!                 snapshot │            │ Decision
//!                          ▼            │
//!                 rules::RulesHandle   bucket::Limiter
//!                  (ArcSwap, written    ├─ bucket::redis  (EVALSHA lua/token_bucket.lua)
//!                   by the RuleCache    └─ bucket::local  (1/N fallback, local-only mode)
//!                   actor)
//!   admin listener: /live /ready /metrics (telemetry)
//! ```
//!
//! Layers, lowest first; a module uses only its own layer or lower ones:
//! 1. [`config`], [`clock`], [`key`], [`telemetry`], [`redis_client`]
//! 2. [`rules`], [`breaker`], [`cluster`], [`region`]
//! 3. [`bucket`]
//! 4. [`proxy`], [`admin`]
//! 5. [`app`], [`demo`]
//!
//! The binary (`src/main.rs`) only parses the command line and calls
//! [`app::run`] or [`demo::run`].

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
pub mod proxy;
pub mod redis_client;
pub mod region;
pub mod rules;
pub mod telemetry;
