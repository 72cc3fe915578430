//! A changed rules file takes effect without a restart; an invalid one, or
//! one caught mid-rewrite, is never taken, and rewriting the rules in
//! force does no work. Each check reads this gateway's own `/ready`.

#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use common::{Stack, assert_limit_becomes, eventually, limit_of, ready, wait_for_limit};

fn rules(capacity: u32) -> String {
    format!(
        "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\ncapacity = {capacity}\nrefill_per_second = 1\n"
    )
}

/// This gateway's `rules.<field>` in `/ready`.
async fn rules_field(s: &Stack, field: &str) -> u64 {
    ready(&s.gw).await["rules"][field].as_u64().unwrap()
}

/// The limit tenant `acme` gets now.
async fn acme_limit(s: &Stack) -> Option<String> {
    limit_of(&s.gw, "acme").await
}

/// Waits up to `within` for this gateway's `rules.<field>` in `/ready` to
/// be `value`.
async fn field_becomes(s: &Stack, field: &str, value: u64, within: Duration) -> bool {
    eventually(within, || async { rules_field(s, field).await == value }).await
}

/// A gateway that looks at its rules file every 100 ms and takes a change
/// once it has held still for 200 ms.
fn quick_watch(tag: &str, capacity: u32) -> Stack {
    Stack::start(tag, &rules(capacity), |c, _| {
        c.rules_extra = "watch_interval_ms = 100\nsettle_ms = 200".into();
    })
}

fn rules_path(s: &Stack) -> std::path::PathBuf {
    s.dir.0.join("rules.toml")
}

/// Replaces the gateway's rules file with `contents` at once.
fn write_rules(s: &Stack, contents: impl AsRef<[u8]>) {
    std::fs::write(rules_path(s), contents).unwrap();
}

#[actix_web::test]
async fn a_changed_rules_file_applies_within_two_seconds_and_a_broken_one_is_refused() {
    // Default watch interval and settle time: the 2 s promise holds with
    // the defaults.
    let s = Stack::start("reload", &rules(5), |_, _| {});
    assert_eq!(acme_limit(&s).await.as_deref(), Some("5"));

    write_rules(&s, rules(12));
    let waited = wait_for_limit(&s.gw, "acme", "12", Duration::from_secs(2)).await;
    assert!(
        waited.is_some(),
        "the new capacity was not in force within 2 s"
    );
    assert_eq!(ready(&s.gw).await["rules"]["count"], 1);

    write_rules(
        &s,
        "[[rule]]\ntenant = \"acme\"\nroute = \"api\"\ncapacity = -3\nrefill_per_second = 1\n",
    );
    assert!(
        field_becomes(&s, "failed_reloads", 1, Duration::from_secs(5)).await,
        "the broken file was not looked at"
    );
    assert_eq!(
        acme_limit(&s).await.as_deref(),
        Some("12"),
        "a broken file must not apply"
    );
}

/// Writes `contents` to `path` the way `cat new > path` does: truncate,
/// then write in two parts with a pause (shorter than the settle time).
fn rewrite_in_place(path: &Path, contents: &str) {
    let mut file = std::fs::File::create(path).unwrap();
    let (head, tail) = contents.split_at(contents.len() / 2);
    file.write_all(head.as_bytes()).unwrap();
    file.flush().unwrap();
    std::thread::sleep(Duration::from_millis(60));
    file.write_all(tail.as_bytes()).unwrap();
}

#[actix_web::test]
async fn a_rules_file_caught_mid_rewrite_is_never_taken() {
    let s = quick_watch("reload-midway", 5);
    let new = format!("{}{}", rules(7), rules(7).replace("acme", "beta"));
    rewrite_in_place(&rules_path(&s), &new);
    assert_limit_becomes(&s.gw, "acme", "7", Duration::from_secs(3)).await;
    assert_eq!(rules_field(&s, "count").await, 2);
    assert_eq!(
        rules_field(&s, "reloads").await,
        1,
        "one reload, of the finished file"
    );
    assert_eq!(
        rules_field(&s, "failed_reloads").await,
        0,
        "the half-written file was never read"
    );

    // Truncated and left empty (a writer that died): refused, rules stay.
    write_rules(&s, "");
    assert!(
        field_becomes(&s, "failed_reloads", 1, Duration::from_secs(3)).await,
        "the emptied file was not looked at"
    );
    assert_eq!(rules_field(&s, "count").await, 2);
    assert_eq!(acme_limit(&s).await.as_deref(), Some("7"));
}

#[actix_web::test]
async fn a_file_that_says_rule_equals_empty_list_removes_every_rule() {
    let s = quick_watch("reload-empty", 5);
    write_rules(&s, "# every rule removed on purpose\nrule = []\n");
    assert!(
        field_becomes(&s, "count", 0, Duration::from_secs(3)).await,
        "rule = [] did not remove the rules"
    );
    assert_eq!(
        acme_limit(&s).await.as_deref(),
        Some("2"),
        "the default rule applies"
    );
}

#[actix_web::test]
async fn rewriting_the_rules_in_force_does_no_work() {
    let s = quick_watch("reload-same", 5);
    // Same contents, new modification time: looked at, not applied. A look
    // that does no work shows nothing to wait for, so give the watch (every
    // 100 ms, settling 200 ms) time to look before the real change.
    write_rules(&s, rules(5));
    std::thread::sleep(Duration::from_millis(600));
    // A real change afterwards is the one reload.
    write_rules(&s, rules(6));
    assert_limit_becomes(&s.gw, "acme", "6", Duration::from_secs(3)).await;
    assert_eq!(rules_field(&s, "reloads").await, 1);
    assert_eq!(rules_field(&s, "failed_reloads").await, 0);
}

#[actix_web::test]
async fn a_rules_file_naming_a_route_the_gateway_lacks_is_refused_at_reload() {
    let s = quick_watch("reload-unknown-route", 5);
    assert_eq!(acme_limit(&s).await.as_deref(), Some("5"));
    // A typo in the route: as check-config says, a rule that would never
    // apply. The whole file is refused and the rules in force stay.
    write_rules(&s, rules(9).replace("\"api\"", "\"apl\""));
    assert!(
        field_becomes(&s, "failed_reloads", 1, Duration::from_secs(5)).await,
        "the file naming route apl was not refused"
    );
    assert_eq!(acme_limit(&s).await.as_deref(), Some("5"));
}
