//! The payments upstream that completes in its own transaction: `POST /pay` writes a ledger row in
//! a PostgreSQL transaction, calls the store's `idem_complete` with the run's `Idempotency-Token` in
//! that transaction (when started `in_transaction` and the gateway sent one), holds the transaction
//! `x-hold-ms` (a slow provider call inside it), then commits and answers
//! `201 {"ledger":ID,"key":KEY}`. A test may plan what its next runs do instead ([`Then`]). It
//! serves on a real socket from a runtime of its own, so that its work never queues behind the
//! test's clients, and goes on with a run whose caller went away, as an upstream process would.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tokio::sync::Notify;

/// The header that tells the upstream how long to hold its transaction, in milliseconds.
pub(crate) const HOLD_HEADER: &str = "x-hold-ms";

/// What a run does after its ledger row, when the test planned it ([`Ledger::plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Then {
    /// Completes, commits and answers: what an unplanned run does.
    Commit,
    /// Waits until the test says ([`Ledger::resume`]), then completes, commits and answers.
    WaitThenCommit,
    /// Rolls back and drops the connection without an answer, as an upstream process that died.
    Die,
    /// Rolls back after `idem_complete`, and answers `201` all the same.
    RollBackAndAnswer,
    /// Completes with the token's retention changed to nothing (a token tampered with), commits.
    CommitExpiringAtOnce,
}

/// A run that reached its completion: what it was sent and what `idem_complete` said.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    /// The `Idempotency-Key` it carried, unquoted.
    pub(crate) key: String,
    /// The `Idempotency-Token` it carried.
    pub(crate) token: Option<String>,
    /// Whether it carried `Idempotency-Recovered: true`.
    pub(crate) recovered: bool,
    /// `None` if `idem_complete` took the answer (or was not called), its SQLSTATE otherwise.
    pub(crate) refused: Option<String>,
}

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

/// What the runs left for the test to read.
#[derive(Debug, Default)]
struct Journal {
    /// Every run that reached the upstream: its key and whether it was flagged recovered.
    started: Vec<(String, bool)>,
    /// The runs that reached their completion, in that order.
    completed: Vec<Run>,
    /// The runs that committed.
    committed: usize,
    /// What the next runs do, last first.
    plan: Vec<Then>,
}

/// What the runs share with the test.
#[derive(Debug, Default)]
struct Signals {
    journal: Mutex<Journal>,
    /// Notified when a planned run waits ([`Then::WaitThenCommit`]).
    waiting: Notify,
    /// What such a run waits for.
    resume: Notify,
    /// Notified when a run holds its transaction open, completed (`x-hold-ms` above zero).
    holding: Notify,
}

impl Signals {
    fn journal(&self) -> std::sync::MutexGuard<'_, Journal> {
        self.journal.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Clone)]
struct Shared {
    pool: deadpool_postgres::Pool,
    /// `"schema".ledger`.
    table: String,
    /// `"schema".idem_complete`, when the upstream completes in its transaction.
    complete: Option<String>,
    signals: Arc<Signals>,
}

