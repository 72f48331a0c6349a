//! The payments upstream of the contention storm: `POST /pay` writes a ledger row in a PostgreSQL
//! transaction, calls `idem_complete` with the run's `Idempotency-Token` in that transaction when
//! the gateway sends one (`--in-transaction`), holds the transaction `x-hold-ms` (a slow provider
//! call inside it), then commits and answers `201 {"ledger":ID,"key":KEY}`. It serves on a real
//! socket from a runtime of its own, so that its work never queues behind the test's clients.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;

/// The header that tells the upstream how long to hold its transaction, in milliseconds.
pub(crate) const HOLD_HEADER: &str = "x-hold-ms";

/// What the upstream saw of one key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Runs {
    /// Runs that reached the upstream.
    pub(crate) runs: usize,
    /// Of which carried `Idempotency-Recovered: true`.
    pub(crate) recovered: usize,
    /// Of which `idem_complete` refused (the token was no longer the run's).
    pub(crate) refused: usize,
}

#[derive(Clone)]
struct Shared {
    pool: deadpool_postgres::Pool,
    /// `"schema".ledger`.
    table: String,
    /// `"schema".idem_complete`, when the upstream completes in its transaction.
    complete: Option<String>,
    runs: Arc<Mutex<HashMap<String, Runs>>>,
}

/// The upstream, serving until dropped.
pub(crate) struct Ledger {
    /// `http://127.0.0.1:PORT`.
    pub(crate) url: String,
    database: String,
    table: String,
    runs: Arc<Mutex<HashMap<String, Runs>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Ledger {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            drop(thread.join());
        }
    }
}

impl Ledger {
    /// Starts the upstream on `database` (a PostgreSQL URL without options), its ledger in
    /// `schema` (created if missing), with at most `connections` transactions open at once.
    /// `in_transaction`: call `"schema".idem_complete` (the store's, migrated) in each run.
    pub(crate) async fn start(database: &str, schema: &str, connections: usize, in_transaction: bool) -> Self {
        let table = format!("\"{schema}\".ledger");
        let setup = connect(database).await;
        setup
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS \"{schema}\";
                 CREATE TABLE IF NOT EXISTS {table} (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL)"
            ))
            .await
            .expect("create the ledger");
        let pool = pool(database, connections);
        // Every connection opened now: a pool that grows while the storm runs would charge a
        // new connection (a PostgreSQL backend started) to whichever payment comes next.
        let opened: Vec<_> = futures_util::future::join_all((0..connections).map(|_| pool.get())).await;
        for client in opened {
            drop(client.expect("open the upstream's connections"));
        }
        let runs: Arc<Mutex<HashMap<String, Runs>>> = Arc::default();
        let shared = Shared {
            pool,
            table: table.clone(),
            complete: in_transaction.then(|| format!("\"{schema}\".idem_complete")),
            runs: runs.clone(),
        };
        let listener = std::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind the upstream");
        listener.set_nonblocking(true).expect("a non-blocking listener");
        let addr = listener.local_addr().expect("the upstream's address");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("ledger-upstream".to_owned())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("the upstream's runtime");
                runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener).expect("the upstream's listener");
                    let app = axum::Router::new().route("/pay", post(pay)).with_state(shared);
                    let serving = axum::serve(listener, app).with_graceful_shutdown(async {
                        drop(stopped.await);
                    });
                    drop(serving.await);
                });
                // Runs held past the end of the test are abandoned with the runtime.
                runtime.shutdown_background();
            })
            .expect("start the upstream's thread");
        Self {
            url: format!("http://{addr}"),
            database: database.to_owned(),
            table,
            runs,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// What the upstream saw, per key.
    pub(crate) fn runs(&self) -> HashMap<String, Runs> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The committed ledger rows, per key, counted in the database.
    pub(crate) async fn rows(&self) -> HashMap<String, i64> {
        let client = connect(&self.database).await;
        client
            .query(&format!("SELECT key, count(*) FROM {} GROUP BY key", self.table), &[])
            .await
            .expect("count the ledger")
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect()
    }
}

