//! TLS material: the proxy listener's certificate, the trust placed in
//! `https://` upstreams, and the CA and client certificate of `rediss://`
//! connections.
//!
//! Owns reading PEM files, for configuration checks and for serving alike,
//! so that a file `check-config` accepts is one the gateway can load. The
//! listener's certificate and key are read again every reload period; a
//! changed pair is installed for new handshakes only when both files parse
//! and the key belongs to the certificate, so a pair caught half-written
//! (or one file replaced before the other) keeps the certificate in use,
//! and connections already open are never touched.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Why TLS material could not be used.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {problem}")]
pub struct TlsError {
    /// The file at fault.
    path: PathBuf,
    /// What is wrong with it.
    problem: String,
}

impl TlsError {
    /// The file at fault.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `problem` with the file at `path`.
    fn new(path: &Path, problem: impl fmt::Display) -> Self {
        Self {
            path: path.to_owned(),
            problem: problem.to_string(),
        }
    }
}

/// The process's crypto provider (ring).
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads `path` whole.
fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::new(path, e))
}

/// Every certificate in the PEM text `pem`, read from `path`; at least one.
fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::new(path, format!("not PEM certificates ({e})")))?;
    if certs.is_empty() {
        return Err(TlsError::new(path, "holds no PEM certificate"));
    }
    Ok(certs)
}

/// The certificate chain in the PEM text `cert` (from `cert_path`) with the
/// private key in the PEM text `key` (from `key_path`), checked to belong
/// together.
fn certified_key(
    (cert_path, cert): (&Path, &[u8]),
    (key_path, key): (&Path, &[u8]),
) -> Result<CertifiedKey, TlsError> {
    let chain = certificates(cert_path, cert)?;
    let key = private_key(key_path, key)?;
    CertifiedKey::from_der(chain, key, &provider()).map_err(|e| {
        TlsError::new(
            key_path,
            format!("not the key of {}: {e}", cert_path.display()),
        )
    })
}

/// The private key in the PEM text `pem`, read from `path`.
fn private_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem)
        .map_err(|e| TlsError::new(path, format!("no PEM private key ({e})")))
}

/// A client configuration trusting `roots` (named `source` in errors),
/// with the provider's safe protocol versions; its client certificate
/// still to be chosen.
fn client_config(
    roots: RootCertStore,
    source: &Path,
) -> Result<rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert>, TlsError> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::new(source, e))?
        .with_root_certificates(roots))
}

/// Checks that `cert` and `key` hold a certificate chain and its private
/// key, as the listener would load them.
///
/// # Errors
/// When a file cannot be read, is not PEM, or the key does not match.
pub fn check_listener_files(cert: &Path, key: &Path) -> Result<(), TlsError> {
    certified_key((cert, &read(cert)?), (key, &read(key)?)).map(drop)
}

/// Checks that `ca_file`, when given, holds certificates trusted for
/// upstreams, and that some roots are trusted.
///
/// # Errors
/// As [`UpstreamTls::new`].
pub fn check_ca_file(ca_file: Option<&Path>) -> Result<(), TlsError> {
    roots(ca_file).map(drop)
}

