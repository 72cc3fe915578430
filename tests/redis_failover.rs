//! Failovers under load: a Redis Cluster with replicas whose primary is
//! killed, and a primary watched by Sentinel that is killed. Two gateways
//! share every limit (so a decision made locally shows the 1/N share in
//! `X-RateLimit-Limit`) while tenants send requests steadily through
//! both. Each test asserts: no answer but 200 or 429; the keys of other
//! primaries stay shared throughout; the lost keys are shared again
//! within seconds of the promotion; limits hold afterwards; and every
//! worker answers.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use common::{
    Fleet, Gateway, GatewayConfig, RedisCluster, RedisSentinel, RedisServer, TempDir, Upstream,
    client, eventually, get, header, ready,
};
use tollgate::clock::{Clock, SystemClock};

/// Every limit's capacity; a local decision shows half of it (N = 2).
const CAPACITY: u32 = 100;

/// One answer seen by the load.
#[derive(Debug, Clone)]
struct Sample {
    /// When it came back (ms on the test's clock).
    at_ms: u64,
    /// Which tenant asked.
    tenant: usize,
    /// Its status (0: no answer).
    status: u16,
    /// Whether the limit in force was the whole one (a shared decision).
    shared: bool,
}

/// Steady requests from every tenant through every gateway until stopped.
struct Load {
    samples: Rc<RefCell<Vec<Sample>>>,
    stop: Rc<Cell<bool>>,
    tasks: Vec<actix_web::rt::task::JoinHandle<()>>,
}

impl Load {
    fn start(gateways: &[Gateway], tenants: &[String], clock: &Arc<SystemClock>) -> Self {
        let samples = Rc::new(RefCell::new(Vec::new()));
        let stop = Rc::new(Cell::new(false));
        let mut tasks = Vec::new();
        for gw in gateways {
            for (index, tenant) in tenants.iter().enumerate() {
                let (url, tenant) = (gw.url("/load"), tenant.clone());
                let (samples, stop, clock) = (samples.clone(), stop.clone(), clock.clone());
                tasks.push(actix_web::rt::spawn(async move {
                    let c = client();
                    while !stop.get() {
                        let answer = c
                            .get(&url)
                            .insert_header(("x-api-key", tenant.as_str()))
                            .send()
                            .await;
                        let (status, shared) = match &answer {
                            Ok(res) => (
                                res.status().as_u16(),
                                header(res, "x-ratelimit-limit") == Some(CAPACITY.to_string()),
                            ),
                            Err(_) => (0, false),
                        };
                        samples.borrow_mut().push(Sample {
                            at_ms: clock.now_ms(),
                            tenant: index,
                            status,
                            shared,
                        });
                        actix_web::rt::time::sleep(Duration::from_millis(5)).await;
                    }
                }));
            }
        }
        Self {
            samples,
            stop,
            tasks,
        }
    }

    async fn finish(self) -> Vec<Sample> {
        self.stop.set(true);
        for task in self.tasks {
            task.await.unwrap();
        }
        self.samples.take()
    }
}

/// `probe`'s rule of 5 tokens at 1/s, for the check that limits hold.
const RULES: &str =
    "[[rule]]\ntenant = \"probe\"\nroute = \"api\"\ncapacity = 5\nrefill_per_second = 1\n";

/// Every other limit `CAPACITY` at 50/s, Redis calls bounded at 50 ms, a
/// breaker cooling down in 500 ms and heartbeats every 200 ms.
fn shared_limits(_: usize, config: &mut GatewayConfig, _: &TempDir) {
    config.redis_timeout_ms = 50;
    config.extra = format!(
        "[default_rule]\ncapacity = {CAPACITY}\nrefill_per_second = 50\n\
         [breaker]\ncooldown_ms = 500\n[instance]\nheartbeat_ms = 200\n"
    );
}

/// Two gateways sharing limits through a Sentinel-watched primary and its
/// replica, each seeing the other.
fn sentinel_fleet(tag: &str) -> Fleet<RedisSentinel> {
    let fleet = Fleet::on(RedisSentinel::start(), tag, 2, RULES, shared_limits);
    fleet.assert_all_live(Duration::from_secs(5));
    fleet
}

