//! `lua/token_bucket.lua` against a real Redis: one value per bucket, refill,
//! expiry, its writes replicated as written, several keys in one call, the
//! same answers as format 1, NOSCRIPT reload, no replay after a timeout,
//! and charges: usage taken past zero (a debt later asks wait for) and
//! refunds.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::num::NonZeroU32;
use std::time::Duration;

use common::{RedisServer, wait_until};
use redis::AsyncCommands;
use tollgate::bucket::decision::{GroupLimit, Holder};
use tollgate::bucket::packed;
use tollgate::bucket::{Ask, BucketSpec, Decision, RedisBucket};
use tollgate::clock::{Clock, SystemClock};
use tollgate::config::{RedisSettings, RedisTarget};
use tollgate::redis_client::{NodeAddr, RedisCallError, RedisConn, RedisConnector, Reply};
use tollgate::rules::Window;
use tollgate::telemetry::{self, Metrics};

fn bucket(redis: &RedisServer, timeout: Duration) -> RedisBucket {
    let conn = connection(redis, timeout);
    RedisBucket::new(conn, timeout, Metrics::new(), SystemClock::shared())
}

/// A connection to `redis` whose calls are bounded by `timeout`.
fn connection(redis: &RedisServer, timeout: Duration) -> RedisConn {
    telemetry::install();
    let settings = RedisSettings {
        target: RedisTarget::Single(redis.url()),
        timeout,
        connect_timeout: Duration::from_secs(1),
        max_keys_per_call: 16,
        max_calls_in_flight: 1,
        credentials: Default::default(),
        sentinel_credentials: Default::default(),
        tls: Default::default(),
    };
    RedisConnector::new(&settings).unwrap().unwrap().connect()
}

/// A fresh Redis, and a bucket client on it with a 2 s timeout.
fn redis_and_bucket() -> (RedisServer, RedisBucket) {
    let redis = RedisServer::start();
    let b = bucket(&redis, Duration::from_secs(2));
    (redis, b)
}

/// The decision on taking `cost` tokens from `key`'s bucket.
async fn decide(b: &RedisBucket, key: &str, spec: &BucketSpec, cost: u32) -> Decision {
    b.take(key, spec, Ask::single(cost)).await.unwrap().decision
}

/// The decisions on taking one token from every limit of `group`.
async fn decide_group(b: &RedisBucket, group: &[(String, GroupLimit)]) -> Vec<Decision> {
    b.take_group(group, Ask::single(1)).await.unwrap().decisions
}

fn spec(capacity: u32, refill: u32) -> BucketSpec {
    BucketSpec::of(
        NonZeroU32::new(capacity).unwrap(),
        NonZeroU32::new(refill).unwrap(),
    )
}

/// The script's raw reply to `keys`, each with its arguments in `args`:
/// three (capacity or quota, rate or window, ask), or a short ask alone.
async fn eval<'a>(
    conn: &mut redis::aio::MultiplexedConnection,
    keys: &[&str],
    args: &[impl AsRef<[&'a str]>],
) -> Vec<i64> {
    let mut call = redis::cmd("EVAL");
    call.arg(include_str!("../lua/token_bucket.lua"))
        .arg(keys.len())
        .arg(keys);
    for key_args in args {
        call.arg(key_args.as_ref());
    }
    let reply: redis::Value = call.query_async(conn).await.unwrap();
    packed::integers(Reply::of_value(&reply)).expect("a reply of integers")
}

/// Redis's clock in microseconds since the Unix epoch.
async fn redis_now_us(conn: &mut redis::aio::MultiplexedConnection) -> f64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    (s * 1_000_000 + us) as f64
}

#[actix_web::test]
async fn first_call_fills_then_takes_and_stores_one_value_with_a_ttl() {
    let (redis, b) = redis_and_bucket();
    let d = decide(&b, "rl2:{t}:r", &spec(10, 2), 1).await;
    assert!(d.allowed);
    assert_eq!((d.remaining, d.retry_after_ms), (9, 0));

    let mut conn = redis.conn().await;
    let kind: String = redis::cmd("TYPE")
        .arg("rl2:{t}:r")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(kind, "string");
    // Full again in 1 token / 2 per s = 0.5 s from the take.
    let tat: f64 = conn
        .get::<_, String>("rl2:{t}:r")
        .await
        .unwrap()
        .parse()
        .unwrap();
    let ahead = tat - redis_now_us(&mut conn).await;
    assert!(
        (400_000.0..=500_000.0).contains(&ahead),
        "TAT {ahead} µs ahead"
    );
    // Expires 1.5 to 2 refill times (10/2 s) after it is full again.
    let ttl: i64 = conn.pttl("rl2:{t}:r").await.unwrap();
    assert!(
        (7_900..=10_500).contains(&ttl),
        "0.5 s + 1.5 to 2 × 5 s, got {ttl} ms"
    );
}

/// The absolute expiry (ms since the epoch) of `key`.
async fn expiry_at(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PEXPIRETIME")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap()
}

/// The absolute expiry (ms) the script gives a bucket whose TAT is `tat`
/// (µs) under a rule refilling an empty bucket in `fill` µs: the start of
/// the TAT's cell on a grid of `fill` / 2, plus 2 × `fill` (computed as
/// Lua computes it).
fn expiry_of(tat: f64, fill: f64) -> i64 {
    let cell = fill / 2.0;
    let lua_mod = tat - (tat / cell).floor() * cell;
    ((tat - lua_mod + 2.0 * fill) / 1000.0).ceil() as i64
}

#[actix_web::test]
async fn a_bucket_expires_by_its_tat_whether_a_write_keeps_its_expiry_or_sets_one() {
    let (redis, b) = redis_and_bucket();
    let mut conn = redis.conn().await;
    let key = "rl2:{grid}:r";
    // 100 tokens refilled in 50 s: cells of 25 s, each take of 4 tokens
    // moves the TAT by 2 s, so most writes stay in their cell (the expiry
    // is kept) and some cross into the next (it is set anew).
    let s = spec(100, 2);
    let mut expiries = Vec::new();
    for _ in 0..20 {
        assert!(decide(&b, key, &s, 4).await.allowed);
        let tat: f64 = conn.get::<_, String>(key).await.unwrap().parse().unwrap();
        let at = expiry_at(&mut conn, key).await;
        assert_eq!(at, expiry_of(tat, 50e6), "TAT {tat}");
        expiries.push(at);
    }
    expiries.dedup();
    assert!(
        (2..=3).contains(&expiries.len()),
        "40 s of TAT spans 2 or 3 cells: {expiries:?}"
    );
    // Only the new key was written whole: every later take added its step
    // in place, and one that crossed into another cell moved the expiry.
    let stats = redis.cmd(&["INFO", "commandstats"]);
    assert!(stats.contains("cmdstat_set:calls=1,"), "{stats}");
    assert!(stats.contains("cmdstat_incrby:calls=19,"), "{stats}");
    assert!(stats.contains("cmdstat_pexpireat:calls="), "{stats}");
}

