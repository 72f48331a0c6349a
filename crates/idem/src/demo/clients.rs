//! The clients: each pays one payment after another with `idem-client`, which stamps a key on
//! each payment and retries it (backoff with jitter, `Retry-After`) with the same key.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use idem_client::reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use idem_client::{ErrorExt, IdempotencyMiddleware, ResponseExt, RetryBudget};

/// Retries after the first attempt: more than the network's faulty attempts plus a crash.
const RETRIES: u32 = 10;
/// The first retry's backoff window, and the longest.
const BASE_DELAY: Duration = Duration::from_millis(50);
const MAX_DELAY: Duration = Duration::from_secs(1);
/// One attempt's limit: above the gateways' wait for a copy in flight.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(15);
/// One payment's limit, every attempt and wait included: long enough to outlast a crashed
/// instance's leases.
pub(super) const DEADLINE: Duration = Duration::from_secs(40);

/// How one payment ended for its client.
#[derive(Debug, Clone, Copy)]
pub(super) struct Paid {
    /// The final answer was a 2xx.
    pub(super) ok: bool,
    pub(super) attempts: u32,
    /// The final answer was a replay of a stored answer.
    pub(super) replayed: bool,
}

/// Sends payments `0..payments` to `url` from `clients` clients at once; `done` counts the
/// payments whose client has finished.
pub(super) async fn pay_all(url: &str, payments: u64, clients: u16, done: Arc<AtomicU64>) -> anyhow::Result<Vec<Paid>> {
    let next = Arc::new(AtomicU64::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let client = client()?;
        let (url, next, done) = (url.to_owned(), next.clone(), done.clone());
        workers.spawn(async move {
            let mut paid = Vec::new();
            loop {
                let payment = next.fetch_add(1, Ordering::Relaxed);
                if payment >= payments {
                    return paid;
                }
                paid.push((payment, pay(&client, &url, payment).await));
                done.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    let mut all = Vec::with_capacity(usize::try_from(payments).unwrap_or(0));
    while let Some(paid) = workers.join_next().await {
        all.extend(paid.context("a client panicked")?);
    }
    all.sort_by_key(|(payment, _)| *payment);
    Ok(all.into_iter().map(|(_, paid)| paid).collect())
}

/// One client: no connection reuse, so that each attempt is a connection of its own that the
/// balancer sends to the next instance.
fn client() -> anyhow::Result<ClientWithMiddleware> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .timeout(ATTEMPT_TIMEOUT)
        .build()
        .context("cannot build an HTTP client")?;
    // The budget would stop a retry storm against a failing server; here the network fails on
    // purpose and every payment is meant to get through, so only retries and deadline bound it.
    let retries = IdempotencyMiddleware::new()
        .with_max_retries(RETRIES)
        .with_base_delay(BASE_DELAY)
        .with_max_delay(MAX_DELAY)
        .with_deadline(DEADLINE)
        .with_budget(RetryBudget::unlimited());
    Ok(ClientBuilder::new(http).with(retries).build())
}

async fn pay(client: &ClientWithMiddleware, url: &str, payment: u64) -> Paid {
    let sent = client
        .post(format!("{url}/pay?payment={payment}"))
        .header("content-type", "application/json")
        .body(format!(r#"{{"amount":{},"currency":"EUR"}}"#, 500 + payment % 100 * 25))
        .send()
        .await;
    match sent {
        Ok(response) => {
            let report = response.retry_report().cloned();
            let ok = response.status().is_success() && response.bytes().await.is_ok();
            Paid {
                ok,
                attempts: report.as_ref().map_or(1, |r| r.attempts),
                replayed: report.is_some_and(|r| r.replayed),
            }
        }
        Err(err) => Paid {
            ok: false,
            attempts: err.retry_error().and_then(|e| e.report()).map_or(1, |r| r.attempts),
            replayed: false,
        },
    }
}