/// The CA and client certificate for `rediss://` connections: `ca_file`'s
/// certificates trusted instead of the system's roots, and a client
/// certificate chain with its key for mutual TLS; `None` when neither is
/// set (the system's roots, no client certificate).
///
/// # Errors
/// When a file cannot be read, holds no usable certificate, or the key
/// does not belong to the client certificate.
pub fn redis_certificates(
    ca_file: Option<&Path>,
    client: Option<(&Path, &Path)>,
) -> Result<Option<redis::TlsCertificates>, TlsError> {
    if ca_file.is_none() && client.is_none() {
        return Ok(None);
    }
    let root_cert = match ca_file {
        Some(path) => {
            let pem = read(path)?;
            roots_from(path, &pem)?;
            Some(pem)
        }
        None => None,
    };
    let client_tls = match client {
        Some((cert_path, key_path)) => {
            let (cert, key) = (read(cert_path)?, read(key_path)?);
            certified_key((cert_path, &cert), (key_path, &key))?;
            Some(redis::ClientTlsConfig {
                client_cert: cert,
                client_key: key,
            })
        }
        None => None,
    };
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// TLS for tollgate's own Redis connections, from what
/// [`redis_certificates`] read: its CA certificates trusted instead of the
/// system's roots, and its client certificate presented, as the redis
/// crate's connections do.
///
/// # Errors
/// When the certificates do not build a client configuration (they were
/// checked when read, so only a provider that refuses them).
pub fn redis_connector(certs: Option<&redis::TlsCertificates>) -> Result<TlsConnector, TlsError> {
    let ca = Path::new("redis.ca_file");
    let roots = match certs.and_then(|c| c.root_cert.as_deref()) {
        Some(pem) => roots_from(ca, pem)?,
        None => roots(None)?,
    };
    let builder = client_config(roots, ca)?;
    let config = match certs.and_then(|c| c.client_tls.as_ref()) {
        Some(client) => {
            let cert = Path::new("redis.tls_cert_file");
            let key = private_key(Path::new("redis.tls_key_file"), &client.client_key)?;
            builder
                .with_client_auth_cert(certificates(cert, &client.client_cert)?, key)
                .map_err(|e| TlsError::new(cert, e))?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(TlsConnector::from(Arc::new(config)))
}

/// The roots trusted for upstreams: those in `ca_file` alone when given,
/// else the system's.
fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, TlsError> {
    match ca_file {
        Some(path) => roots_from(path, &read(path)?),
        None => trusted(
            Path::new("the system's trusted certificates"),
            rustls_native_certs::load_native_certs().certs,
        ),
    }
}

/// The CA certificates in the PEM text `pem`, read from `path`.
fn roots_from(path: &Path, pem: &[u8]) -> Result<RootCertStore, TlsError> {
    trusted(path, certificates(path, pem)?)
}

/// A root store of `certs` (from `source`); at least one must be usable.
fn trusted(source: &Path, certs: Vec<CertificateDer<'static>>) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(TlsError::new(source, "no usable CA certificate"));
    }
    Ok(roots)
}

/// The contents of the listener's two files as last read.
#[derive(Default, PartialEq, Eq)]
struct Seen {
    /// The certificate file.
    cert: Vec<u8>,
    /// The key file.
    key: Vec<u8>,
}

/// The certificate handshakes get: the latest pair that loaded.
#[derive(Debug)]
struct Current(ArcSwap<CertifiedKey>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

/// What a reload did.
#[derive(Debug, PartialEq, Eq)]
pub enum Reload {
    /// The files are as last read.
    Unchanged,
    /// A new certificate serves new handshakes.
    Installed,
    /// The files changed but do not load; the certificate in use stays.
    Kept(String),
}

/// The proxy listener's TLS: its certificate, reloaded from its files,
/// and the protocols it offers (HTTP/2, then HTTP/1.1, by ALPN).
pub struct ListenerTls {
    /// The certificate file.
    cert: PathBuf,
    /// The key file.
    key: PathBuf,
    /// What handshakes are served with.
    current: Arc<Current>,
    /// The files' contents when last read.
    seen: Mutex<Seen>,
    /// Handshakes with the current certificate.
    acceptor: TlsAcceptor,
}

impl fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ListenerTls")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl ListenerTls {
    /// Loads the certificate chain in `cert` and its private key in `key`
    /// (PEM).
    ///
    /// # Errors
    /// As [`check_listener_files`].
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let seen = Seen {
            cert: read(cert)?,
            key: read(key)?,
        };
        let loaded = certified_key((cert, &seen.cert), (key, &seen.key))?;
        let current = Arc::new(Current(ArcSwap::from_pointee(loaded)));
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::new(cert, e))?
            .with_no_client_auth()
            .with_cert_resolver(current.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Self {
            cert: cert.to_owned(),
            key: key.to_owned(),
            current,
            seen: Mutex::new(seen),
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// Handshakes with the certificate in use at the time of each.
    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// Reads the files again and installs them when they changed and load.
    pub fn reload(&self) -> Reload {
        let (cert, key) = match (read(&self.cert), read(&self.key)) {
            (Ok(cert), Ok(key)) => (cert, key),
            (Err(e), _) | (_, Err(e)) => return Reload::Kept(e.to_string()),
        };
        let read = Seen { cert, key };
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if *seen == read {
            return Reload::Unchanged;
        }
        let outcome = match certified_key((&self.cert, &read.cert), (&self.key, &read.key)) {
            Ok(loaded) => {
                self.current.0.store(Arc::new(loaded));
                Reload::Installed
            }
            Err(e) => Reload::Kept(e.to_string()),
        };
        *seen = read;
        outcome
    }

    /// Reloads every `period` on the current runtime, logging each change,
    /// until the runtime stops. The files are read on a blocking thread, so
    /// a file system that pauses (a stalled network mount) holds up only
    /// the reload, never the runtime's other tasks.
    pub fn watch(self: Arc<Self>, period: Duration) {
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(period);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let this = self.clone();
                let Ok(reloaded) = tokio::task::spawn_blocking(move || this.reload()).await else {
                    continue;
                };
                match reloaded {
                    Reload::Unchanged => {}
                    Reload::Installed => tracing::info!(
                        cert = %self.cert.display(),
                        "The listener's certificate changed; new connections get it."
                    ),
                    Reload::Kept(problem) => tracing::warn!(
                        %problem,
                        "The listener's certificate files changed but do not load; the certificate in use stays."
                    ),
                }
            }
        });
    }
}

/// TLS to `https://` upstreams: certificates verified against the trusted
/// roots, the upstream's host name sent by SNI, HTTP/1.1 by ALPN.
#[derive(Clone)]
pub struct UpstreamTls(TlsConnector);

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UpstreamTls")
    }
}

