//! The sets most gateway tests start from: a Redis, the mock upstream, a
//! rules file and one gateway ([`Stack`]) or several ([`Fleet`]) in front
//! of them.

use std::time::Duration;

use super::{
    Gateway, GatewayConfig, RedisCluster, RedisSentinel, RedisServer, SENTINEL_MASTER, TempDir,
    Upstream, raw_http, wait_until,
};

/// A Redis, the mock upstream, a rules file and one gateway in front of
/// them: the set most gateway tests need.
pub struct Stack {
    /// Declared first, so that it stops first, while what it uses runs.
    pub gw: Gateway,
    pub redis: RedisServer,
    pub up: Upstream,
    pub dir: TempDir,
    /// The gateway's config, to start more gateways like it.
    pub config: GatewayConfig,
}

impl Stack {
    /// Starts the set with `rules` as the rules file; `configure` adjusts
    /// the gateway's config (routes, default rule, timeouts) first, given
    /// the upstream's URL.
    pub fn start(tag: &str, rules: &str, configure: impl FnOnce(&mut GatewayConfig, &str)) -> Self {
        let (redis, up, dir, mut config) = parts(tag, rules);
        configure(&mut config, &up.url());
        let gw = Gateway::start(&config);
        Self {
            redis,
            up,
            dir,
            config,
            gw,
        }
    }
}

/// A Redis, the mock upstream, a rules file and several gateways sharing
/// them. The gateways stop first, while what they use still runs.
pub struct Fleet<R = RedisServer> {
    pub gateways: Vec<Gateway>,
    pub up: Upstream,
    pub dir: TempDir,
    /// The Redis deployment: a server of the fleet's own, or the one
    /// [`Fleet::on`] was given.
    pub redis: R,
}

impl Fleet {
    /// Starts `n` gateways with `rules` as their rules file; `configure`
    /// adjusts each one's config first, given its index and the directory
    /// the fleet's files live in.
    pub fn start(
        tag: &str,
        n: usize,
        rules: &str,
        configure: impl Fn(usize, &mut GatewayConfig, &TempDir),
    ) -> Self {
        Self::on(RedisServer::start(), tag, n, rules, configure)
    }
}

impl<R: Deployment> Fleet<R> {
    /// As [`Fleet::start`], on the Redis deployment the caller brings (kept in `redis`).
    pub fn on(
        redis: R,
        tag: &str,
        n: usize,
        rules: &str,
        configure: impl Fn(usize, &mut GatewayConfig, &TempDir),
    ) -> Self {
        let up = Upstream::start();
        let dir = TempDir::new(tag);
        let mut config = GatewayConfig::new("", dir.file("rules.toml", rules), &up.url());
        redis.aim(&mut config);
        let gateways = (0..n)
            .map(|i| {
                let mut config = config.clone();
                configure(i, &mut config, &dir);
                Gateway::start(&config)
            })
            .collect();
        Self {
            gateways,
            up,
            dir,
            redis,
        }
    }
}

impl<R> Fleet<R> {
    /// Fails unless each gateway's `/ready` counts the whole fleet live within `within`.
    pub fn assert_all_live(&self, within: Duration) {
        let n = self.gateways.len();
        for gw in &self.gateways {
            let ready = || {
                let res = raw_http(gw.admin, "GET /ready HTTP/1.1\r\nHost: t\r\n");
                serde_json::from_str::<serde_json::Value>(&res.body).unwrap_or_default()
            };
            assert!(
                wait_until(within, || ready()["live_instances"] == n),
                "the gateways did not see each other: {}",
                ready()
            );
        }
    }
}

/// A Redis deployment gateways can be pointed at.
pub trait Deployment {
    /// Points `config`'s `[redis]` at this deployment.
    fn aim(&self, config: &mut GatewayConfig);
}

impl Deployment for RedisServer {
    fn aim(&self, config: &mut GatewayConfig) {
        config.redis_url = self.url();
    }
}

impl Deployment for RedisCluster {
    fn aim(&self, config: &mut GatewayConfig) {
        config.redis_url = String::new();
        config.cluster_nodes = self.seeds();
    }
}

impl Deployment for RedisSentinel {
    fn aim(&self, config: &mut GatewayConfig) {
        config.redis_url = String::new();
        config.redis_extra.push_str(&format!(
            "sentinel_nodes = {:?}\nsentinel_master = \"{SENTINEL_MASTER}\"\n",
            self.nodes()
        ));
    }
}

/// A Redis, the mock upstream, a directory holding `rules` as its rules
/// file, and a gateway config in front of them.
fn parts(tag: &str, rules: &str) -> (RedisServer, Upstream, TempDir, GatewayConfig) {
    let redis = RedisServer::start();
    let up = Upstream::start();
    let dir = TempDir::new(tag);
    let config = GatewayConfig::new(&redis.url(), dir.file("rules.toml", rules), &up.url());
    (redis, up, dir, config)
}