/// The upstream, serving until dropped.
pub(crate) struct Ledger {
    /// `http://127.0.0.1:PORT`.
    pub(crate) url: String,
    /// The PostgreSQL URL it was started on (no options).
    pub(crate) database: String,
    /// The schema of its ledger (and of the store whose `idem_complete` it calls).
    pub(crate) schema: String,
    signals: Arc<Signals>,
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
        connect(database)
            .await
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS \"{schema}\";
                 CREATE TABLE IF NOT EXISTS {table} (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL)"
            ))
            .await
            .expect("create the ledger");
        let pool = pool(database, connections);
        // Every connection opened now: a pool that grows while a storm runs would charge a new
        // connection (a PostgreSQL backend started) to whichever payment comes next.
        let opened: Vec<_> = futures_util::future::join_all((0..connections).map(|_| pool.get())).await;
        for client in opened {
            drop(client.expect("open the upstream's connections"));
        }
        let signals = Arc::new(Signals::default());
        let shared = Shared {
            pool,
            table,
            complete: in_transaction.then(|| format!("\"{schema}\".idem_complete")),
            signals: signals.clone(),
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
            schema: schema.to_owned(),
            signals,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// What the next runs do, in order (then [`Then::Commit`]).
    pub(crate) fn plan(&self, then: &[Then]) {
        self.signals.journal().plan = then.iter().rev().copied().collect();
    }

    /// Lets the run that waits ([`Then::WaitThenCommit`]) go on.
    pub(crate) fn resume(&self) {
        self.signals.resume.notify_one();
    }

    /// Resolves once a planned run waits ([`Then::WaitThenCommit`]); create it before the request.
    pub(crate) fn waiting(&self) -> tokio::sync::futures::Notified<'_> {
        self.signals.waiting.notified()
    }

    /// Resolves once a run holds its completed transaction open; create it before the request.
    pub(crate) fn holding(&self) -> tokio::sync::futures::Notified<'_> {
        self.signals.holding.notified()
    }

    /// How many runs reached the upstream.
    pub(crate) fn started(&self) -> usize {
        self.signals.journal().started.len()
    }

    /// How many runs committed.
    pub(crate) fn committed(&self) -> usize {
        self.signals.journal().committed
    }

    /// The runs that reached their completion, in that order.
    pub(crate) fn completed(&self) -> Vec<Run> {
        self.signals.journal().completed.clone()
    }

    /// What the upstream saw, per key.
    pub(crate) fn runs(&self) -> HashMap<String, Runs> {
        let journal = self.signals.journal();
        let mut runs: HashMap<String, Runs> = HashMap::new();
        for (key, recovered) in &journal.started {
            let seen = runs.entry(key.clone()).or_default();
            seen.runs += 1;
            seen.recovered += usize::from(*recovered);
        }
        for run in journal.completed.iter().filter(|run| run.refused.is_some()) {
            runs.entry(run.key.clone()).or_default().refused += 1;
        }
        runs
    }

    /// The committed ledger rows, per key, counted in the database.
    pub(crate) async fn rows(&self) -> HashMap<String, i64> {
        connect(&self.database)
            .await
            .query(
                &format!("SELECT key, count(*) FROM \"{}\".ledger GROUP BY key", self.schema),
                &[],
            )
            .await
            .expect("count the ledger")
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect()
    }

    /// The committed ledger rows of `key`.
    pub(crate) async fn rows_of(&self, key: &str) -> i64 {
        self.rows().await.get(key).copied().unwrap_or(0)
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

/// `POST /pay`, in a task of its own, so that the run goes on when its caller goes away. A run that
/// dies ([`Then::Die`]) takes its connection down with it, unanswered.
async fn pay(State(shared): State<Shared>, headers: HeaderMap) -> Response {
    match tokio::spawn(run(shared, headers)).await {
        Ok(response) => response,
        Err(died) => std::panic::resume_unwind(died.into_panic()),
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
    let then = {
        let mut journal = shared.signals.journal();
        journal.started.push((key.clone(), recovered));
        journal.plan.pop().unwrap_or(Then::Commit)
    };
    match write(&shared, &key, token, recovered, then, hold).await {
        Ok(answer) => (
            StatusCode::CREATED,
            [("content-type", "application/json"), ("set-cookie", "session=secret")],
            answer,
        )
            .into_response(),
        Err(Refusal::RolledBack(answer)) => (StatusCode::CREATED, answer).into_response(),
        Err(Refusal::Refused(state)) => (
            StatusCode::CONFLICT,
            format!("idem_complete refused the token: {state}"),
        )
            .into_response(),
        Err(Refusal::Failed(err)) => (StatusCode::INTERNAL_SERVER_ERROR, err).into_response(),
    }
}

/// Why a run's transaction did not commit.
enum Refusal {
    /// Rolled back as planned ([`Then::RollBackAndAnswer`]), with the answer it gives all the same.
    RolledBack(String),
    /// `idem_complete` raised this SQLSTATE: nothing commits.
    Refused(String),
    /// The database failed otherwise.
    Failed(String),
}

async fn write(
    shared: &Shared,
    key: &str,
    token: Option<String>,
    recovered: bool,
    then: Then,
    hold: Duration,
) -> Result<String, Refusal> {
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
    // Written out rather than by `serde_json::json!`, whose key order a feature elsewhere can change.
    let answer = format!(r#"{{"ledger":{id},"key":{}}}"#, serde_json::Value::from(key));
    if then == Then::WaitThenCommit {
        let resumed = shared.signals.resume.notified();
        shared.signals.waiting.notify_one();
        resumed.await;
    }
    let mut refused = None;
    if let (Some(function), Some(token)) = (&shared.complete, &token) {
        let token = match then {
            Then::CommitExpiringAtOnce => expiring_at_once(token),
            _ => token.clone(),
        };
        // The stored answer says where the charge is; the live one does not, so that a replay
        // tells which of the two it is.
        let stored_headers = format!(
            r#"{{"Content-Type": "application/json", "Set-Cookie": "session=secret", "Location": "/charges/{id}"}}"#
        );
        let completed = tx
            .execute(
                &format!("SELECT {function}($1, 201, $2::text::jsonb, $3)"),
                &[&token, &stored_headers, &answer.as_bytes()],
            )
            .await;
        if let Err(err) = completed {
            refused = Some(
                err.code()
                    .map_or_else(|| err.to_string(), |code| code.code().to_owned()),
            );
        }
    }
    shared.signals.journal().completed.push(Run {
        key: key.to_owned(),
        token,
        recovered,
        refused: refused.clone(),
    });
    if then == Then::Die {
        drop(tx.rollback().await);
        panic!("the upstream dies before its commit (this panic is the test's)");
    }
    if then == Then::RollBackAndAnswer {
        drop(tx.rollback().await);
        return Err(Refusal::RolledBack(answer));
    }
    if let Some(state) = refused {
        // The transaction is aborted: nothing of it commits.
        drop(tx.rollback().await);
        return Err(Refusal::Refused(state));
    }
    // The slow provider call, inside the transaction: the record's row stays locked meanwhile.
    if !hold.is_zero() {
        shared.signals.holding.notify_one();
        tokio::time::sleep(hold).await;
    }
    tx.commit().await.map_err(failed)?;
    shared.signals.journal().committed += 1;
    Ok(answer)
}

/// `token` with its retention and tombstone retention set to nothing.
fn expiring_at_once(token: &str) -> String {
    let mut parts: Vec<&str> = token.split('.').collect();
    parts[4] = "0";
    parts[5] = "0";
    parts.join(".")
}