impl UpstreamTls {
    /// Trusts the certificates in `ca_file` (PEM) when given, else the
    /// system's.
    ///
    /// # Errors
    /// When `ca_file` cannot be read or holds no certificate, or no system
    /// root is found.
    pub fn new(ca_file: Option<&Path>) -> Result<Self, TlsError> {
        let roots = roots(ca_file)?;
        let source = ca_file.unwrap_or(Path::new("tls"));
        let mut config = client_config(roots, source)?.with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self(TlsConnector::from(Arc::new(config))))
    }

    /// TLS to the upstream at `host`, whose certificate must carry that
    /// name.
    ///
    /// # Errors
    /// As [`server_name`].
    pub fn to(&self, host: &str) -> Result<UpstreamTlsTo, String> {
        Ok(UpstreamTlsTo {
            connector: self.0.clone(),
            name: server_name(host)?,
        })
    }
}

/// The name an upstream at `host` (a DNS name, or an address with IPv6 in
/// brackets) is verified against, and sent by SNI when it is a name.
///
/// # Errors
/// When `host` is neither a DNS name nor an address.
pub fn server_name(host: &str) -> Result<ServerName<'static>, String> {
    ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']'))
        .map(|name| name.to_owned())
        .map_err(|e| format!("{host:?} cannot be checked against a certificate: {e}"))
}

/// TLS to one upstream: the trust and the name, settled once.
#[derive(Clone)]
pub struct UpstreamTlsTo {
    /// Handshakes with the trusted roots.
    connector: TlsConnector,
    /// What the certificate must name.
    name: ServerName<'static>,
}

impl fmt::Debug for UpstreamTlsTo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTlsTo")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl UpstreamTlsTo {
    /// Opens TLS on `stream`.
    ///
    /// # Errors
    /// When the handshake fails, an untrusted or mismatched certificate
    /// included.
    pub async fn connect(
        &self,
        stream: tokio::net::TcpStream,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        self.connector.connect(self.name.clone(), stream).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate and key made with openssl in `dir`, named
    /// `name`.
    fn make_pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let (cert, key) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        let status = std::process::Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
            .args(["-subj", &format!("/CN={name}"), "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .stderr(std::process::Stdio::null())
            .status()
            .expect("openssl runs (apt-get install openssl)");
        assert!(status.success());
        (cert, key)
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tollgate-tls-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn a_changed_pair_is_installed_and_a_broken_one_is_kept_out() {
        let dir = temp_dir("reload");
        let (cert, key) = make_pair(&dir, "first");
        let tls = ListenerTls::load(&cert, &key).expect("loads");
        let first = tls.current.0.load_full();
        assert_eq!(tls.reload(), Reload::Unchanged);

        // Half-written: the certificate is cut short.
        let pem = std::fs::read(&cert).expect("cert");
        std::fs::write(&cert, &pem[..pem.len() / 2]).expect("write");
        assert!(matches!(tls.reload(), Reload::Kept(_)));
        assert!(Arc::ptr_eq(&first, &tls.current.0.load_full()));

        // A new certificate before its key: they do not match.
        let (cert2, key2) = make_pair(&dir, "second");
        std::fs::copy(&cert2, &cert).expect("copy");
        match tls.reload() {
            Reload::Kept(problem) => assert!(problem.contains("not the key"), "{problem}"),
            other => panic!("a mismatched pair was {other:?}"),
        }
        assert!(Arc::ptr_eq(&first, &tls.current.0.load_full()));

        std::fs::copy(&key2, &key).expect("copy");
        assert_eq!(tls.reload(), Reload::Installed);
        let second = tls.current.0.load_full();
        assert_eq!(
            second.cert,
            certificates(&cert2, &pem_of(&cert2)).expect("certs")
        );
        assert_eq!(tls.reload(), Reload::Unchanged);
        std::fs::remove_dir_all(dir).ok();
    }

    fn pem_of(path: &Path) -> Vec<u8> {
        std::fs::read(path).expect("read")
    }

    #[test]
    fn bad_files_are_named_in_the_error() {
        let dir = temp_dir("bad");
        let (cert, key) = make_pair(&dir, "only");
        let missing = dir.join("missing.pem");
        let err = check_listener_files(&missing, &key).expect_err("missing");
        assert!(err.to_string().contains("missing.pem"), "{err}");
        let err = check_listener_files(&key, &key).expect_err("a key is no certificate");
        assert!(err.to_string().contains("no PEM certificate"), "{err}");
        let err = check_listener_files(&cert, &cert).expect_err("a certificate is no key");
        assert!(err.to_string().contains("no PEM private key"), "{err}");
        let err = check_ca_file(Some(&key)).expect_err("a key is no CA");
        assert!(err.to_string().contains("only.key"), "{err}");
        check_ca_file(Some(&cert)).expect("a self-signed certificate is a root");
        std::fs::remove_dir_all(dir).ok();
    }
}
