//! `idempotent`: the handler behind the peer crate `idempotent` 2.0.0 (its tower middleware,
//! `idempotent::middleware::IdempotencyLayer`) on its Redis store (`idempotent::valkey::ValkeyStore`).
//!
//! Scoped by the `Authorization` header, as idem's default scope is, so that both layers do the
//! same job: a key is only replayed to the caller that made it.

use idempotent::middleware::IdempotencyLayer;
use idempotent::valkey::ValkeyStore;

#[tokio::main]
async fn main() {
    let addr = idem_bench_peers::listen_addr();
    // Its prefix may not contain ':' or '/'.
    let prefix = idem_bench_peers::run_prefix().replace([':', '/'], "-");
    let url = idem_bench_peers::redis_url();
    let store = ValkeyStore::with_url(url.clone())
        .prefix(prefix.clone())
        .try_build()
        .await
        .unwrap_or_else(|err| idem_bench_peers::die(&format!("cannot connect to {url}: {err}")));
    store
        .ping()
        .await
        .unwrap_or_else(|err| idem_bench_peers::die(&format!("cannot reach {url}: {err}")));
    eprintln!("idempotent: store {url} prefix {prefix}");
    let layer = IdempotencyLayer::new(store).scope(|parts| {
        parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    });
    let app = idem_bench_peers::router().layer(layer);
    idem_bench_peers::serve("idempotent", addr, app).await;
}
