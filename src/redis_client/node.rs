//! How tollgate reaches any one Redis server of its deployment.
//!
//! Owns [`NodeAddr`] and [`Endpoints`]: the TLS material, credentials and
//! socket options every connection uses, read once from the files the
//! configuration names ([`Endpoints::load`], which `check-config` runs
//! too, so a file it accepts is one the gateway loads). A client for a
//! data node (the single server, a Cluster primary, the primary Sentinel
//! names) or for a sentinel is built from them for any address.
//!
//! Invariants: certificates are always verified, host names included
//! (against `redis.ca_file` when set, else the system's roots); secrets
//! never appear in a `Debug` or `Display` of anything here.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use redis::io::tcp::TcpSettings;
use redis::{
    ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo, TlsCertificates,
};

use tokio_rustls::TlsConnector;

use super::line::Connect;
use crate::config::{RedisCredentials, RedisSettings, RedisTarget, redact_url};
use crate::tls;

/// A Redis server's address as clients reach it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeAddr {
    /// Host name or IP address.
    pub host: Arc<str>,
    /// TCP port.
    pub port: u16,
}

impl NodeAddr {
    /// The address `host:port`.
    pub fn new(host: &str, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
        }
    }

    /// The TCP address of a parsed connection target.
    fn of(info: &ConnectionInfo) -> Option<Self> {
        match info.addr() {
            ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
                Some(Self::new(host, *port))
            }
            _ => None,
        }
    }
}

impl fmt::Display for NodeAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Why the Redis client cannot be set up; the message names the config
/// key at fault and never holds a secret.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {message}")]
pub struct SetupError {
    /// The config key.
    pub key: &'static str,
    /// What is wrong.
    pub message: String,
}

impl SetupError {
    fn new(key: &'static str, message: impl Into<String>) -> Self {
        Self {
            key,
            message: message.into(),
        }
    }
}

/// How one kind of server (data nodes, or sentinels) is spoken to.
#[derive(Clone)]
struct Profile {
    /// Whether connections use TLS.
    tls: bool,
    /// Database, user and password after the handshake.
    redis: RedisConnectionInfo,
}

/// What every connection of the deployment needs: TLS material,
/// credentials and socket options.
#[derive(Clone)]
pub(crate) struct Endpoints {
    /// The data nodes.
    data: Profile,
    /// The sentinels, when Sentinel is used.
    sentinel: Profile,
    /// The CA and client certificate, when files name them.
    certs: Option<TlsCertificates>,
    /// TLS for tollgate's own connections to the data nodes, when they
    /// are reached over TLS and it could be built.
    line_tls: Option<TlsConnector>,
    /// Socket options.
    tcp: TcpSettings,
}

impl fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoints")
            .field("tls", &self.data.tls)
            .field("username", &self.data.redis.username())
            .finish_non_exhaustive()
    }
}

/// Socket options of every Redis connection: `TCP_NODELAY`, so that a
/// call sent while another is in flight on the same multiplexed connection
/// leaves at once instead of waiting for the previous reply's ACK (Nagle).
fn tcp_settings() -> TcpSettings {
    TcpSettings::default().set_nodelay(true)
}

