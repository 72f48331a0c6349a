//! A [`tower::Layer`](tower_layer::Layer) that makes HTTP requests safe to retry: each
//! `Idempotency-Key` runs once, and every copy gets the stored answer.
//!
//! The protocol itself lives in [`idem_core`]; this crate buffers bodies, runs keyed handlers in
//! their own tasks (so a caller that hangs up does not cancel them) while renewing their lease,
//! and stores or releases their answers. A handler can record the steps it has done
//! ([`Checkpoints`]), so that a run taking over from a crashed one resumes after them.
//!
//! A handler whose data lives in the store's database can complete its record inside its own
//! transaction ([`IdempotencyLayer::with_in_transaction`], [`InTransaction`]): the answer commits
//! with the business writes, or neither does.
//!
//! Each keyed request runs in a span (`idempotency`, target `idem_spans`: its outcome, route,
//! scope, key, whether it was replayed or recovered), with a child span around the inner service
//! (`upstream`) and one per store operation. They cost nothing unless a subscriber enables them.
//! With the `opentelemetry` feature and a `tracing-opentelemetry` layer, the span continues the
//! caller's trace context (read with the global text-map propagator), the record keeps the span's
//! place in its trace (`idem list`, `idem inspect`), and a replay's span links to the run that made
//! the answer.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use idem_sqlite::SqliteStore;
//! use idem_tower::IdempotencyLayer;
//! use std::time::Duration;
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::open("idem.db").await?;
//! let app = Router::new()
//!     .route("/pay", post(|| async { (axum::http::StatusCode::CREATED, "charged") }))
//!     .layer(IdempotencyLayer::new(store).with_ttl(Duration::from_secs(24 * 3600)));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await?;
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

mod body;
mod checkpoints;
mod layer;
mod routing;
mod service;
mod trace;

pub use body::{Body, BoxError};
pub use checkpoints::{CheckpointError, Checkpoints, MAX_CHECKPOINT_BYTES, MAX_CHECKPOINT_NAME};
pub use idem_core::{
    IDEMPOTENCY_RECOVERED,
    protocol::{CompleteInError, IdempotencyInfo, InTransaction, NoAnswer},
    replay_cache::ReplayCacheConfig,
};
pub use layer::IdempotencyLayer;
pub use service::IdempotencyService;