/// What held after the failover: the probe tenant's limit of 5 across
/// both gateways, and every worker answering on fresh connections with
/// shared decisions.
async fn limits_hold(gateways: &[Gateway]) {
    let clock = SystemClock::new();
    let mut admitted = 0;
    for i in 0..10 {
        let (status, _) = get(&gateways[i % 2].url("/after"), Some("probe")).await;
        assert!(status == 200 || status == 429, "status {status}");
        admitted += usize::from(status == 200);
    }
    // 5 tokens and the refill (1/s) while the requests ran; decisions of
    // each gateway's local half on top would show.
    let refilled = clock.now_ms() / 1000 + 1;
    assert!(
        (5..=5 + refilled).contains(&(admitted as u64)),
        "a limit of 5 admitted {admitted} in {} ms",
        clock.now_ms()
    );
    for gw in gateways {
        for n in 0..8 {
            // A fresh client: a new connection, on whichever worker takes it.
            let res = client()
                .get(gw.url("/fresh"))
                .insert_header(("x-api-key", format!("fresh-{n}")))
                .send()
                .await
                .expect("every worker answers");
            assert_eq!(res.status(), 200);
            assert_eq!(
                header(&res, "x-ratelimit-limit"),
                Some(CAPACITY.to_string())
            );
        }
    }
}

/// Every answer was 200 or 429.
fn no_errors(samples: &[Sample]) {
    let bad: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.status != 200 && s.status != 429)
        .collect();
    assert!(
        bad.is_empty(),
        "{} answers were not 200/429: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
}

/// The last local decision among `tenants`' samples (ms), if any.
fn last_local(samples: &[Sample], tenants: &[usize]) -> Option<u64> {
    samples
        .iter()
        .filter(|s| tenants.contains(&s.tenant) && !s.shared)
        .map(|s| s.at_ms)
        .max()
}

