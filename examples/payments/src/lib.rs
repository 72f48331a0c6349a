//! A small payments service whose writes are safe to retry: [`app`] is an axum router with
//! `idem-tower`'s [`IdempotencyLayer`] in front of four routes.
//!
//! | route | does |
//! |---|---|
//! | `POST /pay` | charges `{"amount": cents, "currency": "EUR"}`, then sends a receipt; `200` with the charge |
//! | `POST /orders` | creates `{"item": "book", "quantity": 1}`; `201` with `Location: /orders/{id}` |
//! | `POST /orders/{id}/cancel` | cancels the order; `200` with the order |
//! | `GET /orders/{id}` | the order as it is now |
//!
//! Every `POST` with an `Idempotency-Key` runs once; its copies get the stored answer, marked
//! `Idempotency-Replayed: true`. That answer is what *that request* did, not the current state: a
//! replayed create still says `"status": "open"` after the order was cancelled, and its `Location`
//! leads to the order as it is now.
//!
//! `POST /pay` does two steps with effects outside it: it charges the provider, then sends the
//! receipt. The charge is a [`Checkpoints::step`]: when the instance dies between the two, the run
//! that takes the key over (marked recovered) finds the charge recorded and sends the receipt
//! without charging again. The provider is the service's own books, or an HTTP service
//! ([`Config::provider`]: `POST /charges`, `POST /receipts`).
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let store = idem_sqlite::SqliteStore::open("payments-idem.db").await?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, idem_example_payments::app(store)).await?;
//! # Ok(())
//! # }
//! ```
//!
//! ## Exactly once with the ledger
//!
//! With [`Config::database`] (`PAYMENTS_DATABASE`: a `postgres://` URL or a SQLite file),
//! [`app_on_database`] keeps a ledger (table [`LEDGER_TABLE`]) in the same database as the
//! idempotency records, and `POST /pay` completes its record in the transaction that writes the
//! ledger row (`idem_tower::InTransaction`, the stores' `complete_in`): the stored answer commits
//! with the row, or neither does. A run that dies before its commit leaves nothing, and its retry
//! runs again *unflagged*; a run frozen past its lease whose key was taken over cannot commit its
//! row (on SQLite the frozen holder keeps the file's write lock, so no one takes its key over
//! until it resumes). The one effect outside the transaction, the provider's charge, is safe
//! because the service passes the request's `Idempotency-Key` on to the provider, which must
//! charge once per key: a provider that does not cannot be called from such a handler. The
//! receipt is sent after the commit, at most once. Only `/pay` is in-transaction: the order
//! routes keep the ordinary policy, since their effects are in memory.
#![forbid(unsafe_code)]

mod in_transaction;

pub use in_transaction::{LEDGER_TABLE, StartError, app_on_database};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idem_tower::{CheckpointError, Checkpoints, IdempotencyLayer};
use serde::{Deserialize, Serialize};

/// How the service runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The payment provider's base URL (`POST /charges`, `POST /receipts`); `None`: the
    /// service's own books stand in for it.
    pub provider: Option<String>,
    /// The lease of a running request: how soon a request whose instance died can be taken over.
    pub lease: Duration,
    /// The database that holds both the idempotency records and the payments ledger
    /// (`PAYMENTS_DATABASE`): a `postgres://` URL, or a SQLite file (`sqlite://relative.db`,
    /// `sqlite:///absolute.db`, or a plain path). When set, [`app_on_database`] opens it and
    /// `POST /pay` completes its record in the transaction that writes the ledger row.
    pub database: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            provider: None,
            lease: Duration::from_secs(60),
            database: None,
        }
    }
}

/// The service: its routes behind the idempotency layer over `store`.
pub fn app(store: impl idem_core::Store) -> Router {
    app_with(store, Config::default())
}

/// The service as `config` says, its records in `store` (`config.database` is not read here:
/// see [`app_on_database`]).
pub fn app_with(store: impl idem_core::Store, config: Config) -> Router {
    let shop = Shop::new(config.provider);
    Router::new()
        .route("/pay", post(pay))
        .merge(orders())
        .with_state(shop)
        .layer(IdempotencyLayer::new(store).with_lease(config.lease))
}

/// The order routes, whose effects are in the service's memory.
fn orders() -> Router<Shop> {
    Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(order))
        .route("/orders/{id}/cancel", post(cancel_order))
}

/// The service's own records, and where it charges.
#[derive(Debug, Clone)]
struct Shop {
    books: Arc<Mutex<Books>>,
    provider: Arc<Provider>,
}

#[derive(Debug, Default)]
struct Books {
    orders: HashMap<u64, Order>,
    charges: Vec<Charge>,
    receipts: Vec<String>,
}

/// Who moves the money.
#[derive(Debug)]
enum Provider {
    /// The service's own books.
    Books,
    /// A payment provider over HTTP.
    Http { base: String, client: reqwest::Client },
}

impl Shop {
    /// Books of its own, charging the HTTP provider at `provider` if given.
    fn new(provider: Option<String>) -> Self {
        let provider = match provider {
            Some(base) => Provider::Http {
                base,
                client: reqwest::Client::builder()
                    .no_proxy()
                    .timeout(Duration::from_secs(30))
                    .build()
                    .expect("an HTTP client without TLS builds"),
            },
            None => Provider::Books,
        };
        Self {
            books: Arc::default(),
            provider: Arc::new(provider),
        }
    }

