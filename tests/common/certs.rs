//! Certificates for TLS tests, made by `openssl`: a CA and leaf
//! certificates it signs, for servers and clients.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `openssl` with `args` in `dir`; fails with how to install it when
/// missing.
pub fn openssl(args: &[&str], dir: &Path) {
    super::stdout_from(
        "openssl",
        Command::new("openssl").args(args).current_dir(dir),
    );
}

/// A test CA in `dir` (`ca.crt`, `ca.key`).
pub fn make_ca(dir: &Path) -> PathBuf {
    openssl(
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=tollgate test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ],
        dir,
    );
    dir.join("ca.crt")
}

/// A server certificate for the DNS name `host` signed by the CA in
/// `dir`: `<file>.crt`, `<file>.key`.
pub fn make_leaf(dir: &Path, file: &str, host: &str) -> (PathBuf, PathBuf) {
    make_signed(dir, file, host, &format!("DNS:{host}"), "serverAuth")
}

/// A certificate signed by the CA in `dir` (`<file>.crt`, `<file>.key`)
/// named `cn`, valid for the names `san` (`DNS:…,IP:…`) and the uses
/// `usage` (`serverAuth`, `clientAuth`).
pub fn make_signed(dir: &Path, file: &str, cn: &str, san: &str, usage: &str) -> (PathBuf, PathBuf) {
    let ext = dir.join(format!("{file}.ext"));
    std::fs::write(
        &ext,
        format!("subjectAltName={san}\nbasicConstraints=CA:FALSE\nextendedKeyUsage={usage}\n"),
    )
    .unwrap();
    let (key, csr, crt) = (
        format!("{file}.key"),
        format!("{file}.csr"),
        format!("{file}.crt"),
    );
    openssl(
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            &key,
            "-out",
            &csr,
        ],
        dir,
    );
    openssl(
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &crt,
            "-extfile",
            ext.to_str().unwrap(),
        ],
        dir,
    );
    (dir.join(crt), dir.join(key))
}

/// A CA with a server certificate for `localhost` and 127.0.0.1, a
/// client certificate, and a second CA that signed neither.
pub struct TestPki {
    /// The CA that signed both leaves.
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub server: (PathBuf, PathBuf),
    /// A client certificate and key (for mutual TLS).
    pub client: (PathBuf, PathBuf),
    /// A CA that signed nothing here.
    pub other_ca: PathBuf,
}

impl TestPki {
    /// Makes every file in `dir`.
    pub fn make(dir: &Path) -> Self {
        let other = dir.join("other");
        std::fs::create_dir_all(&other).unwrap();
        let other_ca = make_ca(&other);
        let ca = make_ca(dir);
        // Servers are clients of one another too (replication, the
        // cluster bus).
        let server = make_signed(
            dir,
            "server",
            "localhost",
            "DNS:localhost,IP:127.0.0.1",
            "serverAuth,clientAuth",
        );
        let client = make_signed(dir, "client", "tollgate", "DNS:tollgate", "clientAuth");
        Self {
            ca,
            server,
            client,
            other_ca,
        }
    }
}
