//! `tower`: the handler behind `idem_tower::IdempotencyLayer` on `idem_redis::RedisStore`, with the
//! layer's default policy (scope: a keyed hash of `Authorization`) and its replay cache, which
//! `IDEM_REPLAY_CACHE_ENTRIES=0` turns off.

use idem_redis::RedisStore;
use idem_tower::{IdempotencyLayer, ReplayCacheConfig};

#[tokio::main]
async fn main() {
    let addr = idem_bench_peers::listen_addr();
    let prefix = idem_bench_peers::run_prefix();
    let url = format!(
        "{}/?prefix={prefix}",
        idem_bench_peers::redis_url().trim_end_matches('/')
    );
    let store = RedisStore::connect(&url)
        .await
        .unwrap_or_else(|err| idem_bench_peers::die(&format!("cannot connect to {url}: {err}")));
    eprintln!("tower: store {url}");
    let cache = match std::env::var("IDEM_REPLAY_CACHE_ENTRIES").as_deref() {
        Ok("0") => ReplayCacheConfig::OFF,
        _ => ReplayCacheConfig::DEFAULT,
    };
    eprintln!("tower: replay cache {cache:?}");
    let app = idem_bench_peers::router().layer(IdempotencyLayer::new(store).with_replay_cache(cache));
    idem_bench_peers::serve("tower", addr, app).await;
}
