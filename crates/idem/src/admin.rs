//! The admin listener: `/healthz` (the process runs) and `/readyz` (the store answers).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use idem_core::Store;

/// The admin routes.
pub(crate) fn router(store: Arc<dyn Store>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(store)
}

async fn ready(State(store): State<Arc<dyn Store>>) -> (StatusCode, String) {
    match store.ping().await {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(err) => (StatusCode::SERVICE_UNAVAILABLE, format!("store unavailable: {err}\n")),
    }
}
