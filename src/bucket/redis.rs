//! The shared bucket in Redis: one atomic script call per decision.
//!
//! Owns the call of `lua/token_bucket.lua` and its reply, and each
//! worker's warm-up: before the gateway says it is ready, every proxy
//! worker's connection is open (to every primary of a Cluster) and the
//! script is loaded there ([`RedisBucket::warm_up`], [`WarmWorkers`]), so
//! the first decisions after a start are shared ones. Connections,
//! timeouts and `NOSCRIPT` handling live in [`crate::redis_client`].
//!
//! Invariant: every call is bounded by `redis.timeout_ms`.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::decision::{Ask, AskKind, BucketSpec, Decision, Grant, GroupGrant, GroupLimit};
use super::packed;
use super::store::{Answer, Item};
use crate::clock::SharedClock;
use crate::redis_client::{LuaScript, RedisCallError, RedisConn, Route, ScriptCall};
use crate::telemetry::Metrics;

/// The token bucket script's source, compiled into the binary.
const TOKEN_BUCKET_SOURCE: &str = include_str!("../../lua/token_bucket.lua");

/// The token bucket script, called by SHA.
static TOKEN_BUCKET: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(TOKEN_BUCKET_SOURCE));

/// Longest pause between warm-up attempts.
const MAX_WARM_UP_BACKOFF: Duration = Duration::from_secs(2);

/// The proxy workers whose Redis connection is up with the script loaded.
#[derive(Debug)]
pub struct WarmWorkers {
    /// Workers the gateway runs.
    expected: usize,
    /// Workers that finished [`RedisBucket::warm_up`].
    warm: AtomicUsize,
}

impl WarmWorkers {
    /// None of `expected` workers warm yet.
    pub fn new(expected: usize) -> Self {
        Self {
            expected,
            warm: AtomicUsize::new(0),
        }
    }

    /// Workers warm so far.
    pub fn warm(&self) -> usize {
        self.warm.load(Ordering::Relaxed)
    }

    /// Whether every worker is warm.
    pub fn all_warm(&self) -> bool {
        self.warm() >= self.expected
    }
}

/// Client for token buckets held in Redis.
#[derive(Clone)]
pub struct RedisBucket {
    /// This worker's connection.
    conn: RedisConn,
    /// Bound on one script call.
    timeout: Duration,
    /// Round-trip histogram.
    metrics: Metrics,
    /// Source of call timings.
    clock: SharedClock,
}

impl RedisBucket {
    /// A bucket client over `conn`, each call bounded by `timeout`.
    pub fn new(conn: RedisConn, timeout: Duration, metrics: Metrics, clock: SharedClock) -> Self {
        Self {
            conn,
            timeout,
            metrics,
            clock,
        }
    }

