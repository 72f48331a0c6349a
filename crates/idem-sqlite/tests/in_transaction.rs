//! `SqliteStore::complete_in`: the answer commits with the handler's business writes, keeps what
//! `complete` keeps (the answer's status beside it), and a completion whose claim was lost takes
//! the handler's transaction with it.
#![cfg(feature = "sqlx")]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::protocol::{Admission, CompleteInError, Decision, InTransaction, Protocol};
use idem_core::{Fingerprint, Policy, Store};
use idem_sqlite::SqliteStore;
use sqlx::{Connection, SqliteConnection};

/// The store's file, with the business table `ledger` beside the store's own.
struct Db {
    _dir: tempfile::TempDir,
    url: String,
    store: SqliteStore,
}

async fn db() -> Db {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(&path).await.unwrap();
    let url = format!("sqlite://{}", path.display());
    let mut conn = SqliteConnection::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE ledger (key TEXT NOT NULL)")
        .execute(&mut conn)
        .await
        .unwrap();
    Db { _dir: dir, url, store }
}

impl Db {
    async fn connect(&self) -> SqliteConnection {
        SqliteConnection::connect(&self.url).await.unwrap()
    }

    /// A claim of `key` under the default policy ([`claim`]).
    async fn claim(&self, key: &str) -> InTransaction {
        let protocol = Protocol::new(Arc::new(self.store.clone()), Policy::default());
        claim(&protocol, key).await
    }

    async fn ledger(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT key FROM ledger ORDER BY rowid")
            .fetch_all(&mut self.connect().await)
            .await
            .unwrap()
    }
}

/// A new file with `key` claimed in it ([`Db::claim`]), and a connection of the handler's to it.
async fn claimed(key: &str) -> (Db, InTransaction, SqliteConnection) {
    let db = db().await;
    let run = db.claim(key).await;
    let conn = db.connect().await;
    (db, run, conn)
}

/// Begins a transaction on `conn` and writes the ledger row `key` in it.
async fn with_ledger_row<'c>(conn: &'c mut SqliteConnection, key: &str) -> sqlx::Transaction<'c, sqlx::Sqlite> {
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("INSERT INTO ledger (key) VALUES ($1)")
        .bind(key)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// Claims `key` for a `POST /payments` under `protocol`, as the layer does for a keyed handler.
async fn claim(protocol: &Protocol, key: &str) -> InTransaction {
    let request = http::Request::post("/payments")
        .header("idempotency-key", format!("\"{key}\""))
        .header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        .body(())
        .unwrap();
    let (parts, ()) = request.into_parts();
    let Admission::Keyed(keyed) = protocol.admit(&parts) else {
        panic!("a keyed POST is subject to the protocol")
    };
    let fingerprint = Fingerprint::of(&parts.method, &parts.uri, &parts.headers, b"");
    let Decision::Run(claim) = protocol.begin(keyed, &fingerprint).await else {
        panic!("{key} runs")
    };
    InTransaction::new(protocol.clone(), claim)
}

fn accepted() -> http::Response<Bytes> {
    http::Response::builder()
        .status(http::StatusCode::ACCEPTED)
        .body(Bytes::from_static(b"queued"))
        .unwrap()
}

#[tokio::test]
async fn a_completion_in_the_callers_transaction_commits_with_it_and_keeps_the_status() {
    let (db, run, mut conn) = claimed("in-tx").await;
    let tx = with_ledger_row(&mut conn, "in-tx").await;
    let mut answer = accepted();
    let tx = db.store.complete_in(tx, &run, &mut answer).await.unwrap();
    tx.commit().await.unwrap();

    assert_eq!(db.ledger().await, ["in-tx"]);
    let record = db.store.get(run.id()).await.unwrap().expect("the record");
    assert_eq!(record.status, Some(202));
    assert_eq!(
        (
            record.origin.method.as_str(),
            record.origin.path.as_str(),
            record.recovered
        ),
        ("POST", "/payments", false)
    );
    assert_eq!(
        record.origin.trace.map(|trace| trace.trace_id.to_string()).as_deref(),
        Some("4bf92f3577b34da6a3ce929d0e0e4736")
    );
}

