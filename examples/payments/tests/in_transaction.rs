//! The in-transaction mode against real processes: the payments binary keeps its ledger in the
//! same database as its idempotency records (`PAYMENTS_DATABASE`, PostgreSQL in a private schema
//! or a SQLite file) and completes `POST /pay` in the ledger's transaction. Each test kills
//! (`kill -9`) or freezes (`kill -STOP`) an instance at a chosen point of a payment, and checks
//! the ledger rows, the provider's counters, the statuses and the answers' `recovered` field.
//! The lease is one second.

mod provider;
mod service;

use std::path::PathBuf;
use std::time::Duration;

use idem_core::store::{RecordId, RecordState};
use idem_core::{IdempotencyKey, Scope, Store};
use idem_test_support::servers::{drop_postgres_schema, postgres_url, unique_name, with_options};
use provider::{First, Provider, wait_for};
use serde_json::Value;
use sqlx::Connection;
use tokio::process::Child;
use tokio::task::JoinHandle;

/// Longer than the lease: a claim whose holder died or froze can be taken over after it.
const PAST_THE_LEASE: Duration = Duration::from_millis(1500);

/// The database an instance is started on, removed when dropped.
struct Db {
    /// `PAYMENTS_DATABASE`.
    url: String,
    kind: Kind,
}

enum Kind {
    Postgres {
        /// The server, without options.
        server: String,
        /// The test's own schema; also the instances' `application_name`.
        schema: String,
    },
    Sqlite {
        path: PathBuf,
        _dir: tempfile::TempDir,
    },
}

impl Drop for Db {
    fn drop(&mut self) {
        if let Kind::Postgres { server, schema } = &self.kind {
            drop_postgres_schema(server, schema);
        }
    }
}

impl Db {
    /// A private schema on the machine's PostgreSQL (the test fails, saying how to start it, if it
    /// does not answer).
    fn postgres() -> Self {
        let server = postgres_url();
        let schema = unique_name("pay_tx");
        Self {
            url: with_options(&server, &format!("schema={schema}&application_name={schema}")),
            kind: Kind::Postgres { server, schema },
        }
    }

    /// A SQLite file in a temporary directory.
    fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("payments.db");
        Self {
            url: format!("sqlite://{}", path.display()),
            kind: Kind::Sqlite { path, _dir: dir },
        }
    }

    fn is_postgres(&self) -> bool {
        matches!(self.kind, Kind::Postgres { .. })
    }

    /// The charges of the committed ledger rows of `key` (`None`: a row without a charge).
    async fn ledger(&self, key: &str) -> Vec<Option<String>> {
        match &self.kind {
            Kind::Postgres { server, schema } => {
                let mut conn = sqlx::PgConnection::connect(server)
                    .await
                    .expect("connect to PostgreSQL");
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT charge FROM \"{schema}\".payments_ledger WHERE key = $1 ORDER BY id"
                )))
                .bind(key)
                .fetch_all(&mut conn)
                .await
            }
            Kind::Sqlite { path, .. } => {
                let options = sqlx::sqlite::SqliteConnectOptions::new().filename(path);
                let mut conn = sqlx::SqliteConnection::connect_with(&options)
                    .await
                    .expect("open the SQLite file");
                sqlx::query_scalar("SELECT charge FROM payments_ledger WHERE key = ?1 ORDER BY id")
                    .bind(key)
                    .fetch_all(&mut conn)
                    .await
            }
        }
        .expect("read the ledger")
    }

    /// The idempotency record of `key` (the requests carry no credential: the anonymous scope).
    async fn record(&self, key: &str) -> Option<RecordState> {
        let id = RecordId {
            scope: Scope::anonymous(),
            key: IdempotencyKey::new(key).expect("a valid key"),
        };
        let record = match &self.kind {
            // Not under the instances' application_name, which a test terminates.
            Kind::Postgres { server, schema } => {
                idem_postgres::PostgresStore::connect(&with_options(server, &format!("schema={schema}&notify=off")))
                    .await
                    .expect("connect the store")
                    .get(&id)
                    .await
            }
            Kind::Sqlite { path, .. } => {
                idem_sqlite::SqliteStore::open(path)
                    .await
                    .expect("open the store")
                    .get(&id)
                    .await
            }
        };
        record.expect("read the record").map(|record| record.state)
    }

    /// Terminates every connection of the instances (their `application_name` is the schema's).
    async fn terminate_instances(&self) -> usize {
        let Kind::Postgres { server, schema } = &self.kind else {
            panic!("only on PostgreSQL");
        };
        let mut conn = sqlx::PgConnection::connect(server)
            .await
            .expect("connect to PostgreSQL");
        let terminated: Vec<bool> =
            sqlx::query_scalar("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1")
                .bind(schema)
                .fetch_all(&mut conn)
                .await
                .expect("terminate the instances' connections");
        terminated.into_iter().filter(|done| *done).count()
    }
}

