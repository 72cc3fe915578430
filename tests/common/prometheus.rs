//! A real Prometheus server scraping gateways, and its query API.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use futures_util::StreamExt;
use tollgate::app::{self, Listeners};
use tollgate::clock::{Clock, SystemClock};
use tollgate::config;

use super::*;

/// A real Prometheus server scraping `targets` (admin port, region label)
/// every second; killed on drop.
pub struct PrometheusServer {
    pub port: u16,
    child: Option<KillOnDrop>,
}

impl PrometheusServer {
    /// Starts on `port` (chosen beforehand, so gateways can be told where
    /// it will be).
    pub fn start_on(dir: &TempDir, targets: &[(u16, &str)], port: u16) -> Self {
        let mut config = String::from(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: tollgate\n    static_configs:\n",
        );
        for (port, region) in targets {
            config.push_str(&format!(
                "      - targets: [\"127.0.0.1:{port}\"]\n        labels:\n          region: {region}\n"
            ));
        }
        let config = dir.file("prometheus.yml", &config);
        let child = KillOnDrop(spawn_from(
            "prometheus",
            Command::new("prometheus")
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.0.join("prometheus-data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        ));
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        assert!(
            wait_until(Duration::from_secs(20), || http_status(addr, "/-/ready")
                == Some(200)),
            "prometheus did not become ready"
        );
        Self {
            port,
            child: Some(child),
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops the server, as an outage would.
    pub fn stop(&mut self) {
        self.child = None;
    }

    /// Runs an instant query; returns the JSON answer.
    pub async fn query(&self, promql: &str) -> serde_json::Value {
        client()
            .get(format!("{}/api/v1/query", self.url()))
            .query(&[("query", promql)])
            .unwrap()
            .send()
            .await
            .expect("prometheus answers")
            .json()
            .limit(16 * 1024 * 1024)
            .await
            .expect("prometheus answers JSON")
    }
}
