//! Exactly once with the business write: a handler that keeps a ledger in the store's own
//! database (PostgreSQL, and SQLite, over sqlx) completes its record inside its transaction. The
//! answer commits with the ledger row or neither does, the layer does not store the answer again,
//! and a holder whose claim was taken from it cannot commit its ledger row.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body as AxumBody;
use axum::extract::{Extension, State};
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_core::Store;
use idem_core::store::{RecordId, StoreOperation};
use idem_core::testkit::{CountingStore, counting};
use idem_postgres::PostgresStore;
use idem_sqlite::SqliteStore;
use idem_test_support::postgres_store::{TestSchema, base_url};
use idem_tower::{CompleteInError, IdempotencyInfo, IdempotencyLayer, InTransaction};
use tokio::sync::{Mutex, Notify};
use tower::ServiceExt;

/// What the next run of `POST /pay` does after its ledger row and before its commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    /// Completes the record and commits.
    Commit,
    /// Completes the record, then drops the transaction (rolled back) and answers all the same.
    RollBack,
    /// Waits for the test (which takes the claim away meanwhile), then completes and commits.
    WaitThenCommit,
}

/// The service's database: the idem store and the ledger share it.
#[derive(Clone)]
enum Db {
    Postgres {
        store: PostgresStore,
        pool: sqlx::PgPool,
        ledger: String,
    },
    Sqlite {
        store: SqliteStore,
        pool: sqlx::SqlitePool,
    },
}

#[derive(Clone)]
struct Shop {
    db: Db,
    then: Arc<Mutex<Then>>,
    /// Set by a waiting run: the record it holds, for the test to take away.
    holding: Arc<Mutex<Option<RecordId>>>,
    resume: Arc<Notify>,
    runs: Arc<AtomicUsize>,
    recovered_runs: Arc<AtomicUsize>,
    /// What the last completion in a transaction returned, as text.
    completed: Arc<Mutex<Option<String>>>,
}

struct Service {
    router: Router,
    shop: Shop,
    counted: Arc<CountingStore<Arc<dyn Store>>>,
    _cleanup: Cleanup,
}

/// What a test's store leaves behind, removed when dropped: a PostgreSQL schema, or the directory
/// of a SQLite file.
enum Cleanup {
    Schema { _schema: TestSchema },
    Dir { _dir: tempfile::TempDir },
}

async fn postgres() -> (Db, Arc<dyn Store>, Cleanup) {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    // The service's own connections: its default search_path, the ledger named with its schema,
    // so that only the store's function is found through the store's schema.
    let pool = sqlx::PgPool::connect(&base_url())
        .await
        .expect("connect the service's pool");
    let ledger = format!("\"{}\".ledger", schema.name);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {ledger} (key TEXT PRIMARY KEY)"
    )))
    .execute(&pool)
    .await
    .expect("create the ledger");
    let db = Db::Postgres {
        store: store.clone(),
        pool,
        ledger,
    };
    (db, Arc::new(store), Cleanup::Schema { _schema: schema })
}

async fn sqlite() -> (Db, Arc<dyn Store>, Cleanup) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("shop.db");
    let store = SqliteStore::open(&path).await.expect("open the store");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&path)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(std::time::Duration::from_secs(5));
    let pool = sqlx::SqlitePool::connect_with(options)
        .await
        .expect("open the service's pool");
    sqlx::query("CREATE TABLE ledger (key TEXT PRIMARY KEY)")
        .execute(&pool)
        .await
        .expect("create the ledger");
    (
        Db::Sqlite {
            store: store.clone(),
            pool,
        },
        Arc::new(store),
        Cleanup::Dir { _dir: dir },
    )
}

