//! The in-transaction mode (`PAYMENTS_DATABASE`): the idempotency records and the payments ledger
//! share one database, and `POST /pay` completes its record in the transaction that writes its
//! ledger row. See [`app_on_database`](crate::app_on_database).

use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use idem_core::{MissingKeyPolicy, Policy, RouteRule, Routes};
use idem_postgres::{PostgresStore, StoreDatabase};
use idem_sqlite::SqliteStore;
use idem_tower::{IdempotencyInfo, IdempotencyLayer, InTransaction};
use serde::Serialize;

use crate::{Charge, Config, PayRequest, Shop};

/// The ledger's table: one row per payment, `(id, key, charge, amount, currency)`. On PostgreSQL
/// it is made in the store's schema when the URL names one (`schema=`).
///
/// `key` is indexed, not unique: on PostgreSQL a unique key would make the run that takes a
/// frozen holder's key over wait on the holder's uncommitted row until its transaction ends. The
/// fencing of `complete_in` is what keeps a holder whose key was taken over from committing.
pub const LEDGER_TABLE: &str = "payments_ledger";

/// How long a SQLite connection of the ledger waits for the file's write lock.
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the service could not start on its database.
#[derive(Debug)]
pub enum StartError {
    /// [`Config::database`] is not set.
    NoDatabase,
    /// The idempotency store could not be opened.
    Store(Box<dyn std::error::Error + Send + Sync>),
    /// The ledger's connections could not be opened, or its table made.
    Ledger(sqlx::Error),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoDatabase => f.write_str("no database is configured (PAYMENTS_DATABASE)"),
            Self::Store(err) => write!(f, "the idempotency store could not be opened: {err}"),
            Self::Ledger(err) => write!(f, "the ledger could not be opened: {err}"),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::NoDatabase => None,
            Self::Store(err) => Some(&**err),
            Self::Ledger(err) => Some(err),
        }
    }
}

/// The ledger's database and the store on it.
#[derive(Debug, Clone)]
enum Ledger {
    Postgres {
        store: PostgresStore,
        pool: sqlx::PgPool,
        /// The table, named with the store's schema if the URL gave one.
        table: String,
    },
    Sqlite {
        store: SqliteStore,
        pool: sqlx::SqlitePool,
    },
}

/// What the in-transaction `POST /pay` works with.
#[derive(Debug, Clone)]
struct Payments {
    ledger: Ledger,
    shop: Shop,
}

/// The service as `config` says, its idempotency records and its ledger both in
/// [`Config::database`]: `POST /pay` completes its record in the transaction that writes the
/// ledger row, so the answer commits with the row or neither does. The order routes keep the
/// ordinary policy: their effects are in memory, not in that database.
///
/// In this mode `POST /pay` requires an `Idempotency-Key` (`400` without one), and its answer
/// carries `"recovered"`: whether the run that made it was marked recovered.
///
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let config = idem_example_payments::Config {
///     database: Some("postgres://postgres@127.0.0.1:5432/test?schema=payments".to_owned()),
///     ..Default::default()
/// };
/// let app = idem_example_payments::app_on_database(config).await?;
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
/// axum::serve(listener, app).await?;
/// # Ok(())
/// # }
/// ```
pub async fn app_on_database(config: Config) -> Result<Router, StartError> {
    let database = config.database.as_deref().ok_or(StartError::NoDatabase)?;
    let (ledger, store): (Ledger, std::sync::Arc<dyn idem_core::Store>) = if is_postgres(database) {
        let store = PostgresStore::connect(database)
            .await
            .map_err(|err| StartError::Store(Box::new(err)))?;
        // The store read the URL already: its database, without the store's own options.
        let database = StoreDatabase::parse(database).map_err(|err| StartError::Store(Box::new(err)))?;
        let (pool, table) = postgres_ledger(&database).await.map_err(StartError::Ledger)?;
        (
            Ledger::Postgres {
                store: store.clone(),
                pool,
                table,
            },
            std::sync::Arc::new(store),
        )
    } else {
        let path = sqlite_path(database);
        let store = SqliteStore::open(path)
            .await
            .map_err(|err| StartError::Store(Box::new(err)))?;
        let pool = sqlite_ledger(path).await.map_err(StartError::Ledger)?;
        (
            Ledger::Sqlite {
                store: store.clone(),
                pool,
            },
            std::sync::Arc::new(store),
        )
    };
    let ordinary = Policy {
        lease: config.lease,
        ..Policy::default()
    };
    let pay = Policy {
        in_transaction: true,
        missing_key: MissingKeyPolicy::Require,
        ..ordinary.clone()
    };
    let routes = Routes::new()
        .with("/pay", RouteRule::Protect(pay))
        .expect("`/pay` is a valid route pattern");
    let shop = Shop::new(config.provider);
    let payments = Router::new()
        .route("/pay", post(pay_in_transaction))
        .with_state(Payments {
            ledger,
            shop: shop.clone(),
        });
    Ok(crate::orders().with_state(shop).merge(payments).layer(
        IdempotencyLayer::from_shared(store)
            .with_policy(ordinary)
            .with_routes(routes),
    ))
}

fn is_postgres(database: &str) -> bool {
    database
        .split_once("://")
        .is_some_and(|(scheme, _)| scheme.eq_ignore_ascii_case("postgres") || scheme.eq_ignore_ascii_case("postgresql"))
}

/// The file of `sqlite://relative.db`, `sqlite:///absolute.db`, `sqlite:file.db`, or a plain path.
fn sqlite_path(database: &str) -> &str {
    match database.split_once(':') {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("sqlite") => rest.strip_prefix("//").unwrap_or(rest),
        _ => database,
    }
}

/// The ledger's pool on PostgreSQL, its table made if missing (in the store's schema, which the
/// store made and whose name it checked: lower-case letters, digits and `_`).
async fn postgres_ledger(database: &StoreDatabase) -> Result<(sqlx::PgPool, String), sqlx::Error> {
    let pool = sqlx::PgPool::connect(database.url()).await?;
    let table = database.qualify(LEDGER_TABLE);
    // Two instances starting at once would race to make the table: one at a time.
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem-example-payments ledger'))")
        .execute(&mut *tx)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {table} (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
         key TEXT NOT NULL, charge TEXT, amount BIGINT NOT NULL, currency TEXT NOT NULL)"
    )))
    .execute(&mut *tx)
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE INDEX IF NOT EXISTS {LEDGER_TABLE}_key ON {table} (key)"
    )))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((pool, table))
}

