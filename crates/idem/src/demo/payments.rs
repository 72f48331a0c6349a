//! The payments service behind the gateways. It charges every `POST /pay?payment=N` it receives
//! and keeps a ledger of the charges of each payment, which is what the demo's table counts.
//!
//! Like a real payment provider it remembers the `Idempotency-Key` of each charge, but it only
//! looks there when the gateway marks a run as recovered (`Idempotency-Recovered: true`: a crashed
//! instance may have charged already), which is what docs/design.md asks of an upstream. Every other
//! request is charged: the service trusts its callers to send each payment once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The running service; stops when dropped.
#[derive(Debug)]
pub(super) struct Payments {
    addr: SocketAddr,
    ledger: Arc<Ledger>,
    database: Option<Arc<Database>>,
    task: JoinHandle<()>,
}

/// The service and where it keeps its charges.
#[derive(Debug)]
struct Service {
    ledger: Arc<Ledger>,
    /// `None`: charges are made in memory, trusting the gateway's flag; `Some`: each charge is a
    /// row committed in one transaction with the answer (`idem_complete`).
    database: Option<Arc<Database>>,
}

/// The payments service's own tables, in the database of the idem store (PostgreSQL).
#[derive(Debug)]
struct Database {
    pool: deadpool_postgres::Pool,
    /// `"schema".idem_demo_charges`, or `idem_demo_charges` on the search_path.
    charges: String,
    /// `"schema".idem_complete`, where the idem store installed it.
    complete: String,
}

impl Database {
    /// Connects to the database of the idem store `store_url` (a `postgres://` URL whose idem
    /// options are dropped), in the store's schema, and makes the demo's table of charges anew.
    async fn connect(store_url: &str) -> anyhow::Result<Self> {
        let store_database = idem_postgres::StoreDatabase::parse(store_url)?;
        let pool = crate::stores::postgres_pool(&store_database, 8).context("for the payments service")?;
        let database = Self {
            pool,
            charges: store_database.qualify("idem_demo_charges"),
            complete: store_database.qualify("idem_complete"),
        };
        let client = database
            .pool
            .get()
            .await
            .context("the payments service cannot reach PostgreSQL")?;
        client
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {0}; CREATE TABLE {0} (id BIGSERIAL PRIMARY KEY, payment BIGINT NOT NULL, key TEXT)",
                database.charges
            ))
            .await
            .context("cannot create the payments service's table")?;
        Ok(database)
    }

    /// The charges committed, by payment: the truth, which a run cut off after its commit (its
    /// gateway killed) cannot miss.
    async fn committed(&self) -> anyhow::Result<HashMap<u64, u32>> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                &format!("SELECT payment, count(*) FROM {} GROUP BY payment", self.charges),
                &[],
            )
            .await?;
        rows.iter()
            .map(|row| {
                Ok((
                    u64::try_from(row.get::<_, i64>(0))?,
                    u32::try_from(row.get::<_, i64>(1))?,
                ))
            })
            .collect()
    }

    /// Charges `payment` in one transaction with the answer, completed under `token` when the
    /// gateway sent one: the charge and the answer commit together, or neither does. `Ok(None)`
    /// if the token is no longer current (another run holds the key): nothing was charged.
    async fn charge(&self, payment: u64, key: Option<&str>, token: Option<&str>) -> anyhow::Result<Option<u64>> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let payment_id = i64::try_from(payment)?;
        let row = tx
            .query_one(
                &format!(
                    "INSERT INTO {} (payment, key) VALUES ($1, $2) RETURNING id",
                    self.charges
                ),
                &[&payment_id, &key],
            )
            .await?;
        let charge = u64::try_from(row.get::<_, i64>(0))?;
        if let Some(token) = token {
            let body = answer_body(charge, payment);
            let completed = tx
                .execute(
                    &format!("SELECT {}($1, 201, $2::text::jsonb, $3)", self.complete),
                    &[
                        &token,
                        &format!(r#"{{"Content-Type": "application/json", "Location": "/charges/{charge}"}}"#),
                        &body.as_bytes(),
                    ],
                )
                .await;
            match completed {
                Ok(_) => {}
                Err(err) if err.code().is_some_and(|code| code.code() == "IDEM1") => return Ok(None),
                Err(err) => return Err(err.into()),
            }
        }
        tx.commit().await?;
        Ok(Some(charge))
    }
}

/// Takes a few milliseconds, then answers `201` with the charge.
async fn charged(charge: u64, payment: u64) -> Response {
    tokio::time::sleep(Duration::from_millis(2 + payment % 7)).await;
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/json".to_owned()),
            (header::LOCATION, format!("/charges/{charge}")),
        ],
        answer_body(charge, payment),
    )
        .into_response()
}