/// A payments process in the in-transaction mode.
struct Instance {
    child: Child,
    base: String,
}

impl Instance {
    /// The payments binary on `db`, charging `provider`, with a one-second lease.
    async fn start(db: &Db, provider: &str) -> Self {
        let (child, base) = service::start_payments(&[
            ("PAYMENTS_DATABASE", &db.url),
            ("PAYMENTS_PROVIDER", provider),
            ("PAYMENTS_LEASE_SECS", "1"),
        ])
        .await;
        Self { child, base }
    }

    /// `kill -9` while `pay`, its request, waits for its answer: the client hears nothing.
    async fn kill_unheard(mut self, pay: JoinHandle<reqwest::Result<reqwest::Response>>) {
        self.child.kill().await.expect("kill -9 the payments process");
        assert!(pay.await.expect("the client task").is_err(), "the client heard nothing");
    }

    /// `kill -STOP` or `kill -CONT`.
    fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("the process runs").to_string();
        let status = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// `POST /pay` with `key`.
    fn pay(&self, key: &str) -> impl Future<Output = reqwest::Result<reqwest::Response>> + Send + 'static {
        provider::pay(&client(), &self.base, key)
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("a client")
}

/// An answer, read whole.
#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    body: Value,
}

async fn answer(response: reqwest::Result<reqwest::Response>) -> Answer {
    let response = response.expect("an answer");
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let text = response.text().await.expect("a body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Answer { status, replayed, body }
}

/// A provider whose first charge and first receipt go as `charge` and `receipt` say (one of them
/// hangs), and an instance on `db` with `key`'s payment to it, hanging in the provider when this
/// returns: the provider, its URL, the instance and the payment's client task.
async fn hanging_payment(
    db: &Db,
    key: &str,
    charge: First,
    receipt: First,
) -> (
    Provider,
    String,
    Instance,
    JoinHandle<reqwest::Result<reqwest::Response>>,
) {
    let (provider, provider_url) = provider::start_with(charge, receipt).await;
    let instance = Instance::start(db, &provider_url).await;
    let pay = tokio::spawn(instance.pay(key));
    let hangs = if charge == First::Hangs {
        &provider.charge_calls
    } else {
        &provider.receipts
    };
    wait_for(hangs, 1).await;
    (provider, provider_url, instance, pay)
}

/// The charge of a successful, unflagged run.
fn assert_paid_unflagged(answer: &Answer, charge: &str) {
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.body["charge"], charge, "{answer:?}");
    assert_eq!(answer.body["amount"], 1250, "{answer:?}");
    assert_eq!(
        answer.body["recovered"], false,
        "the run was not flagged recovered: {answer:?}"
    );
}

/// Killed after its ledger row, before its commit (while the provider's first charge hangs):
/// nothing of the run stands, and the retry on a restarted instance runs again, unflagged; the
/// provider, asked again under the same key, gives the charge it made.
async fn killed_before_the_commit_the_retry_runs_unflagged(db: Db) {
    let key = "pay-killed-before-commit";
    let (provider, provider_url, first, lost) = hanging_payment(&db, key, First::Hangs, First::Answers).await;
    first.kill_unheard(lost).await;
    assert_eq!(
        db.ledger(key).await,
        Vec::<Option<String>>::new(),
        "the ledger row never committed"
    );
    assert!(
        matches!(db.record(key).await, Some(RecordState::InFlight { .. })),
        "nothing was stored: the record is still the dead run's claim"
    );

    let second = Instance::start(&db, &provider_url).await;
    tokio::time::sleep(PAST_THE_LEASE).await;
    let retry = answer(second.pay(key).await).await;
    assert!(!retry.replayed, "the retry ran: {retry:?}");
    assert_paid_unflagged(&retry, "ch_1");
    assert_eq!(db.ledger(key).await, [Some("ch_1".to_owned())], "one ledger row");
    assert_eq!(provider.charge_calls(), 2, "the retry asked the provider again");
    assert_eq!(provider.charges(), 1, "under the same key: one charge");
    assert_eq!(provider.receipts(), 1);

    let replay = answer(second.pay(key).await).await;
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(replay.body, retry.body);
    assert_eq!(db.ledger(key).await.len(), 1);
}