impl Endpoints {
    /// Reads the files `settings` name and checks the target's URLs as the
    /// client parses them; `None` in local-only mode.
    ///
    /// # Errors
    /// [`SetupError`] naming the key whose file cannot be read or used, or
    /// TLS files set for a target that is not `rediss://`.
    pub(crate) fn load(
        settings: &RedisSettings,
    ) -> Result<Option<(Self, Vec<ConnectionInfo>)>, SetupError> {
        let urls = settings.target.urls();
        if urls.is_empty() {
            return Ok(None);
        }
        let tls = settings.target.is_tls();
        if settings.tls.is_set() && !tls {
            return Err(SetupError::new(
                if settings.tls.ca_file.is_some() {
                    "redis.ca_file"
                } else {
                    "redis.tls_cert_file"
                },
                "is set, but Redis is not reached over TLS: use rediss:// URLs",
            ));
        }
        let infos = urls
            .iter()
            .map(|url| {
                url.as_str().into_connection_info().map_err(|e| {
                    SetupError::new(
                        "redis.url",
                        format!(
                            "{:?} is not a usable Redis URL ({})",
                            redact_url(url),
                            e.code().unwrap_or("invalid")
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let first = infos[0].redis_settings().clone();
        let sentinel = matches!(settings.target, RedisTarget::Sentinel { .. });
        let (data_base, sentinel_base) = if sentinel {
            // The sentinels' URLs carry their own credentials; the primary
            // is spoken to with `redis.username` / `redis.password_file`.
            (RedisConnectionInfo::default(), first)
        } else {
            (first, RedisConnectionInfo::default())
        };
        let certs = tls::redis_certificates(
            settings.tls.ca_file.as_deref(),
            settings
                .tls
                .client
                .as_ref()
                .map(|(cert, key)| (cert.as_path(), key.as_path())),
        )
        .map_err(|e| {
            let key = match &settings.tls.client {
                _ if Some(e.path()) == settings.tls.ca_file.as_deref() => "redis.ca_file",
                Some((_, key)) if e.path() == key => "redis.tls_key_file",
                _ => "redis.tls_cert_file",
            };
            SetupError::new(key, e.to_string())
        })?;
        if let Some(certs) = &certs {
            // The crate reads the files again, stricter than the check
            // above (every certificate of a CA bundle must parse): build one
            // client as every connection will, so a file it refuses fails
            // here, not at a worker's first call.
            let addr = address(&infos[0]).unwrap_or_else(|| NodeAddr::new("localhost", 6379));
            let probe = ConnectionAddr::TcpTls {
                host: addr.host.to_string(),
                port: addr.port,
                insecure: false,
                tls_params: None,
            };
            probe
                .into_connection_info()
                .and_then(|info| redis::Client::build_with_tls(info, certs.clone()))
                .map_err(|e| {
                    let key = if settings.tls.ca_file.is_some() {
                        "redis.ca_file"
                    } else {
                        "redis.tls_cert_file"
                    };
                    SetupError::new(
                        key,
                        // A certificate-parsing message; it holds no secret.
                        format!("the Redis client cannot use the TLS files: {e}"),
                    )
                })?;
        }
        // The files were checked above; what is left to fail (no system
        // roots without `redis.ca_file`) leaves script calls on the shared
        // connection, which reports its own failures, rather than failing
        // a configuration the shared connection accepts.
        let line_tls = tls
            .then(|| tls::redis_connector(certs.as_ref()).ok())
            .flatten();
        let endpoints = Self {
            data: Profile {
                tls,
                redis: with_credentials(data_base, &settings.credentials, "redis.password_file")?,
            },
            sentinel: Profile {
                tls,
                redis: with_credentials(
                    sentinel_base,
                    &settings.sentinel_credentials,
                    "redis.sentinel_password_file",
                )?,
            },
            certs,
            line_tls,
            tcp: tcp_settings(),
        };
        Ok(Some((endpoints, infos)))
    }

    /// A client for the data node at `addr`, in database `db`.
    ///
    /// # Errors
    /// When the TLS material does not build a client (checked at load).
    pub(crate) fn data_client(
        &self,
        addr: &NodeAddr,
        db: i64,
    ) -> redis::RedisResult<redis::Client> {
        let redis = self.data.redis.clone().set_db(db);
        self.client(
            addr,
            &Profile {
                redis,
                ..self.data.clone()
            },
        )
    }

    /// How tollgate's own connections to the data node at `addr` are
    /// opened, in database `db`, each within `timeout`: as
    /// [`Endpoints::data_client`]'s are. `None` when they cannot be: TLS
    /// that could not be built, or a host that cannot be checked against
    /// a certificate.
    pub(crate) fn line(&self, addr: &NodeAddr, db: i64, timeout: Duration) -> Option<Connect> {
        let tls = if self.data.tls {
            let connector = self.line_tls.clone()?;
            Some((connector, tls::server_name(&addr.host).ok()?))
        } else {
            None
        };
        let redis = &self.data.redis;
        Some(Connect {
            addr: addr.clone(),
            tls,
            auth: redis
                .password()
                .map(|password| (redis.username().map(str::to_owned), password.to_owned())),
            db,
            timeout,
        })
    }

    /// A client for the sentinel at `addr`.
    ///
    /// # Errors
    /// As [`Endpoints::data_client`].
    pub(crate) fn sentinel_client(&self, addr: &NodeAddr) -> redis::RedisResult<redis::Client> {
        self.client(addr, &self.sentinel)
    }

    /// The handshake settings of the data nodes (for Sentinel's check of
    /// the primary it names).
    pub(crate) fn data_settings(&self) -> (bool, RedisConnectionInfo) {
        (self.data.tls, self.data.redis.clone())
    }

    /// The CA and client certificate, when set.
    pub(crate) fn certificates(&self) -> Option<&TlsCertificates> {
        self.certs.as_ref()
    }

    /// A client for `addr` spoken to as `profile` says.
    fn client(&self, addr: &NodeAddr, profile: &Profile) -> redis::RedisResult<redis::Client> {
        let target = if profile.tls {
            ConnectionAddr::TcpTls {
                host: addr.host.to_string(),
                port: addr.port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(addr.host.to_string(), addr.port)
        };
        let info = target
            .into_connection_info()?
            .set_redis_settings(profile.redis.clone())
            .set_tcp_settings(self.tcp.clone());
        match (&self.certs, profile.tls) {
            (Some(certs), true) => redis::Client::build_with_tls(info, certs.clone()),
            _ => redis::Client::open(info),
        }
    }
}

/// The address of a parsed target, when it is a TCP one.
pub(crate) fn address(info: &ConnectionInfo) -> Option<NodeAddr> {
    NodeAddr::of(info)
}

/// `base` with the user name and password `credentials` give (a password
/// file's first line), which win over the URL's.
fn with_credentials(
    base: RedisConnectionInfo,
    credentials: &RedisCredentials,
    password_key: &'static str,
) -> Result<RedisConnectionInfo, SetupError> {
    let mut info = base.set_skip_set_lib_name();
    if let Some(user) = &credentials.username {
        info = info.set_username(user);
    }
    if let Some(path) = &credentials.password_file {
        info =
            info.set_password(read_password(path).map_err(|m| SetupError::new(password_key, m))?);
    }
    Ok(info)
}

/// The first line of the password file at `path`.
fn read_password(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let line = text.lines().next().unwrap_or("");
    if line.is_empty() {
        return Err(format!(
            "{} holds no password on its first line",
            path.display()
        ));
    }
    Ok(line.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_hosts_are_bracketed() {
        assert_eq!(NodeAddr::new("::1", 6379).to_string(), "[::1]:6379");
        assert_eq!(NodeAddr::new("cache", 6380).to_string(), "cache:6380");
    }

    #[test]
    fn a_password_file_gives_its_first_line_and_an_empty_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("tollgate-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        std::fs::write(&file, "s3cret\n").unwrap();
        assert_eq!(read_password(&file).unwrap(), "s3cret");
        std::fs::write(&file, "\nrest").unwrap();
        let err = read_password(&file).unwrap_err();
        assert!(err.contains("no password"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(read_password(&file).unwrap_err().contains("cannot read"));
    }
}