#[actix_web::test]
async fn a_write_in_the_cell_adds_the_take_and_a_value_it_cannot_add_to_is_rewritten_whole() {
    let (redis, b) = redis_and_bucket();
    let mut conn = redis.conn().await;
    // 100 tokens refilled in 10 s: a token is 100,000 µs, cells are 5 s.
    let (s, fill) = (spec(100, 10), 10e6);
    // Half a token's time (a fraction, as an older build wrote) and the
    // exponent notation are numbers the script reads, but that INCRBY
    // refuses. The TAT lies 1.25 s into a half cell (1.25 or 3.75 s into
    // its cell), 3.75 to 6.25 s ahead, so the two takes below stay in it.
    let half_cell = fill / 4.0;
    let ahead = redis_now_us(&mut conn).await + 5e6;
    let tat = ahead - ahead % half_cell + 1_250_000.0;
    let keys = [
        ("rl2:{fraction}:r", format!("{}", tat + 0.5)),
        ("rl2:{exponent}:r", format!("{tat:e}")),
    ];
    for (key, stored) in keys {
        let _: () = conn.set(key, &stored).await.unwrap();
        let first = decide(&b, key, &s, 1).await;
        assert!(
            first.allowed && (25..=75).contains(&first.remaining),
            "{stored}: {first:?}"
        );
        let written: String = conn.get(key).await.unwrap();
        assert!(
            written.bytes().all(|b| b.is_ascii_digit()),
            "{stored} rewritten as a whole number, got {written}"
        );
        let tat: f64 = written.parse().unwrap();
        let at = expiry_at(&mut conn, key).await;
        assert_eq!(at, expiry_of(tat, fill), "{stored}: an expiry set anew");
        // The next take, in the same cell, adds one token's time exactly
        // and keeps the expiry. A token comes back every 100 ms, so the
        // time between the two takes may have refilled one: the count
        // left drops by one or stays.
        let d = decide(&b, key, &s, 1).await;
        assert!(
            d.allowed && (first.remaining - 1..=first.remaining).contains(&d.remaining),
            "{stored}: {d:?} after {first:?}"
        );
        let next: f64 = conn.get::<_, String>(key).await.unwrap().parse().unwrap();
        assert_eq!(next - tat, 100_000.0, "{stored}");
        let kept = expiry_at(&mut conn, key).await;
        assert_eq!(kept, at, "{stored}");
    }
}

#[actix_web::test]
async fn a_replica_holds_the_value_and_expiry_the_primary_wrote_by_set_incrby_and_pexpireat() {
    // No wait before the replica's first sync (Redis waits 5 s by default).
    let primary = RedisServer::start_with(vec!["--repl-diskless-sync-delay".into(), "0".into()]);
    let b = bucket(&primary, Duration::from_secs(2));
    let replica = RedisServer::start_with(vec![
        "--replicaof".into(),
        "127.0.0.1".into(),
        primary.port.to_string(),
    ]);
    assert!(
        wait_until(Duration::from_secs(10), || replica
            .cmd(&["INFO", "replication"])
            .contains("master_link_status:up")),
        "the replica syncs"
    );
    // A new key is written with SET … PXAT, the takes after it in its
    // cell (a token is 0.1 s, cells 5 s) add their step with INCRBY; then
    // a take of 50 moves the TAT 5 s, into the next cell, and its expiry
    // with PEXPIREAT.
    let (key, s) = ("rl2:{replicated}:r", spec(100, 10));
    let mut conn = primary.conn().await;
    for (takes, cost, command) in [(5, 1, "incrby"), (1, 50, "pexpireat")] {
        for _ in 0..takes {
            assert!(decide(&b, key, &s, cost).await.allowed);
        }
        let stats = primary.cmd(&["INFO", "commandstats"]);
        assert!(
            stats.contains(&format!("cmdstat_{command}:calls=")),
            "the takes used {command}: {stats}"
        );
        let tat: String = conn.get(key).await.unwrap();
        let at = expiry_at(&mut conn, key).await.to_string();
        assert!(
            wait_until(Duration::from_secs(5), || {
                replica.cmd(&["GET", key]).contains(&tat)
                    && replica.cmd(&["PEXPIRETIME", key]).contains(&at)
            }),
            "the replica holds TAT {tat}, expiring at {at}: {} {}",
            replica.cmd(&["GET", key]),
            replica.cmd(&["PEXPIRETIME", key])
        );
    }
}

#[actix_web::test]
async fn refill_follows_redis_time_since_the_stored_timestamp() {
    let (redis, b) = redis_and_bucket();
    let key = "rl2:{refill}:r";
    b.take(key, &spec(10, 4), Ask::single(10)).await.unwrap();
    let rejected = decide(&b, key, &spec(10, 4), 1).await;
    assert!(!rejected.allowed);
    assert!((1..=250).contains(&rejected.retry_after_ms), "{rejected:?}");

    // Pretend the bucket was emptied 1.5 s ago: 1.5 s × 4/s = 6 tokens.
    let mut conn = redis.conn().await;
    let tat: f64 = conn.get::<_, String>(key).await.unwrap().parse().unwrap();
    let _: () = conn.set(key, tat - 1_500_000.0).await.unwrap();
    let d = decide(&b, key, &spec(10, 4), 1).await;
    assert!(d.allowed);
    assert_eq!(d.remaining, 5);
}

#[actix_web::test]
async fn one_call_decides_several_keys_with_one_reading_of_the_clock() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let reply = eval(
        &mut conn,
        &["rl2:{a}:r", "rl2:{a}:s", "rl2:{a}:r"],
        &[["3", "1", "1"], ["5", "1", "8:2:1"], ["3", "1", "3"]],
    )
    .await;
    assert_eq!(
        reply,
        [
            1, 2, 0, // 1 of 3 taken (a plain ask: three integers)
            1, 0, 1_000, 5, 2_000, // a lease: want 8 clamped to 5; five
            0, 2, 1_000, // 3 wanted, the same bucket holds 2
        ]
    );
}