/// Killed after its commit, before its answer went back (while the provider's first receipt
/// hangs): the retry replays the committed answer, and the handler does not run again.
async fn killed_after_the_commit_the_retry_replays(db: Db) {
    let key = "pay-killed-after-commit";
    let (provider, provider_url, first, lost) = hanging_payment(&db, key, First::Answers, First::Hangs).await;
    assert_eq!(
        db.ledger(key).await,
        [Some("ch_1".to_owned())],
        "committed before the receipt"
    );
    first.kill_unheard(lost).await;
    assert!(
        matches!(db.record(key).await, Some(RecordState::Completed { .. })),
        "the answer was stored with the ledger row"
    );

    let second = Instance::start(&db, &provider_url).await;
    let retry = answer(second.pay(key).await).await;
    assert!(retry.replayed, "the retry replays: {retry:?}");
    assert_paid_unflagged(&retry, "ch_1");
    assert_eq!(db.ledger(key).await.len(), 1, "one ledger row");
    assert_eq!(provider.charge_calls(), 1, "the handler did not run again");
    assert_eq!(provider.charges(), 1);
    assert_eq!(
        provider.receipts(),
        1,
        "the receipt, sent after the commit, is not sent again (at most once)"
    );
}

/// Frozen (`kill -STOP`) after its ledger row, before its commit, past its lease. PostgreSQL: a
/// second instance takes the key over, unflagged, and completes; the first, resumed, is fenced
/// and its row never commits. SQLite: the frozen holder keeps the file's write lock, so the
/// second instance cannot run the payment; resumed, the first completes and the retry replays.
async fn frozen_past_the_lease(db: Db) {
    let (provider, provider_url) = provider::start_with(First::Hangs, First::Answers).await;
    let key = "pay-frozen";
    let first = Instance::start(&db, &provider_url).await;
    let second = Instance::start(&db, &provider_url).await;
    let first_pay = tokio::spawn(first.pay(key));
    wait_for(&provider.charge_calls, 1).await;
    first.signal("-STOP");
    tokio::time::sleep(PAST_THE_LEASE).await;

    if db.is_postgres() {
        let retry = answer(second.pay(key).await).await;
        assert!(!retry.replayed, "{retry:?}");
        assert_paid_unflagged(&retry, "ch_1");
        assert_eq!(provider.charge_calls(), 2, "the second instance asked the provider");
        assert_eq!(provider.charges(), 1, "under the same key: one charge");
        assert_eq!(db.ledger(key).await, [Some("ch_1".to_owned())]);

        first.signal("-CONT");
        provider.release();
        let fenced = answer(first_pay.await.expect("the client task")).await;
        assert_eq!(fenced.status, 409, "the first's completion was fenced: {fenced:?}");
        assert_eq!(
            db.ledger(key).await,
            [Some("ch_1".to_owned())],
            "the first's ledger row never committed: only the second's stands"
        );
        let replay = answer(first.pay(key).await).await;
        assert!(replay.replayed, "{replay:?}");
        assert_eq!(replay.body, retry.body, "both instances answer with the second's run");
    } else {
        let refused = answer(second.pay(key).await).await;
        assert!(
            refused.status >= 500 || refused.status == 409,
            "the frozen holder keeps the write lock: the second instance cannot run it: {refused:?}"
        );
        assert_eq!(
            provider.charge_calls(),
            1,
            "the payment did not run on the second instance"
        );
        assert_eq!(db.ledger(key).await.len(), 0);

        first.signal("-CONT");
        provider.release();
        let done = answer(first_pay.await.expect("the client task")).await;
        assert!(!done.replayed, "{done:?}");
        assert_paid_unflagged(&done, "ch_1");
        assert_eq!(db.ledger(key).await, [Some("ch_1".to_owned())]);
        let replay = answer(second.pay(key).await).await;
        assert!(replay.replayed, "{replay:?}");
        assert_eq!(replay.body, done.body);
    }
    assert_eq!(provider.charges(), 1);
    assert_eq!(db.ledger(key).await.len(), 1);
}

/// Twenty copies of one payment at once, split between two instances: one runs, every other
/// copy waits for it or replays it.
async fn two_instances_twenty_copies_one_payment(db: Db) {
    let (provider, provider_url) = provider::start_with(First::Answers, First::Answers).await;
    let key = "pay-twenty-copies";
    let instances = [
        Instance::start(&db, &provider_url).await,
        Instance::start(&db, &provider_url).await,
    ];
    let copies: Vec<_> = (0..20).map(|i| tokio::spawn(instances[i % 2].pay(key))).collect();
    let mut answers = Vec::new();
    for copy in copies {
        answers.push(answer(copy.await.expect("the client task")).await);
    }
    for answer in &answers {
        assert_eq!(answer.status, 200, "{answer:?}");
        assert_eq!(answer.body, answers[0].body, "every copy gets the same charge");
    }
    assert_eq!(answers[0].body["charge"], "ch_1");
    assert_eq!(
        answers.iter().filter(|answer| !answer.replayed).count(),
        1,
        "one copy ran, the others replayed its answer: {answers:?}"
    );
    assert_eq!(db.ledger(key).await.len(), 1, "one ledger row");
    assert_eq!(provider.charge_calls(), 1, "one charge asked for");
    assert_eq!(provider.charges(), 1);
}