#[actix_web::test]
async fn a_cluster_primary_killed_under_load_fails_over_for_its_slots_alone() {
    // Each primary keeps serving its slots while another's are failed
    // over (with the default `yes`, Redis refuses every slot in between).
    let cluster = RedisCluster::start_shaped(
        1,
        &["--cluster-require-full-coverage", "no"],
        &Default::default(),
    );
    let mut fleet = Fleet::on(cluster, "cluster-failover", 2, RULES, |i, c, dir| {
        shared_limits(i, c, dir);
        // Long enough that a healthy primary's calls never time out while
        // the binary's other failovers load the machine (a killed
        // primary's calls fail at once, refused, whatever the timeout).
        c.redis_timeout_ms = 250;
    });
    fleet.assert_all_live(Duration::from_secs(5));
    let (gws, cluster) = (&fleet.gateways, &mut fleet.redis);
    // Tenants on every primary; the first primary is the victim.
    let primaries: Vec<usize> = (0..cluster.nodes.len())
        .filter(|&i| cluster.nodes[i].is_primary())
        .collect();
    assert_eq!(primaries.len(), 3);
    let victim = primaries[0];
    let (mut on_victim, mut elsewhere) = (Vec::new(), Vec::new());
    for n in 0.. {
        if on_victim.len() == 3 && elsewhere.len() == 6 {
            break;
        }
        let tenant = format!("c{n}");
        if cluster.owner_of(&format!("rl2:{{{tenant}}}:api")) == Some(victim) {
            if on_victim.len() < 3 {
                on_victim.push(tenant);
            }
        } else if elsewhere.len() < 6 {
            elsewhere.push(tenant);
        }
    }
    let tenants: Vec<String> = on_victim.into_iter().chain(elsewhere).collect();
    let (lost, kept): (Vec<usize>, Vec<usize>) = ((0..3).collect(), (3..9).collect());
    let replica = (0..cluster.nodes.len())
        .find(|&i| {
            cluster.nodes[i]
                .cmd(&["INFO", "replication"])
                .contains(&format!("master_port:{}", cluster.nodes[victim].port))
        })
        .expect("the victim has a replica");

    let clock = Arc::new(SystemClock::new());
    let load = Load::start(gws, &tenants, &clock);
    actix_web::rt::time::sleep(Duration::from_secs(1)).await;
    let killed_at = clock.now_ms();
    cluster.nodes[victim].kill();
    // While the replica is not yet promoted: this node's breaker only.
    let mut partial = serde_json::Value::Null;
    let mut promoted_at = None;
    for _ in 0..400 {
        actix_web::rt::time::sleep(Duration::from_millis(25)).await;
        let seen = ready(&gws[0]).await;
        if seen["redis"] == "partial" && partial.is_null() {
            partial = seen;
        }
        if promoted_at.is_none() && cluster.nodes[replica].is_primary() {
            promoted_at = Some(clock.now_ms());
        }
        if promoted_at.is_some_and(|t| clock.now_ms() > t + 6000) {
            break;
        }
    }
    let promoted_at = promoted_at.expect("the replica was promoted within 10 s");
    let samples = load.finish().await;

    no_errors(&samples);
    assert_eq!(partial["breaker"], "open", "{partial}");
    let victim_addr = format!("127.0.0.1:{}", cluster.nodes[victim].port);
    let nodes = partial["redis_topology"]["primaries"].as_array().unwrap();
    assert_eq!(nodes.len(), 3, "{partial}");
    for node in nodes {
        let open = node["address"] == victim_addr.as_str();
        assert_eq!(
            node["breaker"],
            if open { "open" } else { "closed" },
            "{partial}"
        );
    }
    let local_kept = samples
        .iter()
        .filter(|s| kept.contains(&s.tenant) && !s.shared)
        .count();
    let lost_samples: Vec<&Sample> = samples
        .iter()
        .filter(|s| lost.contains(&s.tenant))
        .collect();
    let local_lost = lost_samples.iter().filter(|s| !s.shared).count();
    assert_eq!(
        local_kept, 0,
        "the other primaries' keys stay shared throughout"
    );
    assert!(
        local_lost > 0,
        "the lost slots were decided locally for a while"
    );
    let back = last_local(&samples, &lost).unwrap();
    eprintln!(
        "cluster failover: killed at {killed_at} ms, promoted at {promoted_at} ms, \
         last local decision at {back} ms ({} ms after the promotion); \
         {local_lost} of {} lost-slot decisions local",
        back.saturating_sub(promoted_at),
        lost_samples.len()
    );
    assert!(
        back < promoted_at + 3000,
        "shared again {} ms after the promotion",
        back - promoted_at
    );
    let topology = ready(&gws[0]).await["redis_topology"].clone();
    assert_eq!(topology["failovers"], 1, "{topology}");
    assert!(
        topology["last_failover_unix"].as_u64().is_some(),
        "{topology}"
    );
    limits_hold(gws).await;
}

#[actix_web::test]
async fn a_primary_killed_under_load_is_followed_through_sentinel() {
    let mut fleet = sentinel_fleet("sentinel-failover");
    let (gws, deployment) = (&fleet.gateways, &mut fleet.redis);
    let first = ready(&gws[0]).await;
    assert_eq!(first["redis_topology"]["mode"], "sentinel", "{first}");
    let old_port = deployment.servers[0].port;
    assert_eq!(
        first["redis_topology"]["primaries"][0]["address"],
        format!("127.0.0.1:{old_port}").as_str()
    );
    let tenants: Vec<String> = (0..6).map(|n| format!("s{n}")).collect();
    let every: Vec<usize> = (0..tenants.len()).collect();

    let clock = Arc::new(SystemClock::new());
    let load = Load::start(gws, &tenants, &clock);
    actix_web::rt::time::sleep(Duration::from_secs(1)).await;
    let killed_at = clock.now_ms();
    deployment.servers[0].kill();
    let promoted = eventually(Duration::from_secs(15), || async {
        deployment.primary_port() == Some(deployment.servers[1].port)
    })
    .await;
    assert!(promoted, "Sentinel promoted the replica within 15 s");
    let promoted_at = clock.now_ms();
    // The load goes on for 5 s after the promotion.
    actix_web::rt::time::sleep(Duration::from_secs(5)).await;
    // The old primary comes back, empty: Sentinel makes it a replica. No
    // decision may be written to it.
    deployment.servers[0].restart();
    let before_restart_calls = deployment.servers[0].command_calls("evalsha");
    actix_web::rt::time::sleep(Duration::from_secs(3)).await;
    let samples = load.finish().await;

    no_errors(&samples);
    let local = samples.iter().filter(|s| !s.shared).count();
    assert!(local > 0, "decisions were local while no primary answered");
    let back = last_local(&samples, &every).unwrap();
    eprintln!(
        "sentinel failover: killed at {killed_at} ms, promoted at {promoted_at} ms, \
         last local decision at {back} ms ({} ms after the promotion); {local} of {} decisions local",
        back.saturating_sub(promoted_at),
        samples.len()
    );
    assert!(
        back < promoted_at + 3000,
        "shared again {} ms after the promotion",
        back - promoted_at
    );
    let after = ready(&gws[0]).await;
    let topology = &after["redis_topology"];
    assert_eq!(
        topology["primaries"][0]["address"],
        format!("127.0.0.1:{}", deployment.servers[1].port).as_str(),
        "{after}"
    );
    assert_eq!(topology["failovers"], 1, "{after}");
    assert_eq!(before_restart_calls, 0);
    assert_eq!(
        deployment.servers[0].command_calls("evalsha"),
        0,
        "nothing is written to the old primary"
    );
    let replica: &RedisServer = &deployment.servers[1];
    assert!(replica.is_primary());
    assert!(
        replica.command_calls("evalsha") > 0,
        "decisions reach the new primary"
    );
    limits_hold(gws).await;
}

