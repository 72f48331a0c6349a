//! Clients that retry right: a [`reqwest_middleware`] middleware that makes HTTP requests safe to
//! retry, and retries them.
//!
//! [`IdempotencyMiddleware`] stamps a UUIDv7 `Idempotency-Key` on every `POST` and `PATCH` that
//! lacks one and sends the same key on every attempt, so that a server speaking the idempotency
//! protocol (such as `idem serve`) runs the request once and replays its answer to the retries. It
//! retries what is worth retrying (no answer, 408, 429, 500, 502, 503, 504, 409 `key-in-flight`;
//! see [`DefaultClassifier`]) with exponential backoff and full jitter ([`Backoff`]), honours
//! `Retry-After` (capped), keeps to an overall deadline, and draws every retry from a
//! [`RetryBudget`] shared by the whole client, so that a failing server is not hit by a retry storm.
//! A request without a key and with a non-idempotent method is never repeated once it may have
//! reached the server.
//!
//! The final response carries a [`RetryReport`]: attempts, key, whether the answer was a replay.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use idem_client::{ErrorExt, IdempotencyMiddleware, ResponseExt};
//! use reqwest_middleware::ClientBuilder;
//!
//! # async fn pay() -> Result<(), Box<dyn std::error::Error>> {
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with(
//!         IdempotencyMiddleware::new()
//!             .with_max_retries(4)
//!             .with_deadline(Duration::from_secs(20)),
//!     )
//!     .build();
//!
//! let sent = client
//!     .post("http://127.0.0.1:8080/pay")
//!     .header("content-type", "application/json")
//!     .body(r#"{"amount":10,"currency":"EUR"}"#)
//!     .send()
//!     .await;
//! match sent {
//!     Ok(response) => {
//!         let report = response.retry_report().expect("the middleware always reports");
//!         println!(
//!             "{} after {} attempt(s), key {:?}, replayed: {}",
//!             response.status(),
//!             report.attempts,
//!             report.key,
//!             report.replayed
//!         );
//!     }
//!     Err(err) => match err.retry_report() {
//!         Some(report) => println!("gave up after {} attempt(s): {err}", report.attempts),
//!         None => println!("failed: {err}"),
//!     },
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Bodies that cannot be sent twice
//!
//! A streaming body cannot be replayed, so a request with one fails with
//! [`RetryError::BodyNotReplayable`] before anything is sent, rather than silently getting a single
//! attempt. Buffer the body, or send such a request once on purpose with the [`MaxRetries`]`(0)`
//! request extension (or a middleware built with `with_max_retries(0)`).
//!
//! # TLS
//!
//! Without features the client speaks plain HTTP (reqwest is used with `default-features = false`).
//! The `rustls` feature turns on reqwest's rustls backend.
#![forbid(unsafe_code)]

mod backoff;
mod budget;
mod classify;
mod error;
mod middleware;
mod problem;
mod report;

pub use backoff::Backoff;
pub use budget::RetryBudget;
pub use classify::{DefaultClassifier, ResponseInfo, RetryClassifier, Retryable};
pub use error::RetryError;
pub use idem_core::IdempotencyKey;
pub use middleware::{IdempotencyMiddleware, MaxRetries};
pub use report::{ErrorExt, ResponseExt, RetryReport, StopReason};
pub use reqwest_middleware;