    /// The bound on one call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Connects this worker's connections and loads the script through
    /// them (on every primary known), each attempt bounded by
    /// `attempt_timeout`, retrying with backoff until Redis answers; then
    /// counts this worker in `workers`.
    pub async fn warm_up(&self, attempt_timeout: Duration, workers: &WarmWorkers) {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(TOKEN_BUCKET.code());
        let mut backoff = Duration::from_millis(50);
        while let Err(e) = self.conn.query_each(&load, attempt_timeout).await {
            tracing::debug!(error = %e, "Redis not ready for this worker yet; retrying.");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_WARM_UP_BACKOFF);
        }
        workers.warm.fetch_add(1, Ordering::Relaxed);
    }

    /// Refills `key`'s bucket and takes tokens atomically, as `ask` says.
    ///
    /// # Errors
    /// [`RedisCallError`] on timeout, connection or server failure.
    pub async fn take(
        &self,
        key: &str,
        spec: &BucketSpec,
        ask: Ask,
    ) -> Result<Grant, RedisCallError> {
        let mut grants = self.take_many(&[(key, *spec, ask)]).await?;
        grants.pop().ok_or(RedisCallError::BadReply)
    }

    /// Takes the same count from every limit of `group`, as `ask` says, or
    /// nothing from any, in one script call; the decisions come in the same
    /// order.
    /// Every key must live in one slot (one tenant's hash tag).
    ///
    /// # Errors
    /// [`RedisCallError`] on timeout, connection or server failure, or a
    /// reply of the wrong shape; then no decision is known.
    pub async fn take_group(
        &self,
        group: &[(String, GroupLimit)],
        ask: Ask,
    ) -> Result<GroupGrant, RedisCallError> {
        self.take_batch(&[Item::Group(group, ask)])
            .await?
            .pop()
            .ok_or(RedisCallError::BadReply)
            .and_then(Answer::group)
    }

    /// Runs `eval`, a call of the token bucket script, on the primary
    /// serving `key` under the timeout, timing it.
    async fn call(&self, key: &str, call: &ScriptCall) -> Result<Vec<i64>, RedisCallError> {
        let started = self.clock.now_micros();
        let reply = self
            .conn
            .script_call(
                Route::Key(key),
                &TOKEN_BUCKET,
                call,
                self.timeout,
                packed::integers,
            )
            .await;
        let elapsed = self.clock.now_micros().saturating_sub(started);
        self.metrics.redis_call(elapsed as f64 / 1e6);
        reply
    }

    /// Takes tokens from several buckets in one script call (one reading
    /// of Redis's clock), each as its `Ask` says; the grants come in the
    /// same order. Every key must live on one node (on a Cluster: one slot).
    ///
    /// # Errors
    /// As [`RedisBucket::take_batch`].
    pub async fn take_many(
        &self,
        batch: &[(&str, BucketSpec, Ask)],
    ) -> Result<Vec<Grant>, RedisCallError> {
        let items: Vec<Item<'_>> = batch
            .iter()
            .map(|(key, spec, ask)| Item::One(key, *spec, *ask))
            .collect();
        self.take_batch(&items)
            .await?
            .into_iter()
            .map(Answer::one)
            .collect()
    }

    /// Decides every item of `batch` in one script call (one reading of
    /// Redis's clock): single buckets as their `Ask` says, groups all or
    /// nothing; the answers come in the same order, [`Answer::Refused`]
    /// for an item the script could not decide. Every key must live on
    /// one node (on a Cluster: one slot).
    ///
    /// # Errors
    /// [`RedisCallError`] on timeout, connection or server failure, or a
    /// reply of the wrong shape; then no answer is known.
    pub async fn take_batch(&self, batch: &[Item<'_>]) -> Result<Vec<Answer>, RedisCallError> {
        let call = script_call(batch);
        let first = batch.first().map_or("", Item::first_key);
        let reply = self.call(first, &call).await?;
        let mut rest = reply.as_slice();
        let mut answers = Vec::with_capacity(batch.len());
        for item in batch {
            match *item {
                Item::One(_, spec, ask) if compact(ask) => {
                    answers.push(compact_answer(&mut rest, &spec, ask)?);
                }
                Item::One(_, spec, ask) => {
                    let (r, tail) = rest
                        .split_at_checked(width(ask))
                        .ok_or(RedisCallError::BadReply)?;
                    rest = tail;
                    answers.push(if r[0] < 0 {
                        Answer::Refused
                    } else {
                        Answer::One(grant_of(r, &spec, ask))
                    });
                }
                Item::Group(group, ask) => {
                    let width = width(ask);
                    let (r, tail) = rest
                        .split_at_checked(width * group.len())
                        .ok_or(RedisCallError::BadReply)?;
                    rest = tail;
                    answers.push(if r.first().is_none_or(|allowed| *allowed < 0) {
                        Answer::Refused
                    } else {
                        Answer::Group(group_grant_of(r, width, ask))
                    });
                }
            }
        }
        if rest.is_empty() {
            Ok(answers)
        } else {
            Err(RedisCallError::BadReply)
        }
    }
}

