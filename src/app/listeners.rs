//! The sockets a gateway serves on, bound before anything starts so that a
//! taken port fails the start (and tests can bind port 0 and read the
//! address back).

use std::net::{SocketAddr, TcpListener};

use anyhow::Context as _;

use crate::config::Config;

/// The bound sockets a gateway serves on.
pub struct Listeners {
    /// Tenant traffic.
    pub proxy: TcpListener,
    /// `/live`, `/ready`, `/metrics`.
    pub admin: TcpListener,
    /// Envoy's rate limit service, when `rls.listen` is set.
    pub rls: Option<TcpListener>,
    /// The HTTP check, when `check.listen` is set.
    pub check: Option<TcpListener>,
}

/// Binds `addr`, the value of the config key `key`.
fn bind(key: &str, addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).with_context(|| format!("cannot listen on {key} {addr}"))
}

impl Listeners {
    /// Binds every listener `config` asks for.
    ///
    /// # Errors
    /// When an address cannot be bound.
    pub fn bind(config: &Config) -> anyhow::Result<Self> {
        let server = &config.server;
        Ok(Self {
            proxy: bind("server.listen", server.listen)?,
            admin: bind("server.admin_listen", server.admin_listen)?,
            rls: config
                .rls
                .as_ref()
                .map(|r| bind("rls.listen", r.listen))
                .transpose()?,
            check: config
                .check
                .as_ref()
                .map(|c| bind("check.listen", c.listen))
                .transpose()?,
        })
    }

    /// The bound address of Envoy's rate limit service, when served.
    pub fn rls_addr(&self) -> Option<SocketAddr> {
        self.rls.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The bound address of the HTTP check, when served.
    pub fn check_addr(&self) -> Option<SocketAddr> {
        self.check.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The proxy's bound address.
    ///
    /// # Errors
    /// When the socket has no local address.
    pub fn proxy_addr(&self) -> std::io::Result<SocketAddr> {
        self.proxy.local_addr()
    }

    /// The admin listener's bound address.
    ///
    /// # Errors
    /// When the socket has no local address.
    pub fn admin_addr(&self) -> std::io::Result<SocketAddr> {
        self.admin.local_addr()
    }
}