/// The ledger's pool on the SQLite file (WAL, as the store has it; a busy timeout, since the
/// file has one write lock for every connection of every instance), its table made if missing.
async fn sqlite_ledger(path: &str) -> Result<sqlx::SqlitePool, sqlx::Error> {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(SQLITE_BUSY_TIMEOUT);
    let pool = sqlx::SqlitePool::connect_with(options).await?;
    let mut tx = pool.begin().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS payments_ledger (id INTEGER PRIMARY KEY, key TEXT NOT NULL, \
         charge TEXT, amount INTEGER NOT NULL, currency TEXT NOT NULL)",
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query("CREATE INDEX IF NOT EXISTS payments_ledger_key ON payments_ledger (key)")
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(pool)
}

/// The answer of the in-transaction `POST /pay`.
#[derive(Debug, Serialize)]
struct Paid<'a> {
    #[serde(flatten)]
    charge: &'a Charge,
    /// Whether the run that made this answer was marked recovered.
    recovered: bool,
}

/// What a run of the in-transaction `POST /pay` did before its answer went back.
struct Ran {
    answer: http::Response<Bytes>,
    charge: Charge,
    /// Whether the commit went through (if it did not, the layer finds the record not completed
    /// and answers `500` in place of `answer`).
    committed: bool,
}

