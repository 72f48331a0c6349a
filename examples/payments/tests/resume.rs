//! A payment whose instance dies between its two steps: the service process is killed (`kill -9`)
//! after it charged the provider and while it sends the receipt. Started again on the same store,
//! the retry takes the key over (marked recovered), finds the charge recorded as a checkpoint and
//! sends the receipt without charging again. The provider counts its charges.

mod provider;
mod service;

use std::time::Duration;

use provider::{FirstReceipt, assert_charged_once, wait_for};
use tokio::process::Child;

/// The payments binary on `store`, charging `provider`, with a one-second lease.
async fn start_payments(store: &std::path::Path, provider: &str) -> (Child, String) {
    let store = store.to_str().expect("a UTF-8 temporary path");
    service::start_payments(&[
        ("PAYMENTS_STORE", store),
        ("PAYMENTS_PROVIDER", provider),
        ("PAYMENTS_LEASE_SECS", "1"),
    ])
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_killed_between_its_steps_is_charged_once() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = dir.path().join("idem.db");
    let (provider, provider_url) = provider::start(FirstReceipt::Hangs).await;
    let client = reqwest::Client::builder().no_proxy().build().expect("a client");
    let pay = |base: &str| provider::pay(&client, base, "pay-killed-1");

    let (mut first, base) = start_payments(&store, &provider_url).await;
    let lost = tokio::spawn(pay(&base));
    // Charged, and waiting for the receipt: the instance dies between the two steps.
    wait_for(&provider.receipts, 1).await;
    assert_eq!(provider.charges(), 1);
    first.kill().await.expect("kill -9 the payments process");
    assert!(
        lost.await.expect("the client task").is_err(),
        "the client heard nothing"
    );

    let (_second, base) = start_payments(&store, &provider_url).await;
    // The dead run's lease (one second) runs out; the retry takes the key over.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let retry = pay(&base).await.expect("an answer");
    // And the answer is stored: the next copy is a replay.
    let replay = pay(&base).await.expect("an answer");
    assert_charged_once(&provider, retry, replay).await;
}
