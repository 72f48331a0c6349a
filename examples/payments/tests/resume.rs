//! A payment whose instance dies between its two steps: the service process is killed (`kill -9`)
//! after it charged the provider and while it sends the receipt. Started again on the same store,
//! the retry takes the key over (marked recovered), finds the charge recorded as a checkpoint and
//! sends the receipt without charging again. The provider counts its charges.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::routing::post;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A payment provider that counts charges and receipts; its first receipt never answers.
#[derive(Clone, Default)]
struct Provider {
    charges: Arc<AtomicUsize>,
    receipts: Arc<AtomicUsize>,
}

async fn charge(State(provider): State<Provider>, Json(request): Json<Value>) -> Json<Value> {
    let n = provider.charges.fetch_add(1, Ordering::SeqCst) + 1;
    Json(json!({"charge": format!("ch_{n}"), "amount": request["amount"], "currency": request["currency"]}))
}

async fn receipt(State(provider): State<Provider>) -> &'static str {
    if provider.receipts.fetch_add(1, Ordering::SeqCst) == 0 {
        // The instance dies while it waits here.
        std::future::pending::<()>().await;
    }
    "sent"
}

async fn start_provider() -> (Provider, String) {
    let provider = Provider::default();
    let app = axum::Router::new()
        .route("/charges", post(charge))
        .route("/receipts", post(receipt))
        .with_state(provider.clone());
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind the provider");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (provider, format!("http://{addr}"))
}

/// The payments binary on `store`, charging `provider`, with a one-second lease.
async fn start_payments(store: &std::path::Path, provider: &str) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_payments"))
        .env("PAYMENTS_LISTEN", "127.0.0.1:0")
        .env("PAYMENTS_STORE", store)
        .env("PAYMENTS_PROVIDER", provider)
        .env("PAYMENTS_LEASE_SECS", "1")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the payments binary");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the service starts within 30 s")
        .expect("read stdout")
        .expect("a listening line");
    let base = line
        .strip_prefix("payments listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    (child, base)
}

async fn wait_for(counter: &AtomicUsize, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while counter.load(Ordering::SeqCst) < n {
        assert!(tokio::time::Instant::now() < deadline, "waited 30 s for {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_killed_between_its_steps_is_charged_once() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = dir.path().join("idem.db");
    let (provider, provider_url) = start_provider().await;
    let client = reqwest::Client::builder().no_proxy().build().expect("a client");
    let pay = |base: &str| {
        client
            .post(format!("{base}/pay"))
            .header("idempotency-key", "\"pay-killed-1\"")
            .header("content-type", "application/json")
            .body(r#"{"amount":1250,"currency":"EUR"}"#)
            .send()
    };

    let (mut first, base) = start_payments(&store, &provider_url).await;
    let lost = tokio::spawn(pay(&base));
    // Charged, and waiting for the receipt: the instance dies between the two steps.
    wait_for(&provider.receipts, 1).await;
    assert_eq!(provider.charges.load(Ordering::SeqCst), 1);
    first.kill().await.expect("kill -9 the payments process");
    assert!(
        lost.await.expect("the client task").is_err(),
        "the client heard nothing"
    );

    let (_second, base) = start_payments(&store, &provider_url).await;
    // The dead run's lease (one second) runs out; the retry takes the key over.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let retry = pay(&base).await.expect("an answer");
    assert_eq!(retry.status(), 200);
    let body: Value = retry.json().await.expect("a JSON charge");
    assert_eq!(
        body["charge"], "ch_1",
        "the retry answers with the first charge: {body}"
    );
    assert_eq!(
        provider.charges.load(Ordering::SeqCst),
        1,
        "the takeover resumed after the recorded charge instead of charging again"
    );
    assert_eq!(
        provider.receipts.load(Ordering::SeqCst),
        2,
        "the receipt was sent again"
    );

    // And the answer is stored: the next copy is a replay.
    let replay = pay(&base).await.expect("an answer");
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(provider.charges.load(Ordering::SeqCst), 1);
}
