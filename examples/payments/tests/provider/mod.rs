//! A payment provider for the example's tests, on a real socket: it counts charges and receipts,
//! and its first receipt fails the way a test asks. Shared by the tests of a payment whose receipt
//! step goes wrong after the charge.
#![allow(dead_code, reason = "each test crate uses one way for the first receipt to go wrong")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use serde_json::{Value, json};

/// How the provider's first receipt goes wrong.
#[derive(Clone, Copy, Debug)]
pub(crate) enum FirstReceipt {
    /// It never answers (the payments instance dies while it waits).
    Hangs,
    /// It answers `500`.
    Fails,
}

/// The provider's counters.
#[derive(Clone)]
pub(crate) struct Provider {
    pub(crate) charges: Arc<AtomicUsize>,
    pub(crate) receipts: Arc<AtomicUsize>,
    first_receipt: FirstReceipt,
}

impl Provider {
    /// Charges so far.
    pub(crate) fn charges(&self) -> usize {
        self.charges.load(Ordering::SeqCst)
    }

    /// Receipts asked for so far.
    pub(crate) fn receipts(&self) -> usize {
        self.receipts.load(Ordering::SeqCst)
    }
}

async fn charge(State(provider): State<Provider>, Json(request): Json<Value>) -> Json<Value> {
    let n = provider.charges.fetch_add(1, Ordering::SeqCst) + 1;
    Json(json!({"charge": format!("ch_{n}"), "amount": request["amount"], "currency": request["currency"]}))
}

async fn receipt(State(provider): State<Provider>) -> (StatusCode, &'static str) {
    if provider.receipts.fetch_add(1, Ordering::SeqCst) == 0 {
        match provider.first_receipt {
            FirstReceipt::Hangs => std::future::pending::<()>().await,
            FirstReceipt::Fails => return (StatusCode::INTERNAL_SERVER_ERROR, "the mail server is down"),
        }
    }
    (StatusCode::OK, "sent")
}

/// Serves `app` on an ephemeral port of 127.0.0.1; returns its base URL.
pub(crate) async fn serve(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// Starts a provider whose first receipt goes wrong as `first_receipt` says.
pub(crate) async fn start(first_receipt: FirstReceipt) -> (Provider, String) {
    let provider = Provider {
        charges: Arc::default(),
        receipts: Arc::default(),
        first_receipt,
    };
    let app = axum::Router::new()
        .route("/charges", post(charge))
        .route("/receipts", post(receipt))
        .with_state(provider.clone());
    (provider.clone(), serve(app).await)
}

/// What a user relies on once the payment's retry answered `retry` and a further copy `replay`:
/// the retry answers with the first charge, the provider charged once and was asked for the
/// receipt again, and the copy after it is a replay.
pub(crate) async fn assert_charged_once(provider: &Provider, retry: reqwest::Response, replay: reqwest::Response) {
    assert_eq!(retry.status(), 200, "the retry ran to its end");
    let body: Value = retry.json().await.expect("a JSON charge");
    assert_eq!(
        body["charge"], "ch_1",
        "the retry answers with the first charge: {body}"
    );
    assert_eq!(
        provider.charges(),
        1,
        "the retry resumed after the recorded charge instead of charging again"
    );
    assert_eq!(provider.receipts(), 2, "the receipt was sent again");
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(provider.charges(), 1);
}
