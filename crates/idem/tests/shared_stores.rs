//! The stores several `idem serve` processes share: PostgreSQL, Redis, Redis Cluster, and one
//! SQLite file (as pods behind a load balancer on one host). Each scenario of `scenarios/` runs on
//! every store that supports it, a test each (`crashed_holder_is_taken_over::postgres`, …); the
//! outage tests start, kill and restart private servers.

mod common;
mod scenarios;

use idem_test_support::private::{PrivatePostgres, PrivateRedis};
use idem_test_support::{postgres_store, redis_store};

/// The store of one test's gateways, and the directory its SQLite file lives in (removed with it).
struct Store {
    url: String,
    _dir: Option<tempfile::TempDir>,
}

impl Store {
    fn postgres() -> Self {
        Self::shared(postgres_store::store_url())
    }

    fn redis() -> Self {
        Self::shared(redis_store::store_url())
    }

    fn redis_cluster() -> Self {
        Self::shared(redis_store::cluster_store_url())
    }

    fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        Self {
            url: common::store_url_in(dir.path()),
            _dir: Some(dir),
        }
    }

    fn shared(url: String) -> Self {
        Self { url, _dir: None }
    }
}

/// A module per scenario, a test in it per store that runs it: `scenarios::$scenario` on a fresh
/// `Store::$store()`.
macro_rules! scenarios {
    ($($scenario:ident: $($store:ident),+;)+) => {
        $(
            mod $scenario {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $store() {
                        let store = super::Store::$store();
                        super::scenarios::$scenario(&store.url).await;
                    }
                )+
            }
        )+
    };
}

scenarios! {
    sixty_copies_over_three_instances_run_once: postgres, redis, redis_cluster;
    fifty_copies_over_two_instances_run_once: sqlite;
    crashed_holder_is_taken_over: postgres, redis, redis_cluster, sqlite;
    a_skewed_clock_never_takes_over_a_healthy_run: postgres, redis, redis_cluster;
    list_answers_an_investigations_questions: postgres, redis, redis_cluster, sqlite;
    operator_commands_work: postgres, redis, redis_cluster, sqlite;
    delete_in_flight_marks_the_next_run_recovered: postgres, redis, sqlite;
    a_delete_reaches_every_gateways_replay_cache: postgres, redis, redis_cluster, sqlite;
    a_cached_answer_stops_at_its_expiry: postgres, redis, sqlite;
    a_stopped_gateway_forgets_what_was_deleted_while_it_slept: postgres, redis, sqlite;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_fails_closed_and_recovers() {
    let server = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .expect("start PostgreSQL");
    let url = server.url();
    let server = std::sync::Arc::new(server);
    let (k, r) = (server.clone(), server.clone());
    scenarios::outage_fails_closed_and_recovers(
        &url,
        async move || tokio::task::spawn_blocking(move || k.kill()).await.expect("kill"),
        async move || tokio::task::spawn_blocking(move || r.restart()).await.expect("restart"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_fails_closed_and_recovers() {
    let server = std::sync::Arc::new(std::sync::Mutex::new(PrivateRedis::start()));
    let url = server.lock().expect("lock").url();
    let (k, r) = (server.clone(), server.clone());
    scenarios::outage_fails_closed_and_recovers(
        &url,
        async move || {
            tokio::task::spawn_blocking(move || k.lock().expect("lock").kill())
                .await
                .expect("kill")
        },
        async move || {
            tokio::task::spawn_blocking(move || r.lock().expect("lock").restart())
                .await
                .expect("restart")
        },
    )
    .await;
}

/// `idem serve` says at start what the PostgreSQL server's settings can lose, once: here a
/// `synchronous_commit = off` set in the store URL, which a crash of the server can lose commits
/// with, and the default, on a server without standbys, which no failover can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_start_up_log_says_what_the_server_can_lose() {
    let upstream = common::Upstream::start().await;
    let off = format!("{}&options=-c%20synchronous_commit%3Doff", postgres_store::store_url());
    let gateway = common::Gateway::start_on_store(&upstream.url(), &off, &[]).await;
    let log = gateway.stderr();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("WARN") && line.contains("synchronous_commit = off: a crash of the server"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning about synchronous_commit = off:\n{log}");

    let gateway = common::Gateway::start_on_store(&upstream.url(), &postgres_store::store_url(), &[]).await;
    let log = gateway.stderr();
    assert!(
        log.lines()
            .any(|line| line.contains("INFO") && line.contains("no PostgreSQL standby streams from this server")),
        "the start-up log says the server has no standby:\n{log}"
    );
    assert!(!log.contains("synchronous_commit = off"), "{log}");
}
