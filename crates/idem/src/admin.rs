//! The admin listener: `/healthz` (the process runs), `/readyz` (the store answers) and
//! `/metrics` (Prometheus).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use idem_core::Store;
use metrics_exporter_prometheus::PrometheusHandle;

#[derive(Clone)]
struct Admin {
    store: Arc<dyn Store>,
    metrics: PrometheusHandle,
}

/// The admin routes.
pub(crate) fn router(store: Arc<dyn Store>, metrics: PrometheusHandle) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route(
            "/metrics",
            get(|State(admin): State<Admin>| async move { admin.metrics.render() }),
        )
        .with_state(Admin { store, metrics })
}

async fn ready(State(admin): State<Admin>) -> (StatusCode, String) {
    match admin.store.ping().await {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(err) => (StatusCode::SERVICE_UNAVAILABLE, format!("store unavailable: {err}\n")),
    }
}
