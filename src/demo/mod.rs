//! `tollgate demo`: one gateway in front of a built-in upstream.
//!
//! Owns the demo's configuration, its rules file when none is on disk,
//! and the run: the upstream ([`upstream`]: an echo, and an LLM-like
//! streaming endpoint that reports usage), the gateway, and the banner of
//! `curl` lines to try, so a try-out needs nothing but the binary. Not
//! used on the production path.

use std::net::TcpListener;

pub mod upstream;

/// The demo's configuration, compiled in so `tollgate demo` works anywhere.
pub const DEMO_CONFIG: &str = include_str!("../../config/demo.toml");
/// The rules file made when the configured one is not on disk: no rule,
/// so every tenant gets the default rule, and a commented example to
/// append to. The rules are read at run time only: editing them never
/// rebuilds.
const NO_RULES: &str = "\
# tollgate demo rules. None yet: every tenant gets [default_rule].
# Add rules below; a change applies within seconds. For example:
#
# [[rule]]
# tenant = \"shop-b\"
# route = \"create-order\"
# capacity = 5
# refill_per_second = 1
#
# To remove every rule once some are in force, leave this line alone:
# rule = []
";

/// The tenant whose burst the printed loop runs past, and its route.
const LOOP_TENANT: (&str, &str) = ("shop-b", "create-order");

/// Points the demo at a rules file of its own in the temporary directory
/// when the configured one is not on disk, so that `tollgate demo` runs
/// from any directory. The file is made without rules (every tenant gets
/// the default rule) only when it does not exist yet: rules added to
/// it in an earlier demo stay, and an existing file is never written
/// through (nor a link planted at its name followed).
///
/// # Errors
/// When the file can neither be created nor found.
pub fn without_rules_file(config: &mut crate::config::Config) -> std::io::Result<()> {
    use std::io::Write as _;

    use crate::config::RuleSource;

    if let RuleSource::File(path) = &config.rules.source
        && !path.exists()
    {
        let fallback = std::env::temp_dir().join("tollgate-demo-rules.toml");
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&fallback)
        {
            Ok(mut file) => {
                file.write_all(NO_RULES.as_bytes())?;
                println!(
                    "{} not found: no rules, every tenant gets the default rule; \
                     rules added to {} apply within seconds",
                    path.display(),
                    fallback.display()
                );
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => println!(
                "{} not found: using the rules in {}, kept from an earlier demo \
                 (edits there apply within seconds)",
                path.display(),
                fallback.display()
            ),
            Err(e) => return Err(e),
        }
        config.rules.source = RuleSource::File(fallback);
    }
    Ok(())
}

