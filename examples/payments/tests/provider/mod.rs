//! A payment provider for the example's tests, on a real socket: it counts charges and receipts,
//! charges once per `Idempotency-Key` (a charge asked again under a key it has seen is the first
//! charge, not a new one), and its first charge or first receipt goes wrong the way a test asks.
//! Shared by the tests of a payment whose steps go wrong.
#![allow(
    dead_code,
    reason = "each test crate uses some of the ways for a first call to go wrong"
)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::sync::watch;

/// How the provider's first call of a kind (charge, receipt) goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum First {
    /// Like every other.
    Answers,
    /// It does its work (counts, charges), then does not answer until the test releases it
    /// ([`Provider::release`]); never, if the test does not (the payments instance dies while it
    /// waits).
    Hangs,
    /// It answers `500`.
    Fails,
}

/// The ways of the first receipt, as the tests of the checkpointed payment name them.
pub(crate) type FirstReceipt = First;

/// The provider's counters.
#[derive(Clone)]
pub(crate) struct Provider {
    /// Distinct charges made.
    pub(crate) charges: Arc<AtomicUsize>,
    /// Charge requests, copies under a known key included.
    pub(crate) charge_calls: Arc<AtomicUsize>,
    /// Receipt requests.
    pub(crate) receipts: Arc<AtomicUsize>,
    /// The charge made under each key.
    by_key: Arc<Mutex<HashMap<String, Value>>>,
    first_charge: First,
    first_receipt: First,
    /// Set to true to let a hanging first call answer.
    released: watch::Sender<bool>,
}

impl Provider {
    /// Distinct charges so far.
    pub(crate) fn charges(&self) -> usize {
        self.charges.load(Ordering::SeqCst)
    }

    /// Charge requests so far (a copy under a key already charged counts here, not in `charges`).
    pub(crate) fn charge_calls(&self) -> usize {
        self.charge_calls.load(Ordering::SeqCst)
    }

    /// Receipts asked for so far.
    pub(crate) fn receipts(&self) -> usize {
        self.receipts.load(Ordering::SeqCst)
    }

    /// Lets a hanging first call (charge or receipt) answer.
    pub(crate) fn release(&self) {
        self.released.send_replace(true);
    }

    /// Waits for [`release`](Self::release).
    async fn wait_for_release(&self) {
        let mut released = self.released.subscribe();
        // The sender lives in `self`: the channel never closes while this waits.
        let _ = released.wait_for(|released| *released).await;
    }
}

async fn charge(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Json(request): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let first = provider.charge_calls.fetch_add(1, Ordering::SeqCst) == 0;
    let key = headers
        .get("idempotency-key")
        .map(|key| String::from_utf8_lossy(key.as_bytes()).into_owned());
    if first && provider.first_charge == First::Fails {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": "the bank is down"})),
        );
    }
    let charged = {
        let mut by_key = provider.by_key.lock().expect("not poisoned");
        match key.as_ref().and_then(|key| by_key.get(key)) {
            Some(charged) => charged.clone(),
            None => {
                let n = provider.charges.fetch_add(1, Ordering::SeqCst) + 1;
                let charged =
                    json!({"charge": format!("ch_{n}"), "amount": request["amount"], "currency": request["currency"]});
                if let Some(key) = key {
                    by_key.insert(key, charged.clone());
                }
                charged
            }
        }
    };
    if first && provider.first_charge == First::Hangs {
        provider.wait_for_release().await;
    }
    (StatusCode::OK, Json(charged))
}

async fn receipt(State(provider): State<Provider>) -> (StatusCode, &'static str) {
    if provider.receipts.fetch_add(1, Ordering::SeqCst) == 0 {
        match provider.first_receipt {
            First::Answers => {}
            First::Hangs => provider.wait_for_release().await,
            First::Fails => return (StatusCode::INTERNAL_SERVER_ERROR, "the mail server is down"),
        }
    }
    (StatusCode::OK, "sent")
}

/// `POST {base}/pay` of 12.50 EUR under `key`, sent by `client`.
pub(crate) fn pay(
    client: &reqwest::Client,
    base: &str,
    key: &str,
) -> impl Future<Output = reqwest::Result<reqwest::Response>> + Send + 'static + use<> {
    client
        .post(format!("{base}/pay"))
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body(r#"{"amount":1250,"currency":"EUR"}"#)
        .send()
}

/// Waits until `counter` (one of the provider's) reaches `n`, for 30 s at most.
pub(crate) async fn wait_for(counter: &AtomicUsize, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while counter.load(Ordering::SeqCst) < n {
        assert!(tokio::time::Instant::now() < deadline, "waited 30 s for {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
pub(crate) async fn start(first_receipt: First) -> (Provider, String) {
    start_with(First::Answers, first_receipt).await
}

/// Starts a provider whose first charge and first receipt go as said.
pub(crate) async fn start_with(first_charge: First, first_receipt: First) -> (Provider, String) {
    let provider = Provider {
        charges: Arc::default(),
        charge_calls: Arc::default(),
        receipts: Arc::default(),
        by_key: Arc::default(),
        first_charge,
        first_receipt,
        released: watch::Sender::new(false),
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
