//! One slow business transaction stalls no other key. An upstream completes its runs in its own
//! PostgreSQL transaction (`idem_complete`) and then holds that transaction open (a slow provider
//! call inside it): the record's row stays locked until it commits. Copies of its key, other keys,
//! the run's own lease renewals, its release after the run timeout and an operator's delete must
//! neither queue on that lock nor undo the run. Real `idem serve` and `idem` processes on
//! PostgreSQL; the upstream is the tests' ledger (`common/ledger.rs`), on a real socket.

mod common;

use std::time::Duration;

use common::ledger::{HOLD_HEADER, Ledger};
use common::{Gateway, Reply, client, describe, run_idem, send};
use idem_test_support::postgres_store;

/// A migrated store in a schema of its own (its pooled connections named `application_name`,
/// `pool_size` of them), and an upstream on its database.
async fn set_up(pool_size: usize) -> (String, Ledger, String, String) {
    let store = postgres_store::store_url();
    let (database, schema) = store.split_once("?schema=").expect("a schema option");
    let migrated = common::run_idem(&["migrate", "--store", &store], Duration::from_secs(60)).await;
    assert!(migrated.status.success(), "{}", describe(&migrated));
    let application_name = format!("gw_{schema}");
    let store = format!("{store}&pool_size={pool_size}&application_name={application_name}");
    let upstream = Ledger::start(database, schema, 16, true).await;
    let url = upstream.url.clone();
    (store, upstream, url, application_name)
}

fn pay(gateway: &Gateway, key: &str, hold: Duration) -> reqwest::RequestBuilder {
    client()
        .post(gateway.url("/pay"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .header(HOLD_HEADER, hold.as_millis().to_string())
        .body("{}")
}

/// Sends the first request of `key`, holding its transaction for `hold`, and returns once its
/// run has completed the record in that transaction (which is still open).
async fn start_slow_run(
    gateway: &Gateway,
    upstream: &Ledger,
    key: &str,
    hold: Duration,
) -> tokio::task::JoinHandle<Reply> {
    let holding = upstream.holding();
    let first = tokio::spawn(send(pay(gateway, key, hold)));
    holding.await;
    first
}

async fn wait_until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The first case, at the scale of a test: the slow run's copies outnumber the pool's
/// connections, yet every other key is answered while the slow transaction is still open, and
/// the copies get its answer once it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_open_transaction_and_its_copies_stall_no_other_key() {
    let (store, upstream, url, application_name) = set_up(4).await;
    // The store timeout is the default 5 s: the slow transaction outlasts it.
    let args = ["--in-transaction", "--lease", "1s", "--wait", "20s"];
    let gateway = Gateway::start_on_store(&url, &store, &args).await;
    let hold = Duration::from_secs(9);
    let first = start_slow_run(&gateway, &upstream, "slow", hold).await;
    let copies: Vec<_> = (0..12)
        .map(|_| tokio::spawn(send(pay(&gateway, "slow", Duration::ZERO))))
        .collect();
    // The copies are waiting (past the slow run's lease: it is not renewed while its row is
    // locked, and none of them takes it over).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let others: Vec<_> = (0..3)
        .map(|i| tokio::spawn(send(pay(&gateway, &format!("other-{i}"), Duration::ZERO))))
        .collect();
    for other in others {
        let other = other.await.expect("the request");
        assert_eq!(
            other.status, 201,
            "another key is answered while the slow run holds its lock: {other}"
        );
    }
    assert_eq!(
        upstream.committed(),
        3,
        "the other keys were answered before the slow transaction committed"
    );
    let first = first.await.expect("the first request");
    assert_eq!(first.status, 201, "{first}");
    for copy in copies {
        let copy = copy.await.expect("a copy");
        assert_eq!(copy.status, 201, "every copy gets the slow run's answer: {copy}");
        assert!(copy.replayed(), "{copy}");
    }
    assert_eq!(upstream.started(), 4, "the slow key ran once");
    assert_eq!(upstream.rows_of("slow").await, 1);
    wait_until("no pooled connection left busy", async || {
        postgres_store::busy_connections(&upstream.database, &application_name)
            .await
            .is_empty()
    })
    .await;
}

/// The second case: a copy that finds the run's lease ended while the run's own
/// transaction holds the record gets the run's answer, not `503`, and does not take it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_a_run_alive_in_its_transaction_waits_for_its_answer() {
    let (store, upstream, url, _) = set_up(16).await;
    let args = ["--in-transaction", "--lease", "1s", "--wait", "20s"];
    let gateway = Gateway::start_on_store(&url, &store, &args).await;
    // Longer than the lease and than the store timeout (5 s) after the copy arrives.
    let first = start_slow_run(&gateway, &upstream, "k1", Duration::from_secs(8)).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let copy = send(pay(&gateway, "k1", Duration::ZERO)).await;
    assert_eq!(copy.status, 201, "{copy}");
    assert!(copy.replayed(), "{copy}");
    assert_eq!(first.await.expect("the first request").status, 201);
    assert_eq!(upstream.started(), 1, "never taken over");
    assert_eq!(upstream.rows_of("k1").await, 1);
}

/// The third case: `idem delete` on a key whose run is completing in its transaction
/// neither waits for it nor deletes the answer it commits: it says so and exits non-zero, and the
/// retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_delete_never_waits_on_a_run_nor_undoes_it() {
    let (store, upstream, url, _) = set_up(16).await;
    let gateway = Gateway::start_on_store(&url, &store, &["--in-transaction"]).await;
    let first = start_slow_run(&gateway, &upstream, "k1", Duration::from_secs(4)).await;
    let deleted = run_idem(&["delete", "--store", &store, "k1"], Duration::from_secs(3)).await;
    assert_eq!(deleted.status.code(), Some(1), "{}", describe(&deleted));
    let stderr = String::from_utf8_lossy(&deleted.stderr);
    assert!(
        stderr.contains("nothing was deleted") && stderr.contains("completing in its own transaction"),
        "{stderr}"
    );
    assert_eq!(first.await.expect("the first request").status, 201);
    let retry = send(pay(&gateway, "k1", Duration::ZERO)).await;
    assert!(retry.replayed(), "the answer its transaction committed: {retry}");
    assert_eq!(upstream.started(), 1);
    assert_eq!(upstream.rows_of("k1").await, 1, "no second ledger row");
}

/// The fourth case: a run given up at its run timeout while its transaction is still
/// open is answered so (not "nothing of it stands"), and the retry replays what it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_given_up_while_its_transaction_is_open_says_so() {
    let (store, upstream, url, _) = set_up(16).await;
    let args = ["--in-transaction", "--run-timeout", "1s"];
    let gateway = Gateway::start_on_store(&url, &store, &args).await;
    let given_up = send(pay(&gateway, "k1", Duration::from_secs(3))).await;
    assert_eq!(given_up.status, 504, "{given_up}");
    let detail = given_up.detail();
    assert!(
        detail.contains("its transaction was still open") && !detail.contains("nothing of it stands"),
        "{detail}"
    );
    wait_until("the slow transaction committed", async || upstream.committed() == 1).await;
    let retry = send(pay(&gateway, "k1", Duration::ZERO)).await;
    assert!(retry.replayed(), "the answer its transaction committed: {retry}");
    assert_eq!(upstream.started(), 1);
    assert_eq!(upstream.rows_of("k1").await, 1);
}