async fn service((db, store, cleanup): (Db, Arc<dyn Store>, Cleanup)) -> Service {
    let counted = Arc::new(counting(store));
    let shop = Shop {
        db,
        then: Arc::new(Mutex::new(Then::Commit)),
        holding: Arc::default(),
        resume: Arc::default(),
        runs: Arc::default(),
        recovered_runs: Arc::default(),
        completed: Arc::default(),
    };
    let router = Router::new()
        .route("/pay", post(pay))
        .with_state(shop.clone())
        .layer(IdempotencyLayer::from_shared(counted.clone()).with_in_transaction(true));
    Service {
        router,
        shop,
        counted,
        _cleanup: cleanup,
    }
}

/// `POST /pay`: one ledger row for the key, then the answer completed in the same transaction.
async fn pay(
    State(shop): State<Shop>,
    Extension(run): Extension<InTransaction>,
    Extension(info): Extension<IdempotencyInfo>,
) -> Response {
    shop.runs.fetch_add(1, Ordering::SeqCst);
    if info.recovered {
        shop.recovered_runs.fetch_add(1, Ordering::SeqCst);
    }
    let then = *shop.then.lock().await;
    let key = info.key.as_str().to_owned();
    let mut answer = http::Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .body(Bytes::from(format!(r#"{{"charged":"{key}"}}"#)))
        .expect("a response");
    let wait = async {
        if then == Then::WaitThenCommit {
            let resumed = shop.resume.notified();
            *shop.holding.lock().await = Some(run.id().clone());
            resumed.await;
        }
    };
    let done = match &shop.db {
        Db::Postgres { store, pool, ledger } => {
            let mut tx = pool.begin().await.expect("begin");
            sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {ledger} (key) VALUES ($1)")))
                .bind(&key)
                .execute(&mut *tx)
                .await
                .expect("the ledger row");
            wait.await;
            let done = store.complete_in(&mut tx, &run, &mut answer).await;
            finish(tx, then).await;
            done
        }
        Db::Sqlite { store, pool } => {
            // Before the first write: a SQLite transaction that wrote holds the database's one
            // write lock, which the test's delete would wait for.
            wait.await;
            let mut tx = pool.begin().await.expect("begin");
            sqlx::query("INSERT INTO ledger (key) VALUES (?1)")
                .bind(&key)
                .execute(&mut *tx)
                .await
                .expect("the ledger row");
            // Takes the transaction: a fenced completion has rolled it back, so there is
            // nothing left to commit (SQLite cannot keep a failed transaction open).
            match store.complete_in(tx, &run, &mut answer).await {
                Ok(tx) => {
                    finish(tx, then).await;
                    Ok(())
                }
                Err(err) => Err(err),
            }
        }
    };
    *shop.completed.lock().await = Some(match &done {
        Ok(()) => "ok".to_owned(),
        Err(CompleteInError::Fenced) => "fenced".to_owned(),
        Err(err) => err.to_string(),
    });
    match done {
        Ok(()) => answer.map(AxumBody::from).into_response(),
        Err(err) => err.problem().to_response().map(AxumBody::from).into_response(),
    }
}

/// Commits, as a handler that ignores what its completion returned would (the completion must
/// keep a lost claim's writes from committing all the same), or rolls back.
async fn finish<DB: sqlx::Database>(tx: sqlx::Transaction<'_, DB>, then: Then) {
    match then {
        Then::Commit | Then::WaitThenCommit => drop(tx.commit().await),
        Then::RollBack => drop(tx),
    }
}

impl Service {
    async fn pay(&self, key: &str) -> (StatusCode, http::HeaderMap, String) {
        let request = Request::post("/pay")
            .header("idempotency-key", format!("\"{key}\""))
            .body(AxumBody::empty())
            .expect("a request");
        let response = self.router.clone().oneshot(request).await.expect("infallible");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("the body").to_bytes();
        (parts.status, parts.headers, String::from_utf8_lossy(&body).into_owned())
    }

    async fn ledger_rows(&self, key: &str) -> i64 {
        match &self.shop.db {
            Db::Postgres { pool, ledger, .. } => {
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT count(*) FROM {ledger} WHERE key = $1"
                )))
                .bind(key)
                .fetch_one(pool)
                .await
            }
            Db::Sqlite { pool, .. } => {
                sqlx::query_scalar("SELECT count(*) FROM ledger WHERE key = ?1")
                    .bind(key)
                    .fetch_one(pool)
                    .await
            }
        }
        .expect("count the ledger")
    }

    fn runs(&self) -> (usize, usize) {
        (
            self.shop.runs.load(Ordering::SeqCst),
            self.shop.recovered_runs.load(Ordering::SeqCst),
        )
    }

    async fn completed(&self) -> Option<String> {
        self.shop.completed.lock().await.clone()
    }
}