/// A call with a compact ask gets its reply packed by Redis's own
/// `cmsgpack`, which reads back as the plain array Redis would have sent
/// for the same numbers, every encoding included; a call without one
/// gets the plain array.
#[actix_web::test]
async fn a_packed_reply_reads_as_the_plain_array_of_the_same_numbers() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let numbers = "{0, 1, -1, 127, 128, -32, -33, 255, 256, 65535, 65536, -129, -32769, \
                   4294967296, -4294967296, 9007199254740991, -9007199254740991, 2.5, -2.5, 1e15}";
    let plain: Vec<i64> = redis::cmd("EVAL")
        .arg(format!("return {numbers}"))
        .arg(0)
        .query_async(&mut conn)
        .await
        .unwrap();
    let packed_reply: redis::Value = redis::cmd("EVAL")
        .arg(format!("return cmsgpack.pack({numbers})"))
        .arg(0)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(matches!(packed_reply, redis::Value::BulkString(_)));
    assert_eq!(plain.len(), 20);
    assert_eq!(
        packed::integers(Reply::of_value(&packed_reply)),
        Some(plain)
    );

    let mut call = async |key: &str, ask: &str| -> redis::Value {
        redis::cmd("EVAL")
            .arg(include_str!("../lua/token_bucket.lua"))
            .arg(1)
            .arg(key)
            .arg(10)
            .arg(1)
            .arg(ask)
            .query_async(&mut conn)
            .await
            .unwrap()
    };
    let compact = call("rl2:{p}:a", "+1").await;
    assert!(
        matches!(compact, redis::Value::BulkString(_)),
        "{compact:?}"
    );
    assert_eq!(packed::integers(Reply::of_value(&compact)), Some(vec![9]));
    let plain = call("rl2:{p}:b", "1").await;
    assert!(matches!(plain, redis::Value::Array(_)), "{plain:?}");
    assert_eq!(
        packed::integers(Reply::of_value(&plain)),
        Some(vec![1, 9, 0])
    );

    // A server whose Lua has no cmsgpack (its globals stood in for here by
    // an empty table) gets the plain array for a compact call too.
    let without: redis::Value = redis::cmd("EVAL")
        .arg(format!(
            "local _G = {{}}\n{}",
            include_str!("../lua/token_bucket.lua")
        ))
        .arg(1)
        .arg("rl2:{p}:c")
        .arg(10)
        .arg(1)
        .arg("+1")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(matches!(without, redis::Value::Array(_)), "{without:?}");
    assert_eq!(packed::integers(Reply::of_value(&without)), Some(vec![9]));
}

/// A short ask ('=' and a single ask, the key's only argument) is decided
/// under the rule of the single key before it, as the same ask with that
/// rule's arguments is; with no single key before it, or with any other
/// ask after '=', it fails alone.
#[actix_web::test]
async fn a_short_ask_takes_the_rule_of_the_single_key_before_it() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let (a, b, c, d, e) = (
        "rl2:{s}:a",
        "rl2:{s}:b",
        "rl2:{s}:c",
        "rl2:{s}:d",
        "rl2:{s}:e",
    );
    let keys = [a, b, a, c, d, e, "rl2:{s}:e#1d", a];
    let args: &[&[&str]] = &[
        &["=+1"],
        &["4", "1", "+1"],
        &["=+3"],
        &["=2:1:1"],
        &["=+1"],
        &["=1*2"],
        &["4", "d", "-"],
        &["=+1"],
    ];
    let reply = eval(&mut conn, &keys, args).await;
    assert_eq!(
        reply,
        [
            -1, // no single key before it: undecided (compact)
            3,  // b: 4 tokens (the rule now in force), 1 taken
            -2, 1, 1, 2_000, // a: 3 of 4 taken, 1 left, 2 s until 3 again
            1, 2, 0, 2, 0, // c: a lease of 2 under the same rule
            3, // d: a plain ask again
            -1, 0, 0, // a group ask cannot be short
            -1, 0, 0, // nor does its '-' key belong to a group
            -2, 1, 0, 1_000, // a again: the rule before them still holds
        ]
    );
}

/// A count before a short ask makes it the ask of that many keys in a
/// row, which send no argument of their own, each decided as if it had
/// the short ask alone; a run cut short by the last key ends there, and
/// one whose ask cannot be short leaves every key it covers undecided.
#[actix_web::test]
async fn a_counted_short_ask_covers_a_run_of_keys() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let (a, b, c, d, e) = (
        "rl2:{r}:a",
        "rl2:{r}:b",
        "rl2:{r}:c",
        "rl2:{r}:d",
        "rl2:{r}:e",
    );
    let keys = [a, b, c, a, d, e, a, b];
    let args: &[&[&str]] = &[
        &["4", "1", "+1"],
        &["3=+1"],
        &[],
        &[],
        &["2=1*2"],
        &[],
        &["12=+1"],
        &[],
    ];
    let reply = eval(&mut conn, &keys, args).await;
    assert_eq!(
        reply,
        [
            3, // a: 4 tokens, 1 taken
            3, 3, // b and c, in the run, under a's rule
            2, // a again, in the run: it sees the first take
            -1, 0, 0, // d: a group ask cannot be short, nor run
            -1, 0, 0, // e, in that run
            1, // a, in a run longer than the keys left
            2, // b, the last key
        ]
    );
}

#[actix_web::test]
async fn a_plus_cost_gets_the_compact_reply() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let _: () = conn.hset("rl2:{c}:bad", "f", 1).await.unwrap();
    let reply = eval(
        &mut conn,
        &[
            "rl2:{c}:r",
            "rl2:{c}:r",
            "rl2:{c}:r",
            "rl2:{c}:bad",
            "rl2:{c}:s",
        ],
        &[
            ["3", "1", "+1"],
            ["3", "1", "+2"],
            ["3", "1", "+1"],
            ["3", "1", "+1"],
            ["3", "1", "1"],
        ],
    )
    .await;
    assert_eq!(
        reply,
        [
            2, // a grant leaving its cost again: the remaining count alone
            -2, 1, 0, 2_000, // a grant leaving less than its cost: tagged
            -2, 0, 0, 1_000, // a refusal: tagged
            -1,    // a key the script could not decide
            1, 2, 0, // a plain "1" keeps the three integers
        ]
    );
}

