//! A payment whose receipt fails once after the charge went through: `POST /pay` answers `502`,
//! which releases the key so that the retry runs. The charge is a recorded step, so the release
//! keeps it: the retry resumes after it (marked recovered) and sends the receipt without charging
//! the provider a second time.

mod provider;

use provider::{FirstReceipt, assert_charged_once, serve};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_whose_receipt_fails_once_is_charged_once() {
    let (provider, provider_url) = provider::start(FirstReceipt::Fails).await;
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
    let pay = || provider::pay(&client, &base, "pay-receipt-fails-1");

    let first = pay().await.expect("an answer");
    assert_eq!(first.status(), 502, "the receipt failed, so the payment answered 502");
    assert_eq!(provider.charges(), 1, "the card was charged");

    let retry = pay().await.expect("an answer");
    assert!(
        retry.headers().get("idempotency-replayed").is_none(),
        "the retry ran rather than replaying (a 502 is released)"
    );
    let replay = pay().await.expect("an answer");
    assert_charged_once(&provider, retry, replay).await;
}