async fn a_committed_completion_is_the_answer_and_is_not_stored_again(service: Service) {
    let (status, _, body) = service.pay("k1").await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body, r#"{"charged":"k1"}"#);
    assert_eq!(service.completed().await.as_deref(), Some("ok"));
    assert_eq!(
        service.counted.count(StoreOperation::Complete),
        0,
        "the answer was stored by the handler's transaction, not again by the layer"
    );
    assert_eq!(
        service.counted.count(StoreOperation::ClaimState),
        1,
        "one read confirms the commit"
    );

    let (status, headers, replayed) = service.pay("k1").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        headers.get("idempotency-replayed").map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(replayed, body, "the retry replays the answer the transaction stored");
    assert_eq!(service.ledger_rows("k1").await, 1);
    assert_eq!(service.runs(), (1, 0));
}

async fn a_transaction_that_did_not_commit_leaves_nothing_and_the_retry_runs_unflagged(service: Service) {
    *service.shop.then.lock().await = Then::RollBack;
    let (status, _, body) = service.pay("k2").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert!(body.contains("did not commit"), "{body}");
    assert_eq!(service.ledger_rows("k2").await, 0, "rolled back with the answer");

    *service.shop.then.lock().await = Then::Commit;
    let (status, headers, body) = service.pay("k2").await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert!(headers.get("idempotency-replayed").is_none(), "it ran");
    assert_eq!(service.ledger_rows("k2").await, 1);
    assert_eq!(
        service.runs(),
        (2, 0),
        "the retry ran, unflagged: nothing of the first stood"
    );
}

async fn a_holder_whose_claim_was_taken_cannot_commit_its_writes(service: Service) {
    *service.shop.then.lock().await = Then::WaitThenCommit;
    let first = tokio::spawn({
        let router = service.router.clone();
        async move {
            let request = Request::post("/pay")
                .header("idempotency-key", "\"k3\"")
                .body(AxumBody::empty())
                .expect("a request");
            router.oneshot(request).await.expect("infallible").status()
        }
    });
    let id = loop {
        if let Some(id) = service.shop.holding.lock().await.clone() {
            break id;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    };
    // The operator's delete fences the holder, as a takeover after its lease would.
    let store: &dyn Store = &*service.counted;
    store.delete(&id).await.expect("delete the record in flight");
    service.shop.resume.notify_one();
    let status = first.await.expect("the first request");
    assert_eq!(service.completed().await.as_deref(), Some("fenced"));
    assert_eq!(status, StatusCode::CONFLICT, "the run that holds the key now answers");
    assert_eq!(
        service.ledger_rows("k3").await,
        0,
        "the fenced holder's ledger row never committed, though it asked to commit"
    );

    // The key is unknown after the delete: the next run recovers, and commits.
    *service.shop.then.lock().await = Then::Commit;
    let (status, _, body) = service.pay("k3").await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(service.ledger_rows("k3").await, 1);
    assert_eq!(service.runs(), (2, 1));
}

macro_rules! on_both_stores {
    ($($case:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::service(super::postgres().await).await).await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::service(super::sqlite().await).await).await;
                }
            )*
        }
    };
}

on_both_stores!(
    a_committed_completion_is_the_answer_and_is_not_stored_again,
    a_transaction_that_did_not_commit_leaves_nothing_and_the_retry_runs_unflagged,
    a_holder_whose_claim_was_taken_cannot_commit_its_writes,
);