#[actix_web::test]
async fn plain_asks_and_leases_share_a_call_and_read_back_in_order() {
    let (_redis, b) = redis_and_bucket();
    let lease = Ask::lease(8, 2, 1);
    let grants = b
        .take_many(&[
            ("rl2:{m}:a", spec(3, 1), Ask::single(1)),
            ("rl2:{m}:b", spec(5, 1), lease),
            ("rl2:{m}:c", spec(3, 1), Ask::single(10)),
            ("rl2:{m}:c", spec(3, 1), Ask::single(1)),
            // The same capacity at another rate: a rule of its own.
            ("rl2:{m}:d", spec(3, 2), Ask::single(4)),
        ])
        .await
        .unwrap();
    let seen: Vec<_> = grants
        .iter()
        .map(|g| {
            (
                g.decision.allowed,
                g.decision.remaining,
                g.granted,
                g.decision.retry_after_ms,
                g.block_ms,
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (true, 2, 1, 0, 0),
            (true, 0, 5, 1_000, 2_000),
            // A cost above the capacity takes the whole (full) bucket.
            (true, 0, 3, 3_000, 3_000),
            (false, 0, 0, 1_000, 1_000),
            (true, 0, 3, 1_500, 1_500),
        ]
    );
}

/// A key decided alone, then in a group, then alone again in one call
/// sees each time what the call wrote before.
#[actix_web::test]
async fn a_key_met_again_in_one_call_sees_what_the_call_wrote() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let (bucket, quota) = ("rl2:{again}:a", "rl2:{again}:a#1d");
    let reply = eval(
        &mut conn,
        &[bucket, bucket, quota, bucket, bucket],
        &[
            ["5", "1", "1"],
            ["5", "1", "1*2"],
            ["100", "d", "-"],
            ["5", "1", "1"],
            ["5", "1", "1"],
        ],
    )
    .await;
    let answers: Vec<_> = reply.chunks(3).map(|a| (a[0], a[1])).collect();
    assert_eq!(answers, [(1, 4), (1, 3), (1, 99), (1, 2), (1, 1)]);
}

/// Keys in a row with the same ask (the script converts a repeated ask
/// once) are each decided on their own bucket state.
#[actix_web::test]
async fn repeated_asks_in_one_call_each_take_their_own_tokens() {
    let (_redis, b) = redis_and_bucket();
    let lease = Ask::lease(4, 2, 1);
    let grants = b
        .take_many(&[
            ("rl2:{q}:a", spec(2, 1), Ask::single(1)),
            ("rl2:{q}:a", spec(2, 1), Ask::single(1)),
            ("rl2:{q}:a", spec(2, 1), Ask::single(1)),
            ("rl2:{q}:b", spec(5, 1), lease),
            ("rl2:{q}:b", spec(5, 1), lease),
            ("rl2:{q}:b", spec(5, 1), lease),
            ("rl2:{q}:c", spec(5, 1), Ask::single(1)),
        ])
        .await
        .unwrap();
    let seen: Vec<_> = grants
        .iter()
        .map(|g| (g.decision.allowed, g.decision.remaining, g.granted))
        .collect();
    assert_eq!(
        seen,
        [
            (true, 1, 1),
            (true, 0, 1),
            (false, 0, 0),
            // A lease takes want, then only the request's own need once
            // fewer than min are left, then nothing.
            (true, 1, 4),
            (true, 0, 1),
            (false, 0, 0),
            (true, 4, 1),
        ]
    );
}

/// Answers of format 1 (`tests/fixtures/token_bucket_v1.lua`) and of this
/// script to the same sequence of asks, on twin buckets: allowed, remaining
/// and granted are equal. The waits are equal up to what Redis's clock
/// moved between the twin calls (each wait counts down from the write that
/// found the bucket full): at most the wall time the two steps concerned
/// took.
#[actix_web::test]
async fn every_answer_is_the_one_format_1_gave() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let v1 = redis::Script::new(include_str!("fixtures/token_bucket_v1.lua"));
    let v2 = redis::Script::new(include_str!("../lua/token_bucket.lua"));
    let clock = SystemClock::new();
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    // Wall time (ms, rounded up) of the longest step that wrote each bucket.
    let mut written_span = [0u64; 20];
    for step in 0..2_000 {
        let bucket = next(20) as usize;
        let capacity = 1 + bucket as u64 % 7 * 3;
        let want = 1 + next(capacity + 3);
        let min = 1 + next(want);
        let need = 1 + next(min);
        let args = [capacity as f64, 0.01, want as f64, min as f64, need as f64];
        let started = clock.now_micros();
        let old: Vec<i64> = v1
            .key(format!("rl:{{d{bucket}}}:r"))
            .arg(&args)
            .invoke_async(&mut conn)
            .await
            .unwrap();
        let plain = want == min && min == need;
        let ask = if plain {
            want.to_string()
        } else {
            format!("{want}:{min}:{need}")
        };
        let mut new: Vec<i64> = v2
            .key(format!("rl2:{{d{bucket}}}:r"))
            .arg(&args[..2])
            .arg(ask)
            .invoke_async(&mut conn)
            .await
            .unwrap();
        if plain {
            // A plain ask's reply leaves out what follows from it.
            assert_eq!(new.len(), 3, "step {step}: {new:?}");
            let granted = if new[0] == 1 {
                want.min(capacity) as i64
            } else {
                0
            };
            new.extend([granted, new[2]]);
        }
        let span = (clock.now_micros() - started).div_ceil(1000);
        let slack = (written_span[bucket] + span + 1) as i64;
        let same = [0, 1, 3].iter().all(|&i| old[i] == new[i])
            && [2, 4].iter().all(|&i| (old[i] - new[i]).abs() <= slack);
        assert!(
            same,
            "step {step}: bucket {bucket}, ask {args:?}: {old:?} vs {new:?} (slack {slack} ms)"
        );
        if new[0] == 1 {
            // A write on a bucket that is not full moves both twins' TATs
            // by the same amount; their gap was set by whichever write
            // found the bucket full, so keep the widest span of any write.
            written_span[bucket] = written_span[bucket].max(span);
        }
    }
}

