//! One slow business transaction stalls no other key. An upstream completes its runs in its own
//! PostgreSQL transaction (`idem_complete`) and then holds that transaction open (a slow provider
//! call inside it): the record's row stays locked until it commits. Copies of its key, other keys,
//! the run's own lease renewals, its release after the run timeout and an operator's delete must
//! neither queue on that lock nor undo the run. Real `idem serve` and `idem` processes on
//! PostgreSQL; the upstream is this test's, on a real socket.

mod common;
mod servers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Gateway, Reply, client, describe, run_idem, send};
use tokio::sync::Notify;

/// How long a run holds its transaction open after `idem_complete`, in milliseconds (`0`: it
/// commits at once).
const HOLD: &str = "x-hold-ms";

#[derive(Clone)]
struct Upstream {
    database: String,
    schema: String,
    /// Runs that started (a ledger row written).
    runs: Arc<AtomicUsize>,
    /// Runs whose `idem_complete` was refused.
    refused: Arc<AtomicUsize>,
    /// Runs that committed.
    committed: Arc<AtomicUsize>,
    /// Notified when a run has called `idem_complete` and holds its transaction open.
    holding: Arc<Notify>,
}

impl Upstream {
    async fn start(database: String, schema: String) -> (Self, String) {
        let client = connect(&database).await;
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS \"{schema}\".ledger (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL)"
            ))
            .await
            .expect("create the ledger");
        let upstream = Self {
            database,
            schema,
            runs: Arc::default(),
            refused: Arc::default(),
            committed: Arc::default(),
            holding: Arc::default(),
        };
        let app = axum::Router::new()
            .route("/pay", post(serve_pay))
            .with_state(upstream.clone());
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        (upstream, format!("http://{addr}"))
    }

    async fn ledger_rows(&self, key: &str) -> i64 {
        connect(&self.database)
            .await
            .query_one(
                &format!("SELECT count(*) FROM \"{}\".ledger WHERE key = $1", self.schema),
                &[&key],
            )
            .await
            .expect("count the ledger")
            .get(0)
    }

    /// The connections of the gateways (named `application_name`) that wait on a lock or run a
    /// statement now.
    async fn busy_store_connections(&self, application_name: &str) -> Vec<String> {
        connect(&self.database)
            .await
            .query(
                "SELECT state || ' ' || COALESCE(wait_event_type, '-') || ': ' || query FROM pg_stat_activity
                 WHERE application_name = $1 AND (state = 'active' OR wait_event_type = 'Lock')",
                &[&application_name],
            )
            .await
            .expect("read pg_stat_activity")
            .iter()
            .map(|row| row.get(0))
            .collect()
    }
}

async fn connect(database: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(database, tokio_postgres::NoTls)
        .await
        .expect("connect to PostgreSQL");
    tokio::spawn(connection);
    client
}

/// `POST /pay`: a ledger row and `idem_complete` in one transaction, held open as the request's
/// `x-hold-ms` says, then committed. The run goes on in a task of its own when its caller goes
/// away, as an upstream process would.
async fn serve_pay(State(upstream): State<Upstream>, headers: HeaderMap) -> Response {
    match tokio::spawn(run(upstream, headers)).await {
        Ok(response) => response,
        Err(died) => std::panic::resume_unwind(died.into_panic()),
    }
}

async fn run(upstream: Upstream, headers: HeaderMap) -> Response {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default();
    let hold = Duration::from_millis(header(HOLD).parse().unwrap_or(0));
    let (token, key) = (
        header("idempotency-token").to_owned(),
        header("idempotency-key").to_owned(),
    );
    upstream.runs.fetch_add(1, Ordering::SeqCst);
    let mut client = connect(&upstream.database).await;
    let tx = client.transaction().await.expect("begin");
    tx.execute(
        &format!("INSERT INTO \"{}\".ledger (key) VALUES ($1)", upstream.schema),
        &[&key],
    )
    .await
    .expect("the ledger row");
    let completed = tx
        .execute(
            &format!(
                "SELECT \"{}\".idem_complete($1, 201, '{{\"Content-Type\": \"application/json\"}}'::jsonb, $2)",
                upstream.schema
            ),
            &[&token, &&br#"{"charged":true}"#[..]],
        )
        .await;
    if completed.is_err() {
        upstream.refused.fetch_add(1, Ordering::SeqCst);
        drop(tx.rollback().await);
        return (StatusCode::CONFLICT, "refused").into_response();
    }
    if !hold.is_zero() {
        upstream.holding.notify_one();
        tokio::time::sleep(hold).await;
    }
    tx.commit().await.expect("commit");
    upstream.committed.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        r#"{"charged":true}"#,
    )
        .into_response()
}

/// A migrated store in a schema of its own (its pooled connections named `application_name`,
/// `pool_size` of them), and an upstream on its database.
async fn set_up(pool_size: usize) -> (String, Upstream, String, String) {
    let store = servers::postgres_url();
    let (database, schema) = store.split_once("?schema=").expect("a schema option");
    let migrated = common::run_idem(&["migrate", "--store", &store], Duration::from_secs(60)).await;
    assert!(migrated.status.success(), "{}", describe(&migrated));
    let application_name = format!("gw_{schema}");
    let store = format!("{store}&pool_size={pool_size}&application_name={application_name}");
    let (upstream, url) = Upstream::start(database.to_owned(), schema.to_owned()).await;
    (store, upstream, url, application_name)
}

fn pay(gateway: &Gateway, key: &str, hold: Duration) -> reqwest::RequestBuilder {
    client()
        .post(gateway.url("/pay"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .header(HOLD, hold.as_millis().to_string())
        .body("{}")
}

/// Sends the first request of `key`, holding its transaction for `hold`, and returns once its
/// run has completed the record in that transaction (which is still open).
async fn start_slow_run(
    gateway: &Gateway,
    upstream: &Upstream,
    key: &str,
    hold: Duration,
) -> tokio::task::JoinHandle<Reply> {
    let holding = upstream.holding.notified();
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

/// The issue's first case, at the scale of a test: the slow run's copies outnumber the pool's
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
        upstream.committed.load(Ordering::SeqCst),
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
    assert_eq!(upstream.runs.load(Ordering::SeqCst), 4, "the slow key ran once");
    assert_eq!(upstream.ledger_rows("slow").await, 1);
    wait_until("no pooled connection left busy", async || {
        upstream.busy_store_connections(&application_name).await.is_empty()
    })
    .await;
}

/// The issue's second case: a copy that finds the run's lease ended while the run's own
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
    assert_eq!(upstream.runs.load(Ordering::SeqCst), 1, "never taken over");
    assert_eq!(upstream.ledger_rows("k1").await, 1);
}

/// The issue's third case: `idem delete` on a key whose run is completing in its transaction
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
    assert_eq!(upstream.runs.load(Ordering::SeqCst), 1);
    assert_eq!(upstream.ledger_rows("k1").await, 1, "no second ledger row");
}

/// The issue's fourth case: a run given up at its run timeout while its transaction is still
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
    wait_until("the slow transaction committed", async || {
        upstream.committed.load(Ordering::SeqCst) == 1
    })
    .await;
    let retry = send(pay(&gateway, "k1", Duration::ZERO)).await;
    assert!(retry.replayed(), "the answer its transaction committed: {retry}");
    assert_eq!(upstream.runs.load(Ordering::SeqCst), 1);
    assert_eq!(upstream.ledger_rows("k1").await, 1);
}
