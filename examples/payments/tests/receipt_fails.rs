//! A payment whose receipt fails once after the charge went through: `POST /pay` answers `502`,
//! which releases the key so that the retry runs. The charge is a recorded step, so the release
//! keeps it: the retry resumes after it (marked recovered) and sends the receipt without charging
//! the provider a second time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use serde_json::{Value, json};

/// A payment provider that counts charges and receipts; its first receipt fails with a `500`.
#[derive(Clone, Default)]
struct Provider {
    charges: Arc<AtomicUsize>,
    receipts: Arc<AtomicUsize>,
}

async fn charge(State(provider): State<Provider>, Json(request): Json<Value>) -> Json<Value> {
    let n = provider.charges.fetch_add(1, Ordering::SeqCst) + 1;
    Json(json!({"charge": format!("ch_{n}"), "amount": request["amount"], "currency": request["currency"]}))
}

async fn receipt(State(provider): State<Provider>) -> (StatusCode, &'static str) {
    if provider.receipts.fetch_add(1, Ordering::SeqCst) == 0 {
        (StatusCode::INTERNAL_SERVER_ERROR, "the mail server is down")
    } else {
        (StatusCode::OK, "sent")
    }
}

async fn serve(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_whose_receipt_fails_once_is_charged_once() {
    let provider = Provider::default();
    let provider_url = serve(
        axum::Router::new()
            .route("/charges", post(charge))
            .route("/receipts", post(receipt))
            .with_state(provider.clone()),
    )
    .await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = idem_sqlite::SqliteStore::open(dir.path().join("idem.db"))
        .await
        .expect("open the SQLite store");
    let config = idem_example_payments::Config {
        provider: Some(provider_url),
        ..Default::default()
    };
    let base = serve(idem_example_payments::app_with(store, config)).await;
    let client = reqwest::Client::builder().no_proxy().build().expect("a client");
    let pay = || {
        client
            .post(format!("{base}/pay"))
            .header("idempotency-key", "\"pay-receipt-fails-1\"")
            .header("content-type", "application/json")
            .body(r#"{"amount":1250,"currency":"EUR"}"#)
            .send()
    };

    let first = pay().await.expect("an answer");
    assert_eq!(first.status(), 502, "the receipt failed, so the payment answered 502");
    assert_eq!(provider.charges.load(Ordering::SeqCst), 1, "the card was charged");

    let retry = pay().await.expect("an answer");
    assert_eq!(retry.status(), 200, "the retry ran (a 502 is released)");
    assert!(
        retry.headers().get("idempotency-replayed").is_none(),
        "the retry ran rather than replaying"
    );
    let body: Value = retry.json().await.expect("a JSON charge");
    assert_eq!(
        body["charge"], "ch_1",
        "the retry answers with the first charge: {body}"
    );
    assert_eq!(
        provider.charges.load(Ordering::SeqCst),
        1,
        "the retry resumed after the recorded charge instead of charging again"
    );
    assert_eq!(
        provider.receipts.load(Ordering::SeqCst),
        2,
        "the receipt was sent again"
    );

    let replay = pay().await.expect("an answer");
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(provider.charges.load(Ordering::SeqCst), 1);
}