#[actix_web::test]
async fn cost_above_capacity_waits_for_a_full_bucket() {
    let (_redis, b) = redis_and_bucket();
    let first = decide(&b, "rl2:{c}:r", &spec(3, 1), 10).await;
    assert!(first.allowed);
    assert_eq!(first.remaining, 0);
    let second = decide(&b, "rl2:{c}:r", &spec(3, 1), 10).await;
    assert!(!second.allowed);
    assert!(
        (2_900..=3_000).contains(&second.retry_after_ms),
        "{second:?}"
    );
}

#[actix_web::test]
async fn a_flushed_script_cache_is_reloaded_on_noscript() {
    let (redis, b) = redis_and_bucket();
    b.take("rl2:{n}:r", &spec(5, 1), Ask::single(1))
        .await
        .unwrap();
    let loads = redis.command_calls("script|load");
    redis.cmd(&["SCRIPT", "FLUSH"]);
    let d = decide(&b, "rl2:{n}:r", &spec(5, 1), 1).await;
    assert!(d.allowed);
    assert_eq!(d.remaining, 3);
    assert_eq!(redis.command_calls("script|load"), loads + 1);
    assert_eq!(
        redis.command_calls("eval"),
        0,
        "the script is never sent by body per call"
    );
}

#[actix_web::test]
async fn script_calls_ride_the_clients_own_line_and_a_dead_line_falls_back_to_the_shared_connection()
 {
    let redis = RedisServer::start();
    let timeout = Duration::from_secs(2);
    let conn = connection(&redis, timeout);
    let b = RedisBucket::new(conn.clone(), timeout, Metrics::new(), SystemClock::shared());
    let addr = NodeAddr::new("127.0.0.1", redis.port);
    let key = "rl2:{line}:r";
    // A negligible refill, so only takes move the count.
    let s = BucketSpec {
        capacity: NonZeroU32::new(100).unwrap(),
        refill_per_second: 0.001,
    };
    // The first call takes the shared connection and has a line opened;
    // with the shared connection gone, calls still go out, on the line,
    // and nothing reopens the shared connection.
    redis
        .assert_calls_ride_a_line(&conn, 5, async || decide(&b, key, &s, 1).await)
        .await;

    // A line that died (every client killed, as a restart would) hands its
    // call to the shared connection, which reconnects; another line opens.
    redis.cmd(&["CLIENT", "KILL", "TYPE", "normal"]);
    let d = decide(&b, key, &s, 1).await;
    assert!(d.allowed);
    assert_eq!(d.remaining, 93, "each of seven takes counted once");
    assert!(wait_until(Duration::from_secs(5), || conn
        .lines_open(&addr)
        == 1));
    assert_eq!(redis.client_ids().len(), 2);
}