/// PostgreSQL: the instance's connections are terminated while its charge hangs (its
/// transaction is gone before the commit): the client gets an error, no ledger row stands, and
/// the retry runs unflagged and is charged once.
async fn the_database_lost_before_the_commit(db: Db) {
    let key = "pay-database-lost";
    let (provider, _, instance, first) = hanging_payment(&db, key, First::Hangs, First::Answers).await;
    assert!(
        db.terminate_instances().await > 0,
        "the instance's connections were found"
    );
    provider.release();
    let failed = answer(first.await.expect("the client task")).await;
    assert!(failed.status >= 500, "the payment failed: {failed:?}");
    assert_eq!(db.ledger(key).await.len(), 0, "nothing committed");

    tokio::time::sleep(PAST_THE_LEASE).await;
    let retry = answer(instance.pay(key).await).await;
    assert!(!retry.replayed, "{retry:?}");
    assert_paid_unflagged(&retry, "ch_1");
    assert_eq!(db.ledger(key).await, [Some("ch_1".to_owned())]);
    assert_eq!(provider.charge_calls(), 2);
    assert_eq!(provider.charges(), 1, "charged once");
}

/// Only `/pay` is in-transaction: it requires a key, and without a provider its charge is named
/// after its ledger row. The order routes keep the ordinary policy (their effects are in memory):
/// a keyless create runs, a keyed one replays.
async fn only_pay_is_in_transaction(db: Db) {
    let config = idem_example_payments::Config {
        database: Some(db.url.clone()),
        ..Default::default()
    };
    let app = idem_example_payments::app_on_database(config)
        .await
        .expect("the service starts on its database");
    let base = provider::serve(app).await;
    let client = client();
    let post = |path: &str, key: Option<&str>, body: &str| {
        let mut request = client
            .post(format!("{base}{path}"))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(key) = key {
            request = request.header("idempotency-key", format!("\"{key}\""));
        }
        request.send()
    };
    let pay = r#"{"amount":1250,"currency":"EUR"}"#;

    let keyless = answer(post("/pay", None, pay).await).await;
    assert_eq!(keyless.status, 400, "a payment needs a key here: {keyless:?}");
    let paid = answer(post("/pay", Some("pay-books"), pay).await).await;
    assert_paid_unflagged(&paid, "ch_1");
    assert_eq!(db.ledger("pay-books").await, [Some("ch_1".to_owned())]);
    let replay = answer(post("/pay", Some("pay-books"), pay).await).await;
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(replay.body, paid.body);

    let order = r#"{"item":"book","quantity":1}"#;
    let keyless = answer(post("/orders", None, order).await).await;
    assert_eq!(keyless.status, 201, "{keyless:?}");
    let created = answer(post("/orders", Some("order-1"), order).await).await;
    assert_eq!(created.status, 201, "{created:?}");
    assert_eq!(created.body["id"], 2);
    let replay = answer(post("/orders", Some("order-1"), order).await).await;
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(replay.body, created.body);
}

/// A module `$module` of tests, each running a scenario above on the database `$db` makes.
macro_rules! tests_on {
    ($module:ident, $db:expr, { $($test:ident: $scenario:ident,)* }) => {
        mod $module {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$scenario($db).await;
                }
            )*
        }
    };
}

tests_on!(postgres, Db::postgres(), {
    killed_before_the_commit_the_retry_runs_unflagged: killed_before_the_commit_the_retry_runs_unflagged,
    killed_after_the_commit_the_retry_replays: killed_after_the_commit_the_retry_replays,
    frozen_past_the_lease_the_first_is_fenced_and_its_row_never_commits: frozen_past_the_lease,
    two_instances_twenty_copies_one_payment: two_instances_twenty_copies_one_payment,
    only_pay_is_in_transaction: only_pay_is_in_transaction,
    the_database_lost_before_the_commit: the_database_lost_before_the_commit,
});

tests_on!(sqlite, Db::sqlite(), {
    only_pay_is_in_transaction: only_pay_is_in_transaction,
    killed_before_the_commit_the_retry_runs_unflagged: killed_before_the_commit_the_retry_runs_unflagged,
    killed_after_the_commit_the_retry_replays: killed_after_the_commit_the_retry_replays,
    frozen_past_the_lease_the_second_instance_cannot_run_it: frozen_past_the_lease,
    two_instances_twenty_copies_one_payment: two_instances_twenty_copies_one_payment,
});
