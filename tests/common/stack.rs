//! The sets most gateway tests start from: a Redis, the mock upstream, a
//! rules file and one gateway ([`Stack`]) or several ([`Fleet`]) in front
//! of them.

use super::{Gateway, GatewayConfig, RedisServer, TempDir, Upstream};

/// A Redis, the mock upstream, a rules file and one gateway in front of
/// them: the set most gateway tests need.
pub struct Stack {
    pub redis: RedisServer,
    pub up: Upstream,
    pub dir: TempDir,
    /// The gateway's config, to start more gateways like it.
    pub config: GatewayConfig,
    pub gw: Gateway,
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
/// them.
pub struct Fleet {
    pub redis: RedisServer,
    pub up: Upstream,
    pub dir: TempDir,
    pub gateways: Vec<Gateway>,
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
        let (redis, up, dir, config) = parts(tag, rules);
        let gateways = (0..n)
            .map(|i| {
                let mut config = config.clone();
                configure(i, &mut config, &dir);
                Gateway::start(&config)
            })
            .collect();
        Self {
            redis,
            up,
            dir,
            gateways,
        }
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
