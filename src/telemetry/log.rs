//! Log setup: the subscriber and its filter.

/// The filter for a configured level: a bare level (`info`, `debug`)
/// applies to tollgate while other crates stay at `warn`; anything else is a
/// full `tracing` filter used as written.
pub fn log_filter(level: &str) -> String {
    let bare = ["error", "warn", "info", "debug", "trace", "off"];
    if bare.contains(&level.trim()) {
        format!("warn,tollgate={}", level.trim())
    } else {
        level.to_owned()
    }
}

/// Starts the log subscriber. `RUST_LOG`, when set, wins over `level`.
///
/// # Errors
/// When a subscriber is already installed or the filter is invalid.
pub fn init_tracing(level: &str) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(from_env) if !from_env.is_empty() => tracing_subscriber::EnvFilter::try_new(from_env)?,
        _ => tracing_subscriber::EnvFilter::try_new(log_filter(level))?,
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .try_init()
        .map_err(|e| anyhow::anyhow!(e))
}
