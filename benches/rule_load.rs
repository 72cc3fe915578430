//! How long 100,000 rules take to load from PostgreSQL, and how much memory
//! the snapshot holds.
//!
//! Creates a throwaway database on the local server (`TOLLGATE_TEST_POSTGRES`,
//! default `postgres://postgres@127.0.0.1:5432`), migrates it, inserts the
//! rules with one `generate_series`, then times the cache's full-load path
//! (query + snapshot build) and measures the snapshot's heap bytes with a
//! counting allocator. Run: `cargo bench --bench rule_load`.

#![allow(clippy::unwrap_used)] // Bench code: a failed unwrap is a failed run.

use std::alloc::{GlobalAlloc, Layout, System};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use tollgate::clock::{Clock, SystemClock};
use tollgate::db::{Database, RuleStore};
use tollgate::rules::model::SnapshotOrigin;
use tollgate::rules::{Limit, RuleSet};

/// Counts live heap bytes.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// GlobalAlloc is an unsafe trait; this wrapper only forwards to System.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const RULES: u32 = 100_000;
const ROUNDS: usize = 5;

fn psql(url: &str, sql: &str) {
    let status = Command::new("psql")
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-c", sql])
        .status()
        .expect("psql runs (apt-get install -y postgresql-client)");
    assert!(status.success(), "psql failed: {sql}");
}

fn main() {
    let server = std::env::var("TOLLGATE_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned());
    let name = format!("tollgate_bench_{}", std::process::id());
    psql(
        &format!("{server}/postgres"),
        &format!("CREATE DATABASE {name}"),
    );
    let url = format!("{server}/{name}");
    let result = std::panic::catch_unwind(|| run(&url));
    psql(
        &format!("{server}/postgres"),
        &format!("DROP DATABASE {name} WITH (FORCE)"),
    );
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

fn run(url: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _context = rt.enter();
    let store = RuleStore::new(Database::connect_lazy(url).unwrap());
    rt.block_on(store.database().migrate()).unwrap();
    println!("inserting {RULES} rules (100,000 tenants over 4 routes)…");
    psql(
        url,
        &format!(
            "INSERT INTO rate_limit_rule (tenant_id, route_id, capacity, refill_per_second) \
             SELECT 'tenant-' || g, 'route-' || (g % 4), 100 + g % 900, 10 + g % 90 \
             FROM generate_series(1, {RULES}) g"
        ),
    );

    let default = Limit::new(20.try_into().unwrap(), 10.try_into().unwrap());
    let origin = SnapshotOrigin {
        source: "database",
        loaded_at_unix: 0,
    };
    let clock = SystemClock::new();
    let mut times = Vec::new();
    let mut snapshot = None;
    for round in 1..=ROUNDS {
        let start = clock.now_micros();
        let rules = rt.block_on(store.load_all()).unwrap();
        let set = RuleSet::new(rules, default, origin);
        let ms = (clock.now_micros() - start) as f64 / 1000.0;
        assert_eq!(set.len(), RULES as usize);
        println!("round {round}: full load {ms:.0} ms");
        times.push(ms);
        snapshot = Some(set);
    }
    times.sort_by(f64::total_cmp);

    let set = snapshot.unwrap();
    let lookups = 1_000_000u32;
    let start = clock.now_micros();
    let mut hits = 0u32;
    for i in 0..lookups {
        let tenant = format!("tenant-{}", i % RULES + 1);
        hits += u32::from(set.rule_for(&tenant, "route-1").is_some());
    }
    let lookup_ns = (clock.now_micros() - start) as f64 * 1000.0 / f64::from(lookups);

    let live = LIVE.load(Ordering::Relaxed);
    drop(set);
    let snapshot_bytes = live - LIVE.load(Ordering::Relaxed);
    rt.block_on(store.database().close());

    println!();
    println!("rules                                  {RULES}");
    println!(
        "full load (query + snapshot), median   {:.0} ms   (goal < 2000 ms)",
        times[ROUNDS / 2]
    );
    println!(
        "snapshot heap                          {:.1} MB   (goal < 50 MB)",
        snapshot_bytes as f64 / 1e6
    );
    println!(
        "heap per rule                          {} bytes",
        snapshot_bytes / RULES as usize
    );
    println!("lookup incl. key formatting            {lookup_ns:.0} ns ({hits} hits)");
}