#[actix_web::test]
async fn a_frozen_sentinel_does_not_keep_a_failover_from_being_followed() {
    let mut fleet = sentinel_fleet("sentinel-frozen");
    let (gws, deployment) = (&fleet.gateways, &mut fleet.redis);
    // The first sentinel listed freezes, connections open; the other two
    // still make a quorum and promote the replica.
    deployment.pause_sentinel(0);
    deployment.servers[0].kill();
    let new_primary = format!("127.0.0.1:{}", deployment.servers[1].port);
    // Every gateway must follow before the limits are checked across them:
    // one still deciding alone would add its local share.
    for gw in gws {
        let followed = eventually(Duration::from_secs(20), || async {
            get(&gw.url("/x"), Some("frozen")).await;
            let seen = ready(gw).await;
            seen["redis"] == "up"
                && seen["redis_topology"]["primaries"][0]["address"] == new_primary.as_str()
        })
        .await;
        assert!(followed, "{}", ready(gw).await);
    }
    limits_hold(gws).await;
}

#[actix_web::test]
async fn a_slot_moved_to_another_primary_is_followed_at_once() {
    let cluster = RedisCluster::start();
    let dir = TempDir::new("slot-moved");
    let up = Upstream::start();
    let mut config = GatewayConfig::new("", dir.file("rules.toml", ""), &up.url());
    config.cluster_nodes = cluster.seeds();
    let gw = Gateway::start(&config);
    let key = "rl2:{moved}:api";
    let slot = cluster.nodes[0].cmd(&["CLUSTER", "KEYSLOT", key]);
    let slot = slot.trim_start_matches(':').trim().to_owned();
    let from = cluster.owner_of(key).unwrap();
    let to = (from + 1) % 3;
    let id = |i: usize| {
        let reply = cluster.nodes[i].cmd(&["CLUSTER", "MYID"]);
        reply.lines().nth(1).unwrap().trim().to_owned()
    };
    let (from_id, to_id) = (id(from), id(to));
    // The slot holds no key yet: it moves at once, as resharding would
    // move it, while the gateway's slot table still names the old owner.
    cluster.nodes[to].cmd(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id]);
    cluster.nodes[from].cmd(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id]);
    for i in [to, from, 3 - from - to] {
        cluster.nodes[i].cmd(&["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]);
    }
    let fallback = "tollgate_fallback_decisions_total{outcome=\"allowed\"}";
    let before = common::metric(&gw, fallback).await.unwrap();
    assert_eq!(get(&gw.url("/x"), Some("moved")).await.0, 200);
    assert_eq!(cluster.owner_of(key), Some(to));
    assert!(cluster.exists(key), "decided on the new owner");
    let after = common::metric(&gw, fallback).await.unwrap();
    assert_eq!(after, before, "no decision was made locally");
}
