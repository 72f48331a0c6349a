//! A small payments service whose writes are safe to retry: [`app`] is an axum router with
//! `idem-tower`'s [`IdempotencyLayer`] in front of four routes.
//!
//! | route | does |
//! |---|---|
//! | `POST /pay` | charges `{"amount": cents, "currency": "EUR"}`; `200` with the charge |
//! | `POST /orders` | creates `{"item": "book", "quantity": 1}`; `201` with `Location: /orders/{id}` |
//! | `POST /orders/{id}/cancel` | cancels the order; `200` with the order |
//! | `GET /orders/{id}` | the order as it is now |
//!
//! Every `POST` with an `Idempotency-Key` runs once; its copies get the stored answer, marked
//! `Idempotency-Replayed: true`. That answer is what *that request* did, not the current state: a
//! replayed create still says `"status": "open"` after the order was cancelled, and its `Location`
//! leads to the order as it is now.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let store = idem_sqlite::SqliteStore::open("payments-idem.db").await?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, idem_example_payments::app(store)).await?;
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idem_tower::{IdempotencyInfo, IdempotencyLayer};
use serde::{Deserialize, Serialize};

/// The service: its routes behind the idempotency layer over `store`.
pub fn app(store: impl idem_core::Store) -> Router {
    Router::new()
        .route("/pay", post(pay))
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(order))
        .route("/orders/{id}/cancel", post(cancel_order))
        .with_state(Shop::default())
        .layer(IdempotencyLayer::new(store))
}

/// The service's own records.
#[derive(Debug, Clone, Default)]
struct Shop(Arc<Mutex<Books>>);

#[derive(Debug, Default)]
struct Books {
    orders: HashMap<u64, Order>,
    charges: Vec<Charge>,
    /// The charge made under each idempotency key, consulted when a run is marked recovered.
    charged_keys: HashMap<String, usize>,
}

impl Shop {
    fn books(&self) -> MutexGuard<'_, Books> {
        // Every critical section leaves the books consistent.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Debug, Clone, Serialize)]
struct Order {
    id: u64,
    item: String,
    quantity: u32,
    status: &'static str,
}

#[derive(Debug, Clone, Serialize)]
struct Charge {
    charge: String,
    amount: u64,
    currency: String,
}

#[derive(Debug, Deserialize)]
struct PayRequest {
    amount: u64,
    currency: String,
}

#[derive(Debug, Deserialize)]
struct OrderRequest {
    item: String,
    quantity: u32,
}

/// `POST /pay`. A run marked `recovered` (an earlier run of its key may have charged, then
/// crashed before its answer was stored) looks up its key first instead of charging again.
async fn pay(
    State(shop): State<Shop>,
    info: Option<Extension<IdempotencyInfo>>,
    Json(pay): Json<PayRequest>,
) -> Response {
    let mut books = shop.books();
    let key = info.map(|Extension(info)| (info.key.as_str().to_owned(), info.recovered));
    if let Some((key, true)) = &key
        && let Some(&index) = books.charged_keys.get(key)
    {
        return Json(books.charges[index].clone()).into_response();
    }
    let charge = Charge {
        charge: format!("ch_{}", books.charges.len() + 1),
        amount: pay.amount,
        currency: pay.currency,
    };
    books.charges.push(charge.clone());
    if let Some((key, _)) = key {
        let index = books.charges.len() - 1;
        books.charged_keys.insert(key, index);
    }
    Json(charge).into_response()
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
