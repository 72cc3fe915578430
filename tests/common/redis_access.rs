//! How the test Redis deployments are reached: plain or over TLS, as the
//! default user or an ACL user; the server and `redis-cli` arguments that
//! follow, and one command sent as a client would.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::output_from;

/// TLS for a test server: its certificate, the CA clients are checked
/// against, and whether clients must show a certificate.
#[derive(Clone, Debug)]
pub struct TlsAccess {
    /// The CA that signed the server's certificate (and clients').
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub server: (PathBuf, PathBuf),
    /// A client certificate and key, for redis-cli and for mutual TLS.
    pub client: (PathBuf, PathBuf),
    /// Whether the server requires a client certificate.
    pub require_client_cert: bool,
}

/// How a test server is reached: plain or TLS, as the default user or
/// an ACL user.
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// TLS, when the server speaks only TLS.
    pub tls: Option<TlsAccess>,
    /// An ACL user and password (the `default` user is then disabled).
    pub user: Option<(String, String)>,
}

impl Access {
    /// The server arguments this access needs, for a server on `port`.
    pub(super) fn server_args(&self, port: u16) -> Vec<String> {
        let mut args = match &self.tls {
            None => vec!["--port".into(), port.to_string()],
            Some(tls) => vec![
                "--port".into(),
                "0".into(),
                "--tls-port".into(),
                port.to_string(),
                "--tls-cert-file".into(),
                tls.server.0.display().to_string(),
                "--tls-key-file".into(),
                tls.server.1.display().to_string(),
                "--tls-ca-cert-file".into(),
                tls.ca.display().to_string(),
                "--tls-auth-clients".into(),
                if tls.require_client_cert { "yes" } else { "no" }.into(),
                "--tls-replication".into(),
                "yes".into(),
            ],
        };
        if let Some((user, password)) = &self.user {
            args.extend([
                "--user".into(),
                "default".into(),
                "off".into(),
                "--user".into(),
                user.clone(),
                "on".into(),
                format!(">{password}"),
                "~*".into(),
                "&*".into(),
                "+@all".into(),
            ]);
        }
        args
    }

    /// `redis-cli` arguments for this access.
    pub(super) fn cli_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(tls) = &self.tls {
            args.extend([
                "--tls".into(),
                "--cacert".into(),
                tls.ca.display().to_string(),
                "--cert".into(),
                tls.client.0.display().to_string(),
                "--key".into(),
                tls.client.1.display().to_string(),
            ]);
        }
        if let Some((user, password)) = &self.user {
            args.extend([
                "--user".into(),
                user.clone(),
                "--pass".into(),
                password.clone(),
                "--no-auth-warning".into(),
            ]);
        }
        args
    }
}

/// One command to the server on `port` reached as `access` says: raw RESP
/// over plain TCP for a plain server without a user, else `redis-cli`'s
/// text. `None` when it cannot be reached or the command fails.
pub(super) fn cli(port: u16, access: &Access, args: &[&str]) -> Option<String> {
    if access.tls.is_none() && access.user.is_none() {
        return resp_command(port, args);
    }
    let out = output_from(
        "redis-tools",
        Command::new("redis-cli")
            .args(access.cli_args())
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(args)
            .stdin(Stdio::null()),
    );
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Sends one command over plain TCP (no client library involved).
fn resp_command(port: u16, args: &[&str]) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut request = format!("*{}\r\n", args.len());
    for a in args {
        request.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    stream.write_all(request.as_bytes()).ok()?;
    let mut buf = vec![0u8; 64 * 1024];
    let n = stream.read(&mut buf).ok()?;
    let mut reply = String::from_utf8_lossy(&buf[..n]).into_owned();
    // A bulk reply may arrive in several reads.
    if let Some(len) = reply
        .strip_prefix('$')
        .and_then(|r| r.split("\r\n").next()?.parse::<usize>().ok())
    {
        while reply.len() < len + 8 {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => reply.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
    }
    Some(reply)
}