/// A connection of the test's own to `database`.
pub(crate) async fn connect(database: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(database, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|err| {
            panic!("cannot connect to PostgreSQL at {database} ({err}): start it with `bash .ci/services`")
        });
    tokio::spawn(connection);
    client
}

fn pool(database: &str, connections: usize) -> deadpool_postgres::Pool {
    let config: tokio_postgres::Config = database.parse().expect("a PostgreSQL URL");
    let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    deadpool_postgres::Pool::builder(manager)
        .max_size(connections)
        .build()
        .expect("the upstream's pool")
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|value| value.to_str().ok())
}

/// `POST /pay`: the ledger row (and the answer) in one transaction held `x-hold-ms`. A run goes
/// on to its commit when the gateway hangs up, as an upstream process's would.
async fn pay(State(shared): State<Shared>, headers: HeaderMap) -> Response {
    match tokio::spawn(run(shared, headers)).await {
        Ok(response) => response,
        Err(died) => (StatusCode::INTERNAL_SERVER_ERROR, format!("the run died: {died}")).into_response(),
    }
}

async fn run(shared: Shared, headers: HeaderMap) -> Response {
    let key = header(&headers, "idempotency-key")
        .unwrap_or_default()
        .trim_matches('"')
        .to_owned();
    let hold = Duration::from_millis(
        header(&headers, HOLD_HEADER)
            .and_then(|ms| ms.parse().ok())
            .unwrap_or(0),
    );
    let recovered = header(&headers, "idempotency-recovered") == Some("true");
    let token = header(&headers, "idempotency-token").map(str::to_owned);
    {
        let mut runs = shared.runs.lock().unwrap_or_else(PoisonError::into_inner);
        let seen = runs.entry(key.clone()).or_default();
        seen.runs += 1;
        seen.recovered += usize::from(recovered);
    }
    match write(&shared, &key, token.as_deref(), hold).await {
        Ok(answer) => (StatusCode::CREATED, [("content-type", "application/json")], answer).into_response(),
        Err(Refusal::Refused(state)) => {
            let mut runs = shared.runs.lock().unwrap_or_else(PoisonError::into_inner);
            runs.entry(key).or_default().refused += 1;
            (
                StatusCode::CONFLICT,
                format!("idem_complete refused the token: {state}"),
            )
                .into_response()
        }
        Err(Refusal::Failed(err)) => (StatusCode::INTERNAL_SERVER_ERROR, err).into_response(),
    }
}

enum Refusal {
    /// `idem_complete` raised this SQLSTATE: nothing commits.
    Refused(String),
    /// The database failed otherwise.
    Failed(String),
}

async fn write(shared: &Shared, key: &str, token: Option<&str>, hold: Duration) -> Result<String, Refusal> {
    let failed = |err: tokio_postgres::Error| Refusal::Failed(err.to_string());
    let mut client = shared
        .pool
        .get()
        .await
        .map_err(|err| Refusal::Failed(err.to_string()))?;
    let tx = client.transaction().await.map_err(failed)?;
    let id: i64 = tx
        .query_one(
            &format!("INSERT INTO {} (key) VALUES ($1) RETURNING id", shared.table),
            &[&key],
        )
        .await
        .map_err(failed)?
        .get(0);
    let answer = serde_json::json!({"ledger": id, "key": key}).to_string();
    if let (Some(function), Some(token)) = (&shared.complete, token) {
        let completed = tx
            .execute(
                &format!("SELECT {function}($1, 201, $2::text::jsonb, $3)"),
                &[&token, &r#"{"Content-Type": "application/json"}"#, &answer.as_bytes()],
            )
            .await;
        if let Err(err) = completed {
            return Err(match err.code() {
                Some(code) => Refusal::Refused(code.code().to_owned()),
                None => Refusal::Failed(err.to_string()),
            });
        }
    }
    // The slow provider call, inside the transaction: the record's row stays locked meanwhile.
    tokio::time::sleep(hold).await;
    tx.commit().await.map_err(failed)?;
    Ok(answer)
}