/// The call of the token bucket script deciding `batch`: every key
/// first, then each key's three arguments (or a short ask alone, one for
/// a run of keys), written straight into the call's one buffer.
fn script_call(batch: &[Item<'_>]) -> ScriptCall {
    let keys = batch.iter().map(Item::key_count).sum();
    // About 16 bytes a key or argument on the wire, 4 more for its length.
    let mut eval = ScriptCall::new(keys, 20 * 4 * keys);
    for key in batch.iter().flat_map(Item::keys) {
        eval.arg(key);
    }
    // The rule of the previous item when it was a single key: a plain ask
    // under the same rule is sent short, one argument for it and the
    // single keys after it with the same rule and ask.
    let mut previous = None;
    let mut items = batch.iter().peekable();
    while let Some(item) = items.next() {
        match *item {
            Item::One(_, spec, ask) => {
                if compact(ask) && previous == Some(spec) {
                    let mut run = 1;
                    while items
                        .next_if(
                            |next| matches!(next, Item::One(_, s, a) if *s == spec && *a == ask),
                        )
                        .is_some()
                    {
                        run += 1;
                    }
                    arg_plain(&mut eval, Some(run), ask.need);
                } else {
                    eval.arg(spec.capacity.get());
                    arg_rate(&mut eval, spec.refill_per_second);
                    arg_ask(&mut eval, ask, None);
                }
                previous = Some(spec);
            }
            Item::Group(group, ask) => {
                previous = None;
                for (i, (_, limit)) in group.iter().enumerate() {
                    match limit {
                        GroupLimit::Bucket(spec) => {
                            eval.arg(spec.capacity.get());
                            arg_rate(&mut eval, spec.refill_per_second);
                        }
                        GroupLimit::Quota { quota, window } => {
                            eval.arg(quota.get()).arg(window.script_code());
                        }
                        GroupLimit::Slots { slots, holder } => {
                            eval.arg(slots.get()).arg(format!(
                                "c{}:{:x}",
                                holder.lease_ms.max(1),
                                holder.id
                            ));
                        }
                    }
                    if i > 0 {
                        eval.arg("-");
                    } else {
                        arg_ask(&mut eval, ask, Some(group.len()));
                    }
                }
            }
        }
    }
    eval
}

/// Writes `ask` as the script reads it, as the head of a group of `keys`
/// keys when given: a plain take as its cost (`+<cost>` for a lone key,
/// the common case, which asks for the compact reply), a lease as
/// `want:min:need`, a charge as
/// `c<n>`, a refund as `c-<n>`, a release as `r` and a renewal as `n`; a
/// group's with `*<keys>` after it.
fn arg_ask(eval: &mut ScriptCall, ask: Ask, keys: Option<usize>) {
    if keys.is_none() && compact(ask) {
        arg_plain(eval, None, ask.need);
        return;
    }
    let head = match ask.kind {
        AskKind::Take if ask.is_lease() => format!("{}:{}:{}", ask.want, ask.min, ask.need),
        AskKind::Take => ask.need.to_string(),
        AskKind::Charge => format!("c{}", ask.want),
        AskKind::Refund => format!("c-{}", ask.want),
        AskKind::Release => "r".to_owned(),
        AskKind::Renew => "n".to_owned(),
    };
    match keys {
        Some(keys) => eval.arg(format!("{head}*{keys}")),
        None => eval.arg(head),
    };
}

/// Writes a lone key's plain take of `cost` without an allocation (this
/// is every shared decision's): `+<cost>` for a key sent with its rule,
/// or for `short` keys in a row under the rule of the single key before
/// them, the short ask `=+<cost>` (one key) or `<keys>=+<cost>`.
fn arg_plain(eval: &mut ScriptCall, short: Option<usize>, cost: u32) {
    let mut text = [0; 32];
    let mut end = 0;
    let mut write = |bytes: &[u8]| {
        text[end..end + bytes.len()].copy_from_slice(bytes);
        end += bytes.len();
    };
    let mut digits = itoa::Buffer::new();
    match short {
        Some(1) => write(b"="),
        Some(keys) => {
            write(digits.format(keys).as_bytes());
            write(b"=");
        }
        None => {}
    }
    write(b"+");
    write(digits.format(cost).as_bytes());
    eval.arg(&text[..end]);
}

/// Whether a lone key's `ask` gets the script's compact reply: a plain
/// take (see [`arg_ask`]).
fn compact(ask: Ask) -> bool {
    ask.kind == AskKind::Take && !ask.is_lease()
}

/// The answer to a lone key's plain `ask` under `spec`, read from the
/// front of `rest` in the script's compact form: the remaining count of
/// a grant that leaves `need` tokens (then nothing to wait for), -1 for a
/// key the script could not decide, or -2 and the three integers of any
/// other answer.
fn compact_answer(
    rest: &mut &[i64],
    spec: &BucketSpec,
    ask: Ask,
) -> Result<Answer, RedisCallError> {
    let (&head, tail) = rest.split_first().ok_or(RedisCallError::BadReply)?;
    *rest = tail;
    let decision = match head {
        -1 => return Ok(Answer::Refused),
        -2 => {
            let (r, tail) = rest.split_at_checked(3).ok_or(RedisCallError::BadReply)?;
            *rest = tail;
            decision_of(r)
        }
        remaining if remaining > 0 => Decision {
            allowed: true,
            remaining: remaining.unsigned_abs(),
            retry_after_ms: 0,
        },
        _ => return Err(RedisCallError::BadReply),
    };
    Ok(Answer::One(plain_grant(decision, spec, ask)))
}

/// The integers the script replies per key for `ask` (other than a lone
/// key's plain take): five for a lease, three for any other.
fn width(ask: Ask) -> usize {
    if ask.is_lease() { 5 } else { 3 }
}

/// Writes a refill rate as the script reads it: a whole rate (the common
/// case: a rule's own rate, or an even share of it) as an integer, whose
/// digits cost far less to write than a float's shortest form; any other
/// in full precision.
fn arg_rate(eval: &mut ScriptCall, rate: f64) {
    // Whole numbers below 2^53 are exact in both forms.
    if rate.fract() == 0.0 && (1.0..9_007_199_254_740_992.0).contains(&rate) {
        eval.arg(rate as u64);
    } else {
        eval.arg(rate);
    }
}

/// The grant of a group's reply `r`, `width` integers per key.
fn group_grant_of(r: &[i64], width: usize, ask: Ask) -> GroupGrant {
    let decisions: Vec<Decision> = r.chunks_exact(width).map(decision_of).collect();
    let (granted, block_ms) = if ask.is_lease() {
        let granted = r.get(3).map_or(0, |g| u32::try_from(*g).unwrap_or(0));
        let block = r
            .chunks_exact(5)
            .map(|k| u64::try_from(k[4]).unwrap_or(0))
            .max()
            .unwrap_or(0);
        (granted, block)
    } else {
        // A plain ask: its cost (clamped as the script clamps it) or
        // nothing; it can ask again once every limit could pass. A charge:
        // its amount.
        let allowed = decisions.first().is_some_and(|d| d.allowed);
        let block = decisions
            .iter()
            .map(|d| d.retry_after_ms)
            .max()
            .unwrap_or(0);
        let granted = if allowed { ask.need } else { 0 };
        (granted, block)
    };
    GroupGrant {
        granted,
        decisions,
        block_ms,
    }
}

/// A decision from the first three integers of a key's reply.
fn decision_of(r: &[i64]) -> Decision {
    Decision {
        allowed: r[0] == 1,
        remaining: u64::try_from(r[1]).unwrap_or(0),
        retry_after_ms: u64::try_from(r[2]).unwrap_or(0),
    }
}

/// The grant of a single key's reply `r` (three integers for a charge,
/// five for a lease).
fn grant_of(r: &[i64], spec: &BucketSpec, ask: Ask) -> Grant {
    let decision = decision_of(r);
    if !ask.is_lease() {
        return plain_grant(decision, spec, ask);
    }
    Grant {
        granted: u32::try_from(r[3]).unwrap_or(0),
        decision,
        block_ms: u64::try_from(r[4]).unwrap_or(0),
    }
}

/// The grant of a plain ask or a charge with `decision`: what the script
/// leaves out follows from it. A plain ask took its cost (clamped to the
/// capacity, as the script does) or nothing, and can ask again once it
/// could pass; a charge took its amount (clamped likewise here).
fn plain_grant(decision: Decision, spec: &BucketSpec, ask: Ask) -> Grant {
    let granted = if decision.allowed {
        ask.need.min(spec.capacity.get())
    } else {
        0
    };
    Grant {
        granted,
        decision,
        block_ms: decision.retry_after_ms,
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    /// The keys and arguments `script_call` writes for `batch`.
    fn args_of(batch: &[Item<'_>]) -> Vec<String> {
        script_call(batch)
            .args()
            .map(|arg| String::from_utf8_lossy(arg).into_owned())
            .collect()
    }

    fn spec(capacity: u32) -> BucketSpec {
        let n = |v| NonZeroU32::new(v).unwrap();
        BucketSpec::of(n(capacity), n(10))
    }

    #[test]
    fn single_keys_in_a_row_under_one_rule_and_ask_send_one_counted_short_ask() {
        let (a, b) = (spec(20), spec(30));
        let one = Ask::single(1);
        let group = [("rl2:{t}:g".to_owned(), GroupLimit::Bucket(a))];
        let batch = [
            Item::One("k1", a, one),
            Item::One("k2", a, one),
            Item::One("k3", a, one),
            Item::One("k4", a, one),
            // Another cost breaks the run; the same rule stays in force.
            Item::One("k5", a, Ask::single(2)),
            Item::One("k6", a, one),
            // Another rule sends its arguments again.
            Item::One("k7", b, one),
            // A lease is never short.
            Item::One("k8", b, Ask::lease(5, 2, 1)),
            Item::One("k9", b, one),
            Item::One("k10", b, one),
            // A group between two single keys: the one after it is sent
            // with its rule.
            Item::Group(&group, one),
            Item::One("k11", b, one),
        ];
        let keys = [
            "k1",
            "k2",
            "k3",
            "k4",
            "k5",
            "k6",
            "k7",
            "k8",
            "k9",
            "k10",
            "rl2:{t}:g",
            "k11",
        ];
        let args = args_of(&batch);
        assert_eq!(&args[..keys.len()], keys);
        assert_eq!(
            &args[keys.len()..],
            [
                "20", "10", "+1",   // k1: its rule
                "3=+1", // k2 to k4
                "=+2",  // k5
                "=+1",  // k6
                "30", "10", "+1", // k7: another rule
                "30", "10", "5:2:1", // k8: a lease
                "2=+1",  // k9, k10: the rule of k8 before them
                "20", "10", "1*1", // the group
                "30", "10", "+1", // k11
            ]
        );
    }
}
