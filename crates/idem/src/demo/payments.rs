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
    task: JoinHandle<()>,
}

impl Drop for Payments {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Payments {
    /// Starts on an ephemeral port of 127.0.0.1.
    pub(super) async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot listen for the payments service")?;
        let addr = listener.local_addr()?;
        let ledger = Arc::new(Ledger::default());
        let app = Router::new().route("/pay", post(pay)).with_state(ledger.clone());
        let task = tokio::spawn(async move {
            if let Err(err) = axum::serve(listener, app).await {
                tracing::error!(error = %err, "the demo's payments service failed");
            }
        });
        Ok(Self { addr, ledger, task })
    }

    /// `http://127.0.0.1:PORT`.
    pub(super) fn uri(&self) -> http::Uri {
        format!("http://{}", self.addr).parse().expect("an address makes a URI")
    }

    pub(super) fn ledger(&self) -> &Ledger {
        &self.ledger
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

    pub(super) fn tally(&self, payments: u64) -> Tally {
        let books = self.books();
        let mut tally = Tally {
            charges: 0,
            double_charges: 0,
            lost: 0,
            recovered_runs: books.recovered_runs,
        };
        for payment in 0..payments {
            match books.charges.get(&payment).copied().unwrap_or(0) {
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
async fn pay(State(ledger): State<Arc<Ledger>>, Query(query): Query<PayQuery>, headers: HeaderMap) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let recovered = headers
        .get("idempotency-recovered")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    // Charged first, before any await: a caller that vanishes afterwards cannot undo it.
    let charge = ledger.charge(query.payment, key, recovered);
    tokio::time::sleep(Duration::from_millis(2 + query.payment % 7)).await;
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/json".to_owned()),
            (header::LOCATION, format!("/charges/{charge}")),
        ],
        format!(r#"{{"charge":{charge},"payment":{}}}"#, query.payment),
    )
        .into_response()
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
