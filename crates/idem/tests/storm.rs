//! The storm: faults injected at random between idem and its store, under load, on every store —
//! the way users meet them. Two `idem serve` instances share a store; 16 clients pay 320 payments
//! through them, retrying as `idem-client` does (a quarter of the payments are sent twice at once,
//! once to each instance); meanwhile at least 100 faults strike the store's connections.
//!
//! * PostgreSQL and Redis sit behind a TCP fault relay (`idem_test_support::relay`): connections
//!   reset before a command reaches the server, or after the server executed it (its reply lost),
//!   latency spikes, and black holes of 2–3.5 s.
//! * The Redis Cluster is a private one whose nodes announce relays (`idem_test_support::cluster`),
//!   so the same faults strike it, one node at a time.
//! * SQLite has no connection to break: a neighbour holds the database's write lock, briefly and
//!   often, sometimes for half a second, twice for longer than the store timeout.
//!
//! Whatever strikes: every payment ends 2xx; no key runs twice without `Idempotency-Recovered:
//! true`; every 2xx for a key has one body (a replay from the other instance afterwards too); the
//! only 5xx clients see are 502/503/504; both instances are alive and ready once the faults stop.
//! The faults come from a seed printed at the start; `IDEM_STORM_SEED=N` replays its schedule
//! (the interleaving with traffic is up to the machine). Run it with
//! `cargo test -p idem --all-features --test storm -- --nocapture` to see the figures
//! (`IDEM_STORM_LOGS=DIR` keeps the gateways' logs).

mod common;

/// The scenario every storm runs (`tests/storm/scenario.rs`), and the failovers of replicated
/// Redis stores (`tests/storm/failover.rs`).
mod storm {
    pub(crate) mod failover;
    pub(crate) mod scenario;
}

use std::path::Path;
use std::time::Duration;

use idem_test_support::cluster::RelayedCluster;
use idem_test_support::relay::Relay;
use idem_test_support::seed::Rng;
use idem_test_support::servers;
use idem_test_support::storm::{self as faults, StormPlan};
use storm::scenario::{MIN_FAULTS, scenario};

/// How long faults strike the relayed stores; the payments are spread over the same time.
const RELAY_STORM: Duration = Duration::from_secs(30);
/// How long the neighbour holds SQLite's write lock on and off.
const SQLITE_STORM: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// The stores
// ---------------------------------------------------------------------------------------------

/// The storm on the server at `base` behind one fault relay: the store is `base` through the relay,
/// with `options`.
async fn relayed_storm(name: &str, base: &str, options: &str) {
    let relay = Relay::start(servers::socket_addr(base)).await;
    let store = servers::with_options(&servers::with_addr(base, relay.addr()), options);
    // Borrowed by the storm: the relay outlives it (dropped, it would stop relaying).
    let relay = &relay;
    scenario(name, &store, RELAY_STORM, MIN_FAULTS, |mut rng| async move {
        let faults = faults::run(&[relay], &mut rng, &StormPlan::over(RELAY_STORM)).await;
        (faults.total(), format!("{faults}, {} writes relayed", relay.chunks()))
    })
    .await;
}

/// PostgreSQL, then Redis, each behind a relay, under a schema or key prefix of the test's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storms_on_postgres_and_redis() {
    let (postgres, redis) = (servers::postgres_url(), servers::redis_url());
    let (schema, prefix) = (servers::unique_name("idem_test"), servers::unique_name("idem-storm"));
    let _cleanup = (
        servers::Cleanup::postgres_schema(&postgres, &schema),
        servers::Cleanup::redis_keys(&redis, &prefix),
    );
    let stores = [
        // Every `begin` reads first on the shared read connections, which the faults strike too;
        // a new key then claims on the pool, so both paths are in the storm.
        ("postgres", &postgres, format!("schema={schema}&read_first=always")),
        ("redis", &redis, format!("prefix={prefix}")),
    ];
    for (name, base, options) in stores {
        relayed_storm(name, base, &options).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_on_redis_cluster() {
    let cluster = RelayedCluster::start().await;
    let store = format!("{}/?prefix=idem-storm", cluster.url());
    let cluster = &cluster;
    scenario("redis-cluster", &store, RELAY_STORM, MIN_FAULTS, |mut rng| async move {
        let faults = faults::run(&cluster.relays(), &mut rng, &StormPlan::over(RELAY_STORM)).await;
        (faults.total(), format!("{faults}, each on one of the 3 nodes"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_on_sqlite() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = common::store_url_in(dir.path());
    let path = dir.path().join("idem.db");
    scenario("sqlite", &store, SQLITE_STORM, MIN_FAULTS, |rng| async move {
        let holds = tokio::task::spawn_blocking(move || neighbour(&path, rng, SQLITE_STORM))
            .await
            .expect("the neighbour");
        (holds.total(), holds.to_string())
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// SQLite's neighbour
// ---------------------------------------------------------------------------------------------

/// The write-lock holds of the neighbour, by length.
#[derive(Debug, Default)]
struct Holds {
    /// 5–50 ms: writes wait a moment.
    short: usize,
    /// 0.2–0.6 s: latency spikes.
    stalls: usize,
    /// 6–7.5 s: past the 5 s store timeout, the store is down for idem.
    outages: usize,
}

impl Holds {
    fn total(&self) -> usize {
        self.short + self.stalls + self.outages
    }
}

impl std::fmt::Display for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} faults (write lock held by a neighbour: {} times for 5-50 ms, {} for 0.2-0.6 s, {} for 6-7.5 s, past the store timeout)",
            self.total(),
            self.short,
            self.stalls,
            self.outages
        )
    }
}

/// Takes the database's write lock over and over for `duration` (as a neighbour process writing
/// to the same file would), on the seed's schedule: mostly briefly, sometimes for a while, and
/// twice for longer than the store timeout (not SQLite's 10 s busy timeout: idem's writes wait,
/// they do not fail).
fn neighbour(path: &Path, mut rng: Rng, duration: Duration) -> Holds {
    let conn = rusqlite::Connection::open(path).expect("open the gateways' SQLite file");
    conn.busy_timeout(Duration::from_secs(30)).expect("busy timeout");
    let started = std::time::Instant::now();
    let mut outages: Vec<Duration> = vec![duration / 4, duration * 5 / 8];
    outages.reverse();
    let mut holds = Holds::default();
    loop {
        std::thread::sleep(rng.between(Duration::from_millis(15), Duration::from_millis(75)));
        let elapsed = started.elapsed();
        if elapsed >= duration {
            return holds;
        }
        let hold = if outages.last().is_some_and(|&at| elapsed >= at) {
            outages.pop();
            holds.outages += 1;
            rng.between(Duration::from_millis(6000), Duration::from_millis(7500))
        } else if rng.chance(0.1) {
            holds.stalls += 1;
            rng.between(Duration::from_millis(200), Duration::from_millis(600))
        } else {
            holds.short += 1;
            rng.between(Duration::from_millis(5), Duration::from_millis(50))
        };
        conn.execute_batch("BEGIN IMMEDIATE").expect("take the write lock");
        std::thread::sleep(hold);
        conn.execute_batch("COMMIT").expect("give the write lock back");
    }
}