/// `POST /pay`, completed in the ledger's transaction: `BEGIN`; the ledger row; the charge (at
/// the HTTP provider, with the request's `Idempotency-Key`, or the ledger row's own id); the
/// record completed with the answer; `COMMIT`; then the receipt.
///
/// The provider's charge is the one effect outside the transaction: it is safe because the
/// provider charges once per key. A run that dies before its commit leaves no ledger row and no
/// stored answer, so the retry runs again, unflagged, and the provider gives it the charge it
/// already made. The receipt is sent after the commit, at most once: a run that dies between
/// the two leaves an answer that replays, and no receipt.
async fn pay_in_transaction(
    State(payments): State<Payments>,
    run: Option<Extension<InTransaction>>,
    info: Option<Extension<IdempotencyInfo>>,
    headers: HeaderMap,
    Json(pay): Json<PayRequest>,
) -> Response {
    let (Some(Extension(run)), Some(Extension(info))) = (run, info) else {
        // The route requires a key and the store completes in transactions: not reached.
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            "ran without an in-transaction claim\n",
        )
            .into_response();
    };
    let Ok(amount) = i64::try_from(pay.amount) else {
        return (StatusCode::UNPROCESSABLE_ENTITY, "the amount is too large\n").into_response();
    };
    let key = info.key.as_str();
    let provider_key = headers.get("idempotency-key");
    let ran = match &payments.ledger {
        Ledger::Postgres { store, pool, table } => {
            let mut tx = match pool.begin().await {
                Ok(tx) => tx,
                Err(err) => return database_failed(&err),
            };
            let inserted = sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table} (key, amount, currency) VALUES ($1, $2, $3) RETURNING id"
            )))
            .bind(key)
            .bind(amount)
            .bind(&pay.currency)
            .fetch_one(&mut *tx)
            .await;
            let id = match inserted {
                Ok(id) => id,
                Err(err) => return database_failed(&err),
            };
            let charge = match payments.charge(id, &pay, provider_key).await {
                Ok(charge) => charge,
                Err(failed) => return failed,
            };
            let updated = sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE {table} SET charge = $1 WHERE id = $2"
            )))
            .bind(&charge.charge)
            .bind(id)
            .execute(&mut *tx)
            .await;
            if let Err(err) = updated {
                return database_failed(&err);
            }
            let mut answer = paid(&charge, info.recovered);
            if let Err(err) = store.complete_in(&mut tx, &run, &mut answer).await {
                // Not committed: the transaction rolls back when dropped (a lost claim aborted it).
                return err.problem().to_response().map(Body::from).into_response();
            }
            let committed = log_commit(tx.commit().await, key);
            Ran {
                answer,
                charge,
                committed,
            }
        }
        Ledger::Sqlite { store, pool } => {
            let mut tx = match pool.begin().await {
                Ok(tx) => tx,
                Err(err) => return database_failed(&err),
            };
            let inserted = sqlx::query_scalar::<_, i64>(
                "INSERT INTO payments_ledger (key, amount, currency) VALUES (?1, ?2, ?3) RETURNING id",
            )
            .bind(key)
            .bind(amount)
            .bind(&pay.currency)
            .fetch_one(&mut *tx)
            .await;
            let id = match inserted {
                Ok(id) => id,
                Err(err) => return database_failed(&err),
            };
            let charge = match payments.charge(id, &pay, provider_key).await {
                Ok(charge) => charge,
                Err(failed) => return failed,
            };
            let updated = sqlx::query("UPDATE payments_ledger SET charge = ?1 WHERE id = ?2")
                .bind(&charge.charge)
                .bind(id)
                .execute(&mut *tx)
                .await;
            if let Err(err) = updated {
                return database_failed(&err);
            }
            let mut answer = paid(&charge, info.recovered);
            // SQLite's `complete_in` takes the transaction: on an error it has rolled it back.
            let tx = match store.complete_in(tx, &run, &mut answer).await {
                Ok(tx) => tx,
                Err(err) => return err.problem().to_response().map(Body::from).into_response(),
            };
            let committed = log_commit(tx.commit().await, key);
            Ran {
                answer,
                charge,
                committed,
            }
        }
    };
    if ran.committed
        && let Err(err) = payments.shop.send_receipt(&ran.charge).await
    {
        // The payment stands and its answer is stored: the receipt is not worth failing it for.
        eprintln!("payments: the receipt of {} was not sent: {err:?}", ran.charge.charge);
    }
    // Marked by `complete_in`: the layer reads whether the record was completed under this run's
    // claim, and sends this answer without storing it again.
    ran.answer.map(Body::from).into_response()
}

impl Payments {
    /// The charge for ledger row `id`: at the HTTP provider, under the request's key; or the
    /// service's own, named after the row.
    async fn charge(&self, id: i64, pay: &PayRequest, key: Option<&http::HeaderValue>) -> Result<Charge, Response> {
        match &*self.shop.provider {
            crate::Provider::Books => Ok(Charge {
                charge: format!("ch_{id}"),
                amount: pay.amount,
                currency: pay.currency.clone(),
            }),
            crate::Provider::Http { .. } => self.shop.charge(pay, key).await.map_err(IntoResponse::into_response),
        }
    }
}

/// The answer to complete the record with: `200` and the charge.
fn paid(charge: &Charge, recovered: bool) -> http::Response<Bytes> {
    let body = serde_json::to_vec(&Paid { charge, recovered }).expect("a charge serializes");
    http::Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Bytes::from(body))
        .expect("a valid response")
}

/// Whether the commit went through; logs it when it did not.
fn log_commit(committed: Result<(), sqlx::Error>, key: &str) -> bool {
    match committed {
        Ok(()) => true,
        Err(err) => {
            eprintln!("payments: the payment of key {key:?} did not commit: {err}");
            false
        }
    }
}

/// The ledger's database failed before anything was completed: nothing commits, and the key is
/// released (a `5xx` is not stored), so the retry runs again. The error is logged, not shown.
fn database_failed(err: &sqlx::Error) -> Response {
    eprintln!("payments: the ledger failed: {err}");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        "the ledger is unavailable; retry with the same key\n",
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn databases_are_told_apart() {
        assert!(is_postgres("postgres://h/d"));
        assert!(is_postgres("PostgreSQL://h/d"));
        assert!(!is_postgres("sqlite://pay.db"));
        assert_eq!(sqlite_path("sqlite://pay.db"), "pay.db");
        assert_eq!(sqlite_path("sqlite:///var/lib/pay.db"), "/var/lib/pay.db");
        assert_eq!(sqlite_path("sqlite:pay.db"), "pay.db");
        assert_eq!(sqlite_path("/tmp/pay.db"), "/tmp/pay.db");
        assert_eq!(sqlite_path("pay.db"), "pay.db");
    }
}
