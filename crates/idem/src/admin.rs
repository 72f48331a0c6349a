//! The admin listener: `/healthz` (the process runs), `/readyz` (the store answers) and
//! `/metrics` (Prometheus), which also reads, as it is scraped, whether the replay cache's
//! channel is up.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use idem_core::store::Invalidations;
use idem_core::{Store, metric_names};
use metrics_exporter_prometheus::PrometheusHandle;

#[derive(Clone)]
struct Admin {
    store: Arc<dyn Store>,
    metrics: PrometheusHandle,
    /// The channel that tells the replay cache of deletes (`None`: no replay cache).
    channel: Option<Arc<Invalidations>>,
}

/// The admin routes; `channel` is the replay cache's, if the gateway keeps one.
pub(crate) fn router(store: Arc<dyn Store>, metrics: PrometheusHandle, channel: Option<Arc<Invalidations>>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(scrape))
        .with_state(Admin {
            store,
            metrics,
            channel,
        })
}

async fn scrape(State(admin): State<Admin>) -> String {
    // Read at each scrape rather than set where the channel changes: the stores flip it from
    // their own tasks, and a gauge is only ever seen when scraped.
    if let Some(channel) = &admin.channel {
        let up = if channel.is_listening() { 1.0 } else { 0.0 };
        metrics::gauge!(metric_names::REPLAY_CACHE_CHANNEL_UP).set(up);
    }
    admin.metrics.render()
}

async fn ready(State(admin): State<Admin>) -> (StatusCode, String) {
    match admin.store.ping().await {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(err) => (StatusCode::SERVICE_UNAVAILABLE, format!("store unavailable: {err}\n")),
    }
}
