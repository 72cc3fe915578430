//! A throwaway Redis Cluster: three primaries (with replicas when asked),
//! created by `redis-cli --cluster create`, and where a key lives in it.

use std::process::Command;
use std::time::Duration;

use super::{Access, RedisServer, TempDir, output_from, wait_until};

/// A Redis Cluster on free ports (below 55536: a node's bus port is its
/// port + 10000), with a short node timeout so failures are noticed
/// quickly.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    _dir: TempDir,
}

impl RedisCluster {
    /// Three primaries, no replicas, a 1 s node timeout.
    pub fn start() -> Self {
        Self::start_shaped(0, &[], &Access::default())
    }

    /// Three primaries with `replicas` replicas each, every node reached
    /// as `access` says (over TLS, the cluster bus too) and started with
    /// `extra` arguments.
    pub fn start_shaped(replicas: usize, extra: &[&str], access: &Access) -> Self {
        let dir = TempDir::new("cluster");
        let nodes: Vec<RedisServer> = (0..3 * (1 + replicas))
            .map(|i| {
                let node_dir = dir.0.join(format!("node-{i}"));
                std::fs::create_dir_all(&node_dir).unwrap();
                let mut args: Vec<String> = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "1000",
                    "--dir",
                ]
                .map(String::from)
                .to_vec();
                args.push(node_dir.display().to_string());
                args.extend(extra.iter().map(|a| a.to_string()));
                if access.tls.is_some() {
                    args.extend(["--tls-cluster".into(), "yes".into()]);
                }
                loop {
                    let node = RedisServer::start_as(access.clone(), args.clone());
                    if node.port < 55_536 {
                        break node;
                    }
                }
            })
            .collect();
        // Bounded: redis-cli waits for ever for nodes that cannot meet.
        let mut create = Command::new("timeout");
        create
            .args(["30", "redis-cli"])
            .args(access.cli_args())
            .arg("--cluster")
            .arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let out = output_from(
            "redis-tools",
            create.args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"]),
        );
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes, _dir: dir };
        cluster.wait_healthy();
        if replicas > 0 {
            assert!(
                wait_until(Duration::from_secs(20), || cluster
                    .nodes
                    .iter()
                    .filter(|n| !n.is_primary())
                    .all(|n| n
                        .cmd(&["INFO", "replication"])
                        .contains("master_link_status:up"))),
                "the replicas did not sync"
            );
        }
        cluster
    }

    /// Seeds for `redis.cluster_nodes` (`rediss://` URLs over TLS).
    pub fn seeds(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| n.url().replace("redis://", ""))
            .collect()
    }

    /// Whether `key` exists on the node that owns it (the others answer
    /// MOVED).
    pub fn exists(&self, key: &str) -> bool {
        self.nodes.iter().any(|n| {
            n.try_cmd(&["EXISTS", key])
                .is_some_and(|r| matches!(r.trim(), ":1" | "1"))
        })
    }

    /// The index of the running primary that serves `key`'s slot.
    pub fn owner_of(&self, key: &str) -> Option<usize> {
        self.nodes.iter().position(|n| {
            n.is_primary()
                && n.try_cmd(&["GET", key])
                    .is_some_and(|r| !r.contains("MOVED"))
        })
    }

    /// Waits until every running node reports `cluster_state:ok`.
    pub fn wait_healthy(&self) {
        assert!(
            wait_until(Duration::from_secs(20), || self
                .nodes
                .iter()
                .filter(|n| n.ping())
                .all(|n| n
                    .try_cmd(&["CLUSTER", "INFO"])
                    .is_some_and(|i| i.contains("cluster_state:ok")))),
            "the cluster did not become healthy"
        );
    }
}