    fn books(&self) -> MutexGuard<'_, Books> {
        // Every critical section leaves the books consistent.
        self.books.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Charges the provider; `key`, when given, is sent as the charge's `Idempotency-Key`, by
    /// which the provider charges once however often it is asked.
    async fn charge(&self, pay: &PayRequest, key: Option<&HeaderValue>) -> Result<Charge, PayError> {
        match &*self.provider {
            Provider::Books => {
                let mut books = self.books();
                let charge = Charge {
                    charge: format!("ch_{}", books.charges.len() + 1),
                    amount: pay.amount,
                    currency: pay.currency.clone(),
                };
                books.charges.push(charge.clone());
                Ok(charge)
            }
            Provider::Http { base, client } => {
                let mut request = client.post(format!("{base}/charges")).json(pay);
                if let Some(key) = key {
                    request = request.header("idempotency-key", key.clone());
                }
                let sent = request.send().await;
                let answer = sent.and_then(reqwest::Response::error_for_status);
                match answer {
                    Ok(answer) => answer.json().await.map_err(PayError::provider),
                    Err(err) => Err(PayError::provider(err)),
                }
            }
        }
    }

    async fn send_receipt(&self, charge: &Charge) -> Result<(), PayError> {
        match &*self.provider {
            Provider::Books => {
                self.books().receipts.push(charge.charge.clone());
                Ok(())
            }
            Provider::Http { base, client } => {
                let sent = client.post(format!("{base}/receipts")).json(charge).send().await;
                sent.and_then(reqwest::Response::error_for_status)
                    .map(drop)
                    .map_err(PayError::provider)
            }
        }
    }
}

/// Why a payment failed.
#[derive(Debug)]
enum PayError {
    /// The provider did not answer, or refused.
    Provider(String),
    /// The step could not be recorded or read.
    Checkpoint(CheckpointError),
}

impl PayError {
    fn provider(err: reqwest::Error) -> Self {
        Self::Provider(err.to_string())
    }
}

impl From<CheckpointError> for PayError {
    fn from(err: CheckpointError) -> Self {
        Self::Checkpoint(err)
    }
}

impl IntoResponse for PayError {
    fn into_response(self) -> Response {
        match self {
            Self::Provider(err) => (StatusCode::BAD_GATEWAY, format!("the payment provider failed: {err}\n")),
            // Another run holds the key now and answers the client; this one stops here.
            Self::Checkpoint(CheckpointError::Fenced) => {
                (StatusCode::CONFLICT, "taken over by another run\n".to_owned())
            }
            Self::Checkpoint(err) => (StatusCode::SERVICE_UNAVAILABLE, format!("{err}\n")),
        }
        .into_response()
    }
}

#[derive(Debug, Clone, Serialize)]
struct Order {
    id: u64,
    item: String,
    quantity: u32,
    status: &'static str,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Charge {
    charge: String,
    amount: u64,
    currency: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct PayRequest {
    amount: u64,
    currency: String,
}

#[derive(Debug, Deserialize)]
struct OrderRequest {
    item: String,
    quantity: u32,
}

/// `POST /pay`: charges, then sends the receipt. The charge is a checkpointed step: a run that
/// takes over from one that died after charging gets the recorded charge and does not charge
/// again. (A keyless payment has no checkpoints: it is simply charged.)
async fn pay(
    State(shop): State<Shop>,
    steps: Option<Extension<Checkpoints>>,
    Json(pay): Json<PayRequest>,
) -> Result<Json<Charge>, PayError> {
    let charge = match steps {
        Some(Extension(steps)) => steps.step("charge_created", || shop.charge(&pay, None)).await?,
        None => shop.charge(&pay, None).await?,
    };
    shop.send_receipt(&charge).await?;
    Ok(Json(charge))
}

/// `POST /orders`: `201 Created` with `Location`, so that a replay leads to the current state.
async fn create_order(State(shop): State<Shop>, Json(request): Json<OrderRequest>) -> Response {
    if request.quantity == 0 {
        return (StatusCode::UNPROCESSABLE_ENTITY, "quantity must be at least 1\n").into_response();
    }
    let mut books = shop.books();
    let id = books.orders.len() as u64 + 1;
    let order = Order {
        id,
        item: request.item,
        quantity: request.quantity,
        status: "open",
    };
    books.orders.insert(id, order.clone());
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{id}"))],
        Json(order),
    )
        .into_response()
}

/// `POST /orders/{id}/cancel`: cancelling a cancelled order changes nothing.
async fn cancel_order(State(shop): State<Shop>, Path(id): Path<u64>) -> Response {
    match shop.books().orders.get_mut(&id) {
        Some(order) => {
            order.status = "cancelled";
            Json(order.clone()).into_response()
        }
        None => not_found(id),
    }
}

/// `GET /orders/{id}`: the order as it is now.
async fn order(State(shop): State<Shop>, Path(id): Path<u64>) -> Response {
    match shop.books().orders.get(&id) {
        Some(order) => Json(order.clone()).into_response(),
        None => not_found(id),
    }
}

fn not_found(id: u64) -> Response {
    (StatusCode::NOT_FOUND, format!("no order {id}\n")).into_response()
}