/// Runs the demo: an echo upstream plus one gateway on `config`, using
/// Redis when one answers at the configured URL and local-only limiting
/// otherwise. Stops on Ctrl-C.
///
/// # Errors
/// When a port is taken or the gateway fails to start.
pub async fn run(mut config: crate::config::Config) -> anyhow::Result<()> {
    use crate::config::{RedisTarget, RuleSource, redact_url};
    use anyhow::Context as _;

    // Enough requests to run past the loop tenant's burst, whatever the
    // rules file gives it, and what its refill adds while the loop runs
    // (a curl process a request: allow two seconds).
    let (burst, refill) = match &config.rules.source {
        RuleSource::File(path) => crate::rules::file::load(path).ok().and_then(|file| {
            file.rules
                .iter()
                .find(|r| (r.tenant.as_str(), r.route.as_str()) == LOOP_TENANT)
                .filter(|r| r.limit.bucket)
                .map(|r| (r.limit.capacity.get(), r.limit.refill_per_second.get()))
        }),
        RuleSource::Database(_) => None,
    }
    .unwrap_or((
        config.default_rule.capacity.get(),
        config.default_rule.refill_per_second.get(),
    ));
    let loops = burst
        .saturating_add(refill.saturating_mul(2))
        .saturating_add(3);

    let redis_line = match config.redis.target.clone() {
        RedisTarget::Single(url) if redis_answers(&url).await => {
            format!("Redis at {} (limits shared cluster-wide)", redact_url(&url))
        }
        RedisTarget::Single(url) => {
            config.redis.target = RedisTarget::LocalOnly;
            format!(
                "NO REDIS answered at {}: LOCAL-ONLY limiting in this process.\n\
                 !!! Limits are not shared between instances. Start redis-server for the real thing. !!!",
                redact_url(&url)
            )
        }
        RedisTarget::LocalOnly => "LOCAL-ONLY limiting (redis.url is empty)".to_owned(),
        RedisTarget::Cluster(_) => "a Redis Cluster".to_owned(),
        RedisTarget::Sentinel { master, .. } => format!("the primary {master:?} found by Sentinel"),
    };

    let upstream_addr = config
        .routes
        .first()
        .map(|r| r.upstream_origin.trim_start_matches("http://").to_owned())
        .context("the demo config has no routes")?;
    let upstream_listener = TcpListener::bind(&upstream_addr)
        .with_context(|| format!("cannot start the demo upstream on {upstream_addr}"))?;
    let served = actix_web::rt::spawn(upstream::serve(upstream_listener));

    let listeners = crate::app::Listeners::bind(&config)?;
    let gw = listeners.proxy_addr()?;
    let admin = listeners.admin_addr()?;
    let rls = listeners.rls_addr().map_or_else(
        || "off".to_owned(),
        |a| format!("{a} (gRPC ShouldRateLimit; descriptor entries api_key and route)"),
    );
    let check = listeners.check_addr().map_or_else(
        || "off".to_owned(),
        |a| format!("http://{a} (POST /v1/check, /v1/auth)"),
    );
    let check_line = listeners.check_addr().map_or_else(String::new, |a| {
        format!(
            "  curl -s -X POST -d '{{\"tenant\":\"shop-a\",\"route\":\"create-order\"}}' http://{a}/v1/check   # the decision alone\n\
             \x20 curl -s -X POST -d '{{\"tenant\":\"shop-a\",\"route\":\"chat\",\"cost\":0}}' http://{a}/v1/charge   # what is left of the token budget\n"
        )
    });
    println!(
        "\ntollgate demo\n\
         =============\n\
         gateway  http://{gw}\n\
         admin    http://{admin}\n\
         upstream http://{upstream_addr} (built-in: an echo, and an LLM-like stream at /v1/chat)\n\
         rls      {rls}\n\
         check    {check}\n\
         buckets  {redis_line}\n\
         rules    {rules}\n\n\
         Try:\n\
         \x20 curl -i -X POST -H 'X-Api-Key: shop-a' http://{gw}/orders\n\
         \x20 for i in $(seq {loops}); do curl -s -o /dev/null -w '%{{http_code}} ' -X POST -H 'X-Api-Key: {tenant}' http://{gw}/orders; done; echo\n\
         \x20 curl -i http://{gw}/orders/42                      # 401: no X-Api-Key\n\
         \x20 curl -i -H 'X-Api-Key: {{bad}}' http://{gw}/orders/42  # 400: malformed key\n\
         \x20 curl -si -H 'X-Api-Key: shop-c' http://{gw}/search | grep -i ratelimit  # a burst limit and a daily quota\n\
         {check_line}\
         \x20 # An LLM-like API: shop-a's budget of 2,000 tokens drains by what each answer used, and refills at 50/s\n\
         \x20 for i in $(seq 12); do curl -s -o /dev/null -w '%{{http_code}} ' -H 'X-Api-Key: shop-a' http://{gw}/v1/chat; done; echo\n\
         \x20 for i in 1 2 3; do curl -s -o /dev/null -w '%{{http_code}} ' -H 'X-Api-Key: shop-a' http://{gw}/v1/chat & done; wait; echo  # two at once\n\
         \x20 curl -s http://{admin}/ready\n\
         \x20 curl -s http://{admin}/metrics | grep tollgate_requests_total\n\n\
         Edit the rules file and the change applies within seconds. Ctrl-C stops.\n",
        tenant = LOOP_TENANT.0,
        rules = match &config.rules.source {
            RuleSource::File(p) => p.display().to_string(),
            RuleSource::Database(_) => "PostgreSQL (rules.database_url)".to_owned(),
        },
    );

    let result = crate::app::run(config, listeners, crate::app::shutdown_signal()).await;
    served.abort();
    result
}

/// Whether a Redis server answers PING at `url` within a moment.
async fn redis_answers(url: &str) -> bool {
    let probe = async {
        let client = redis::Client::open(url).ok()?;
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .ok()
    };
    matches!(
        tokio::time::timeout(std::time::Duration::from_millis(500), probe).await,
        Ok(Some(_))
    )
}