#[tokio::test]
async fn a_completion_rolled_back_with_its_transaction_leaves_nothing() {
    let (db, run, mut conn) = claimed("rolled-back").await;
    let tx = with_ledger_row(&mut conn, "rolled-back").await;
    let tx = db.store.complete_in(tx, &run, &mut accepted()).await.unwrap();
    tx.rollback().await.unwrap();

    assert!(db.ledger().await.is_empty());
    let record = db.store.get(run.id()).await.unwrap().expect("the record");
    assert_eq!(record.status, None, "still in flight: {record:?}");
}

/// How a handler's claim is lost while it runs.
#[derive(Debug, Clone, Copy)]
enum Lost {
    /// An operator deleted the record.
    Deleted,
    /// The lease ran out and the same request took the record over.
    TakenOver,
}

/// A handler whose claim was lost, ignoring the `Fenced` error as carelessly as it can: nothing it
/// wrote in the transaction stands, its connection is out of the transaction (so a careless
/// "commit" on it has nothing to commit), and the connection's next transaction is a fresh one
/// that works as usual. (Before `complete_in` took the transaction by value, the writes the
/// handler made after the error committed one by one: `INSERT OR ROLLBACK` had ended the
/// transaction and left the connection in autocommit. The `compile_fail` example on
/// `complete_in` is what now keeps a handler from writing in it.)
#[tokio::test]
async fn a_fenced_completion_ends_the_transaction_and_none_of_its_writes_stand() {
    for lost in [Lost::Deleted, Lost::TakenOver] {
        let db = db().await;
        let lease = Duration::from_millis(200);
        let protocol = Protocol::new(
            Arc::new(db.store.clone()),
            Policy {
                lease,
                ..Policy::default()
            },
        );
        let run = claim(&protocol, "fenced").await;
        match lost {
            Lost::Deleted => {
                db.store.delete(run.id()).await.unwrap().expect("the record in flight");
            }
            Lost::TakenOver => {
                tokio::time::sleep(lease + Duration::from_millis(100)).await;
                claim(&protocol, "fenced").await;
            }
        }

        let mut conn = db.connect().await;
        let tx = with_ledger_row(&mut conn, "before the completion").await;
        let mut answer = accepted();
        // Only the error is kept: a transaction handed back would borrow `conn`.
        let failed = db.store.complete_in(tx, &run, &mut answer).await.err();
        assert!(matches!(failed, Some(CompleteInError::Fenced)), "{lost:?}: {failed:?}");

        assert!(!conn.is_in_transaction(), "{lost:?}: sqlx still counts a transaction");
        let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(seen, 0, "{lost:?}: the connection still sees the fenced run's write");
        assert!(
            db.ledger().await.is_empty(),
            "{lost:?}: the fenced run's write committed"
        );
        let record = db.store.get(run.id()).await.unwrap();
        assert!(
            record.as_ref().is_none_or(|record| record.status.is_none()),
            "{lost:?}: the fenced run's answer was stored: {record:?}"
        );

        // The connection goes on as any other: its next transaction is a new one (a `BEGIN`, not
        // a savepoint inside a transaction sqlx thought was still open), and it commits.
        let next = with_ledger_row(&mut conn, "next").await;
        next.commit().await.unwrap();
        assert_eq!(db.ledger().await, ["next"], "{lost:?}");
    }
}

#[tokio::test]
async fn a_status_that_is_not_stored_rolls_the_transaction_back() {
    let (db, run, mut conn) = claimed("not-stored").await;
    let tx = with_ledger_row(&mut conn, "not-stored").await;
    let mut answer = http::Response::builder()
        .status(http::StatusCode::SERVICE_UNAVAILABLE)
        .body(Bytes::new())
        .unwrap();
    let failed = db.store.complete_in(tx, &run, &mut answer).await.err();
    assert!(matches!(failed, Some(CompleteInError::NotStored(_))), "{failed:?}");

    assert!(!conn.is_in_transaction());
    assert!(db.ledger().await.is_empty());
}