/// The body of a charge's answer.
fn answer_body(charge: u64, payment: u64) -> String {
    format!(r#"{{"charge":{charge},"payment":{payment}}}"#)
}

impl Drop for Payments {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Payments {
    /// Starts on an ephemeral port of 127.0.0.1; with `database` (the idem store's PostgreSQL
    /// URL), each charge commits in one transaction with its answer.
    pub(super) async fn start(database: Option<&str>) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot listen for the payments service")?;
        let addr = listener.local_addr()?;
        let ledger = Arc::new(Ledger::default());
        let database = match database {
            Some(url) => Some(Arc::new(Database::connect(url).await?)),
            None => None,
        };
        let service = Arc::new(Service {
            ledger: ledger.clone(),
            database: database.clone(),
        });
        let app = Router::new().route("/pay", post(pay)).with_state(service);
        let task = tokio::spawn(async move {
            if let Err(err) = axum::serve(listener, app).await {
                tracing::error!(error = %err, "the demo's payments service failed");
            }
        });
        Ok(Self {
            addr,
            ledger,
            database,
            task,
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub(super) fn uri(&self) -> http::Uri {
        format!("http://{}", self.addr).parse().expect("an address makes a URI")
    }

    /// What the charges say about payments `0..payments`: from the database when the charges are
    /// kept there, else from memory.
    pub(super) async fn tally(&self, payments: u64) -> anyhow::Result<Tally> {
        match &self.database {
            Some(database) => {
                let recovered_runs = self.ledger.books().recovered_runs;
                Ok(Tally::of(&database.committed().await?, payments, recovered_runs))
            }
            None => Ok(self.ledger.tally(payments)),
        }
    }
}

/// Every charge made.
#[derive(Debug, Default)]
pub(super) struct Ledger(Mutex<Books>);

#[derive(Debug, Default)]
struct Books {
    /// Charges per payment.
    charges: HashMap<u64, u32>,
    /// The charge made for each idempotency key.
    by_key: HashMap<String, u64>,
    charged: u64,
    recovered_runs: u64,
}

/// What the ledger says about payments `0..payments`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tally {
    /// Every charge made.
    pub(super) charges: u64,
    /// Charges beyond the first of a payment.
    pub(super) double_charges: u64,
    /// Payments never charged.
    pub(super) lost: u64,
    /// Runs the gateway marked recovered.
    pub(super) recovered_runs: u64,
}

impl Ledger {
    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        // Every critical section leaves the books consistent.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Charges `payment` unless this is a recovered run of a key already charged; returns the charge.
    fn charge(&self, payment: u64, key: Option<String>, recovered: bool) -> u64 {
        let mut books = self.books();
        if recovered {
            books.recovered_runs += 1;
            if let Some(charge) = key.as_ref().and_then(|key| books.by_key.get(key)) {
                return *charge;
            }
        }
        books.charged += 1;
        let charge = books.charged;
        *books.charges.entry(payment).or_default() += 1;
        if let Some(key) = key {
            books.by_key.insert(key, charge);
        }
        charge
    }

    /// A run that reached the service flagged recovered.
    fn recovered_run(&self) {
        self.books().recovered_runs += 1;
    }

    pub(super) fn tally(&self, payments: u64) -> Tally {
        let books = self.books();
        Tally::of(&books.charges, payments, books.recovered_runs)
    }
}

impl Tally {
    /// The tally of payments `0..payments` from the charges made per payment.
    fn of(charges: &HashMap<u64, u32>, payments: u64, recovered_runs: u64) -> Self {
        let mut tally = Tally {
            charges: 0,
            double_charges: 0,
            lost: 0,
            recovered_runs,
        };
        for payment in 0..payments {
            match charges.get(&payment).copied().unwrap_or(0) {
                0 => tally.lost += 1,
                n => {
                    tally.charges += u64::from(n);
                    tally.double_charges += u64::from(n - 1);
                }
            }
        }
        tally
    }
}

#[derive(Debug, serde::Deserialize)]
struct PayQuery {
    payment: u64,
}

/// `POST /pay?payment=N`: charges, takes a few milliseconds to answer, then `201` with the charge.
async fn pay(State(service): State<Arc<Service>>, Query(query): Query<PayQuery>, headers: HeaderMap) -> Response {
    let Some(database) = &service.database else {
        return pay_in_memory(&service.ledger, query, &headers).await;
    };
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let key = header("idempotency-key");
    if header("idempotency-recovered").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        service.ledger.recovered_run();
    }
    let charge = match database.charge(query.payment, key, header("idempotency-token")).await {
        Ok(Some(charge)) => charge,
        Ok(None) => return (StatusCode::CONFLICT, "another run holds this payment's key").into_response(),
        Err(err) => {
            tracing::warn!(error = %err, "the demo's payments service could not charge");
            return (StatusCode::SERVICE_UNAVAILABLE, "the payments database failed").into_response();
        }
    };
    charged(charge, query.payment).await
}

/// [`pay`] with the charges in memory: the gateway's flag is what keeps a retry from charging again.
async fn pay_in_memory(ledger: &Ledger, query: PayQuery, headers: &HeaderMap) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let recovered = headers
        .get("idempotency-recovered")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    // Charged first, before any await: a caller that vanishes afterwards cannot undo it.
    let charge = ledger.charge(query.payment, key, recovered);
    charged(charge, query.payment).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tally_adds_up() {
        let ledger = Ledger::default();
        ledger.charge(0, Some("a".into()), false);
        ledger.charge(0, Some("a".into()), false);
        ledger.charge(2, Some("c".into()), false);
        let tally = ledger.tally(3);
        assert_eq!(
            tally,
            Tally {
                charges: 3,
                double_charges: 1,
                lost: 1,
                recovered_runs: 0
            }
        );
        assert_eq!(tally.charges, 3 - tally.lost + tally.double_charges);
    }

    #[test]
    fn a_recovered_run_of_a_charged_key_is_not_charged_again() {
        let ledger = Ledger::default();
        let first = ledger.charge(7, Some("k".into()), false);
        assert_eq!(ledger.charge(7, Some("k".into()), true), first);
        assert_ne!(
            ledger.charge(8, Some("other".into()), true),
            first,
            "an unknown key is charged"
        );
        let tally = ledger.tally(9);
        assert_eq!((tally.charges, tally.double_charges, tally.recovered_runs), (2, 0, 2));
    }
}