#[actix_web::test]
async fn a_line_the_server_turns_away_is_never_used() {
    // Room for one client: the shared connection. A line's connection is
    // accepted, answered an error and closed.
    let redis = RedisServer::start_with(vec!["--maxclients".into(), "1".into()]);
    let timeout = Duration::from_secs(2);
    let conn = connection(&redis, timeout);
    let b = RedisBucket::new(conn.clone(), timeout, Metrics::new(), SystemClock::shared());
    for _ in 0..10 {
        let grant = b.take("rl2:{full}:r", &spec(100, 1), Ask::single(1)).await;
        assert!(grant.unwrap().decision.allowed);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let addr = NodeAddr::new("127.0.0.1", redis.port);
    assert_eq!(conn.lines_open(&addr), 0);
}

#[actix_web::test]
async fn whole_and_fractional_rates_are_read_alike() {
    let (_redis, b) = redis_and_bucket();
    // A whole rate travels to the script as an integer, any other as a
    // float: both must refill at the rate given.
    for (key, rate, wait_ms) in [("rl2:{whole}:r", 4.0, 250), ("rl2:{half}:r", 2.5, 400)] {
        let spec = BucketSpec {
            capacity: NonZeroU32::new(2).unwrap(),
            refill_per_second: rate,
        };
        let emptied = decide(&b, key, &spec, 2).await;
        assert!(emptied.allowed && emptied.remaining == 0, "{emptied:?}");
        let refused = decide(&b, key, &spec, 1).await;
        assert!(!refused.allowed, "{refused:?}");
        assert!(
            (wait_ms - 100..=wait_ms).contains(&refused.retry_after_ms),
            "rate {rate}: {refused:?}"
        );
    }
}

#[actix_web::test]
async fn a_rate_that_does_not_divide_a_second_stores_whole_microseconds_and_keeps_whole_counts() {
    let (redis, b) = redis_and_bucket();
    let mut conn = redis.conn().await;
    // 3 tokens/s: one token is 333,333.3 µs, which a whole-microsecond
    // TAT rounds; the counts must still come out whole, take after take.
    let (key, three) = ("rl2:{third}:r", spec(1000, 3));
    for taken in 1..=40u64 {
        let d = decide(&b, key, &three, 1).await;
        assert!(d.allowed, "take {taken}: {d:?}");
        assert!(
            (1000 - taken..=1000 - taken + 1).contains(&d.remaining),
            "take {taken}: {d:?}"
        );
        let stored: String = conn.get(key).await.unwrap();
        assert!(
            stored.bytes().all(|b| b.is_ascii_digit()),
            "a whole number of µs, got {stored}"
        );
    }
    // Emptied, then one token's refill later (the TAT set back by hand),
    // one request passes and leaves none.
    let _: () = conn.del(key).await.unwrap();
    let emptied = decide(&b, key, &three, 1000).await;
    assert!(emptied.allowed && emptied.remaining == 0, "{emptied:?}");
    let tat: f64 = conn.get::<_, String>(key).await.unwrap().parse().unwrap();
    let _: () = conn
        .set(key, format!("{}", (tat - 1_000_000.0 / 3.0).round()))
        .await
        .unwrap();
    let one = decide(&b, key, &three, 1).await;
    assert!(one.allowed && one.remaining == 0, "{one:?}");
}

#[actix_web::test]
async fn a_timed_out_call_is_not_replayed() {
    let redis = RedisServer::start();
    let b = bucket(&redis, Duration::from_millis(100));
    let key = "rl2:{slow}:r";
    // A negligible refill, so only takes move the count.
    let spec = BucketSpec {
        capacity: NonZeroU32::new(5).unwrap(),
        refill_per_second: 0.001,
    };
    b.take(key, &spec, Ask::single(1)).await.unwrap();
    let calls_before = redis.command_calls("evalsha");

    redis.pause();
    let result = b.take(key, &spec, Ask::single(1)).await;
    redis.resume();
    assert!(matches!(result, Err(RedisCallError::Timeout)), "{result:?}");

    // The command already sent runs once when Redis wakes; nothing resends it.
    assert!(wait_until(Duration::from_secs(5), || redis
        .command_calls("evalsha")
        > calls_before));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(redis.command_calls("evalsha"), calls_before + 1);
    let d = decide(&b, key, &spec, 1).await;
    assert_eq!(d.remaining, 2, "exactly two earlier takes spent tokens");
}

#[actix_web::test]
async fn a_lease_takes_up_to_want_but_at_least_min_or_just_the_request() {
    let (_redis, b) = redis_and_bucket();
    let key = "rl2:{lease}:r";
    // A negligible refill, so only takes move the count.
    let spec = BucketSpec {
        capacity: NonZeroU32::new(12).unwrap(),
        refill_per_second: 0.001,
    };
    let lease = |want, min| Ask::lease(want, min, 1);
    let g = b.take(key, &spec, lease(5, 3)).await.unwrap();
    assert_eq!((g.granted, g.decision.remaining, g.block_ms), (5, 7, 0));
    // 7 left: up to 10, at least 3, grants all 7 and says when 3 exist again.
    let g = b.take(key, &spec, lease(10, 3)).await.unwrap();
    assert_eq!((g.granted, g.decision.remaining), (7, 0));
    assert!(g.block_ms > 2_000_000, "{g:?}");
    // Nothing left: no grant; the request's own wait (1 token) is shorter
    // than the lease's (3 tokens).
    let g = b.take(key, &spec, lease(10, 3)).await.unwrap();
    assert_eq!(g.granted, 0);
    assert!(
        !g.decision.allowed && g.decision.retry_after_ms < g.block_ms,
        "{g:?}"
    );

    // Fewer than min but enough for the request: the request alone passes.
    let key = "rl2:{need}:r";
    b.take(key, &spec, Ask::single(10)).await.unwrap();
    let g = b.take(key, &spec, lease(8, 4)).await.unwrap();
    assert_eq!(
        (g.granted, g.decision.allowed, g.decision.remaining),
        (1, true, 1)
    );
    assert!(g.block_ms > 0 && g.decision.retry_after_ms == 0, "{g:?}");
}

#[actix_web::test]
async fn a_bare_call_replies_allowed_remaining_and_retry_after_first() {
    // The script as SPEC §6 states it: KEYS[1], capacity, refill; the cost
    // defaults to 1 and the reply is [allowed, remaining, retry].
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let mut call = async || -> Vec<i64> {
        redis::cmd("EVAL")
            .arg(include_str!("../lua/token_bucket.lua"))
            .arg(1)
            .arg("rl2:{bare}:r")
            .arg(2)
            .arg(1)
            .query_async(&mut conn)
            .await
            .unwrap()
    };
    assert_eq!(call().await, [1, 1, 0]);
    assert_eq!(call().await[..2], [1, 0]);
    let rejected = call().await;
    assert_eq!(rejected.len(), 3, "{rejected:?}");
    assert_eq!(rejected[..2], [0, 0]);
    assert!((1..=1_000).contains(&rejected[2]), "{rejected:?}");
}

/// A rule's limits as one group: a bucket of `capacity` and a quota of
/// `quota` per `window_s` seconds.
fn bucket_and_quota(capacity: u32, quota: u32, window_s: u32) -> Vec<(String, GroupLimit)> {
    vec![
        (
            "rl2:{g}:r".to_owned(),
            GroupLimit::Bucket(spec(capacity, 1)),
        ),
        (
            "rl2:{g}:r#1s".to_owned(),
            GroupLimit::Quota {
                quota: NonZeroU32::new(quota).unwrap(),
                window: Window::Seconds(NonZeroU32::new(window_s).unwrap()),
            },
        ),
    ]
}

#[actix_web::test]
async fn a_group_takes_from_every_limit_or_from_none() {
    let (redis, b) = redis_and_bucket();
    let mut conn = redis.conn().await;
    // The quota (2 per hour-long window) runs out before the bucket (5).
    let group = bucket_and_quota(5, 2, 3600);
    for left in [1, 0] {
        let d = decide_group(&b, &group).await;
        assert!(d.iter().all(|d| d.allowed), "{d:?}");
        assert_eq!(d[1].remaining, left);
    }
    let tat_before: f64 = conn.get("rl2:{g}:r").await.unwrap();
    let refused = decide_group(&b, &group).await;
    assert!(refused.iter().all(|d| !d.allowed), "{refused:?}");
    // The bucket had room: it says so, and keeps its tokens.
    assert_eq!((refused[0].remaining, refused[0].retry_after_ms), (3, 0));
    let tat_after: f64 = conn.get("rl2:{g}:r").await.unwrap();
    assert_eq!(tat_before, tat_after, "a refused group writes nothing");
    // The quota waits for its window's end, at most an hour away.
    assert!(refused[1].retry_after_ms > 0 && refused[1].retry_after_ms <= 3_600_000);
    let counted: u32 = conn.get("rl2:{g}:r#1s").await.unwrap();
    assert_eq!(counted, 2);
    let expires_at = expiry_at(&mut conn, "rl2:{g}:r#1s").await;
    assert_eq!(expires_at % 3_600_000, 0, "the count ends with its window");
}

#[actix_web::test]
async fn a_quota_starts_again_when_its_window_ends() {
    let (_redis, b) = redis_and_bucket();
    let group = bucket_and_quota(100, 1, 1);
    let clock = SystemClock::new();
    let started = clock.now_ms();
    let mut admitted = 0;
    // One per one-second window: a bit over two seconds touch 3 or 4.
    while clock.now_ms() - started < 2_100 {
        let d = decide_group(&b, &group).await;
        if d[0].allowed {
            admitted += 1;
        } else {
            assert!(d[1].retry_after_ms <= 1_000, "{d:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!((3..=4).contains(&admitted), "{admitted} admitted");
}

#[actix_web::test]
async fn a_group_lease_takes_the_same_batch_from_every_limit() {
    let (redis, b) = redis_and_bucket();
    // The quota (30 an hour) holds fewer than the bucket (50) and binds.
    let group = bucket_and_quota(50, 30, 3600);
    let lease = Ask::lease(40, 20, 1);
    let grant = b.take_group(&group, lease).await.unwrap();
    assert_eq!(grant.granted, 30, "as many as the fullest limit allows");
    assert_eq!(grant.decisions[0].remaining, 20);
    assert_eq!(grant.decisions[1].remaining, 0);
    // Another lease: none of min left in the quota, not even the need.
    let again = b.take_group(&group, lease).await.unwrap();
    assert_eq!(again.granted, 0);
    assert!(again.decisions.iter().all(|d| !d.allowed));
    assert!(
        again.block_ms > 1_000,
        "blocked until the window ends: {again:?}"
    );
    let mut conn = redis.conn().await;
    let counted: u32 = conn.get("rl2:{g}:r#1s").await.unwrap();
    assert_eq!(counted, 30);
}

#[actix_web::test]
async fn a_key_holding_another_value_fails_alone_and_the_rest_of_its_call_is_decided() {
    let (redis, b) = redis_and_bucket();
    let mut conn = redis.conn().await;
    // Values the script never writes: a hash, and a string that is no number.
    let _: () = conn.hset("rl2:{hash}:r", "tokens", 1).await.unwrap();
    let _: () = conn.set("rl2:{text}:r", "full").await.unwrap();
    let lease = Ask::lease(5, 2, 1);
    let batch = [
        ("rl2:{a}:r", spec(10, 1), Ask::single(1)),
        ("rl2:{hash}:r", spec(10, 1), Ask::single(1)),
        ("rl2:{text}:r", spec(10, 1), lease),
        ("rl2:{b}:r", spec(10, 1), lease),
    ];
    let items: Vec<_> = batch.iter().map(|(k, s, a)| (*k, *s, *a)).collect();
    let grants = b.take_many(&items).await;
    assert!(
        matches!(grants, Err(RedisCallError::Refused)),
        "take_many reports the refused key: {grants:?}"
    );
    // One at a time, the others pass and the refused keys are left as found.
    for (key, spec, ask) in [batch[0], batch[3]] {
        let grant = b.take(key, &spec, ask).await.unwrap();
        assert!(grant.decision.allowed, "{key}");
    }
    let a: f64 = conn.get("rl2:{a}:r").await.unwrap();
    assert!(a > 0.0, "the first key was charged in the shared call too");
    for key in ["rl2:{hash}:r", "rl2:{text}:r"] {
        let refused = b.take(key, &spec(10, 1), Ask::single(1)).await;
        assert!(
            matches!(refused, Err(RedisCallError::Refused)),
            "{refused:?}"
        );
    }
    let text: String = conn.get("rl2:{text}:r").await.unwrap();
    assert_eq!(text, "full");
    assert!(redis.cmd(&["TYPE", "rl2:{hash}:r"]).contains("hash"));
}

#[actix_web::test]
async fn a_group_with_a_key_it_cannot_decide_writes_none_of_its_keys() {
    let (redis, b) = redis_and_bucket();
    let mut conn = redis.conn().await;
    let group = bucket_and_quota(5, 2, 3600);
    let _: () = conn.set("rl2:{g}:r#1s", "not a count").await.unwrap();
    let refused = b.take_group(&group, Ask::single(1)).await;
    assert!(
        matches!(refused, Err(RedisCallError::Refused)),
        "{refused:?}"
    );
    let bucket: Option<String> = conn.get("rl2:{g}:r").await.unwrap();
    assert_eq!(bucket, None, "the group's bucket was not charged");
}

#[actix_web::test]
async fn malformed_asks_and_unusable_limits_fail_their_own_keys_only() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let _: () = conn.hset("rl2:{h}:r", "f", 1).await.unwrap();
    // Keys: a bad ask; a '-' key that no group holds; a rate so slow
    // that its expiry cannot be set; a capacity of 0; a group of two whose
    // second key holds a hash; then a good key, which must still be
    // decided.
    let unwritten = [
        "rl2:{x}:a",
        "rl2:{x}:b",
        "rl2:{x}:c",
        "rl2:{x}:d",
        "rl2:{x}:e",
    ];
    let keys = [&unwritten[..], &["rl2:{h}:r", "rl2:{x}:ok"]].concat();
    let reply = eval(
        &mut conn,
        &keys,
        &[
            ["5", "1", "x"],
            ["5", "1", "-"],
            ["5", "1e-300", "1"],
            ["0", "1", "1"],
            ["5", "1", "1*2"],
            ["5", "1", "-"],
            ["5", "1", "1"],
        ],
    )
    .await;
    let answers: Vec<&[i64]> = reply.chunks(3).collect();
    assert_eq!(answers.len(), 7, "{reply:?}");
    for (i, answer) in answers[..6].iter().enumerate() {
        assert_eq!(*answer, [-1, 0, 0], "key {i}: {reply:?}");
    }
    assert_eq!(answers[6], [1, 4, 0]);
    let written: Vec<Option<String>> = redis::cmd("MGET")
        .arg(&unwritten)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(written.iter().all(Option::is_none), "{written:?}");
}

#[actix_web::test]
async fn a_charge_takes_past_zero_and_later_asks_wait_for_the_debt() {
    let (redis, b) = redis_and_bucket();
    let mut conn = redis.conn().await;
    let s = spec(10, 10);
    assert_eq!(decide(&b, "rl2:{c}:r", &s, 4).await.remaining, 6);
    // 12 more than the 6 left: 6 in debt, 0.7 s until one token exists.
    let charged = b.take("rl2:{c}:r", &s, Ask::charge(12)).await.unwrap();
    let d = charged.decision;
    assert!(d.allowed, "a charge is never refused");
    assert_eq!(d.remaining, 0);
    assert!((600..=700).contains(&d.retry_after_ms), "{d:?}");
    let refused = decide(&b, "rl2:{c}:r", &s, 1).await;
    assert!(!refused.allowed);
    assert!((600..=700).contains(&refused.retry_after_ms), "{refused:?}");
    // A refund gives back what was charged, never above the capacity.
    let refunded = b.take("rl2:{c}:r", &s, Ask::charge(-100)).await.unwrap();
    assert_eq!(
        (
            refunded.decision.remaining,
            refunded.decision.retry_after_ms
        ),
        (10, 0)
    );
    // The debt stops at minus the capacity: 1.1 s until one token, and the
    // key outlives the debt by 1.5 to 2 refills.
    let d = b.take("rl2:{c}:r", &s, Ask::charge(1_000)).await.unwrap();
    assert!(
        (1_000..=1_100).contains(&d.decision.retry_after_ms),
        "{d:?}"
    );
    let ttl: i64 = conn.pttl("rl2:{c}:r").await.unwrap();
    assert!((3_450..=4_000).contains(&ttl), "PTTL {ttl}");
}

#[actix_web::test]
async fn a_charge_counts_on_every_limit_of_a_group_and_a_refund_stops_at_zero() {
    let (redis, b) = redis_and_bucket();
    let mut conn = redis.conn().await;
    // A bucket of 5 and a quota of 4 an hour.
    let group = bucket_and_quota(5, 4, 3600);
    let d = b
        .take_group(&group, Ask::charge(3))
        .await
        .unwrap()
        .decisions;
    assert_eq!((d[0].remaining, d[1].remaining), (2, 1), "{d:?}");
    let d = b
        .take_group(&group, Ask::charge(3))
        .await
        .unwrap()
        .decisions;
    assert!(d.iter().all(|d| d.allowed && d.remaining == 0), "{d:?}");
    assert!(d[1].retry_after_ms > 0 && d[1].retry_after_ms <= 3_600_000);
    let counted: u32 = conn.get("rl2:{g}:r#1s").await.unwrap();
    assert_eq!(counted, 6, "a quota counts a charge past its size");
    let refused = decide_group(&b, &group).await;
    assert!(refused.iter().all(|d| !d.allowed), "{refused:?}");
    let d = b
        .take_group(&group, Ask::charge(-10))
        .await
        .unwrap()
        .decisions;
    assert_eq!((d[0].remaining, d[1].remaining), (5, 4), "{d:?}");
    let counted: u32 = conn.get("rl2:{g}:r#1s").await.unwrap();
    assert_eq!(counted, 0);
    assert!(decide_group(&b, &group).await.iter().all(|d| d.allowed));
}

/// A bucket of `capacity` (1 token a second) and `slots` concurrency
/// slots, held by holder `id` for `lease_ms`.
fn bucket_and_slots(
    capacity: u32,
    slots: u32,
    id: u64,
    lease_ms: u32,
) -> Vec<(String, GroupLimit)> {
    vec![
        (
            "rl2:{s}:r".to_owned(),
            GroupLimit::Bucket(spec(capacity, 1)),
        ),
        (
            "rl2:{s}:r#1c".to_owned(),
            GroupLimit::Slots {
                slots: NonZeroU32::new(slots).unwrap(),
                holder: Holder { id, lease_ms },
            },
        ),
    ]
}

#[actix_web::test]
async fn slots_admit_as_many_holders_as_there_are_and_come_back_when_released() {
    let (redis, b) = redis_and_bucket();
    let mut conn = redis.conn().await;
    let group = |id| bucket_and_slots(10, 2, id, 60_000);
    let take = |id| {
        let group = group(id);
        let b = b.clone();
        async move { b.take_group(&group, Ask::single(3)).await }
    };
    for (id, free) in [(1, 1), (2, 0)] {
        let d = take(id).await.unwrap().decisions;
        assert!(d.iter().all(|d| d.allowed), "{d:?}");
        assert_eq!(d[1].remaining, free);
    }
    // A third holder waits; the bucket keeps its tokens (10 - 2 × 3).
    let refused = take(3).await.unwrap().decisions;
    assert!(refused.iter().all(|d| !d.allowed), "{refused:?}");
    assert_eq!((refused[1].remaining, refused[1].retry_after_ms), (0, 1000));
    assert_eq!(refused[0].remaining, 4, "a refused group takes no token");
    // Every hold is a member of the key, scored with its lease's end.
    let members: Vec<String> = conn.zrange("rl2:{s}:r#1c", 0, -1).await.unwrap();
    assert_eq!(members, ["1", "2"]);
    let ttl: i64 = conn.pttl("rl2:{s}:r#1c").await.unwrap();
    assert!(ttl > 60_000 && ttl <= 120_000, "{ttl}");
    // Releasing touches the slots only; a second release changes nothing.
    for _ in 0..2 {
        let d = b
            .take_group(&group(1)[1..], Ask::release())
            .await
            .unwrap()
            .decisions;
        assert!(d[0].allowed && d[0].remaining == 1, "{d:?}");
    }
    // One slot per holder: a holder id used twice at once is refused.
    let twice = take(2).await.unwrap().decisions;
    assert!(!twice[1].allowed && twice[1].remaining == 1, "{twice:?}");
    assert!(take(3).await.unwrap().decisions[1].allowed);
    // A charge leaves slots alone.
    let d = b
        .take_group(&group(4), Ask::charge(2))
        .await
        .unwrap()
        .decisions;
    assert_eq!((d[0].remaining, d[1].remaining), (0, 0), "{d:?}");
    let members: Vec<String> = conn.zrange("rl2:{s}:r#1c", 0, -1).await.unwrap();
    assert_eq!(members, ["2", "3"]);
}

#[actix_web::test]
async fn an_unrenewed_hold_ends_with_its_lease_and_a_renewed_one_does_not() {
    let (_redis, b) = redis_and_bucket();
    let lease = 300;
    let group = |id| bucket_and_slots(100, 2, id, lease);
    for id in [10, 11] {
        let d = b
            .take_group(&group(id), Ask::single(1))
            .await
            .unwrap()
            .decisions;
        assert!(d[1].allowed, "{d:?}");
    }
    // Holder 10 renews every 100 ms; holder 11's gateway died.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let d = b
            .take_group(&group(10)[1..], Ask::renew())
            .await
            .unwrap()
            .decisions;
        assert!(d[0].allowed, "a renewed hold is kept: {d:?}");
    }
    let lost = b
        .take_group(&group(11)[1..], Ask::renew())
        .await
        .unwrap()
        .decisions;
    assert!(
        !lost[0].allowed,
        "the dead holder's slot came back: {lost:?}"
    );
    assert_eq!(lost[0].remaining, 1);
    // Its slot is free for another; then the limit is full again.
    let take = |id| {
        let group = group(id);
        let b = b.clone();
        async move { b.take_group(&group, Ask::single(1)).await }
    };
    assert!(take(12).await.unwrap().decisions[1].allowed);
    assert!(!take(13).await.unwrap().decisions[1].allowed);
}
