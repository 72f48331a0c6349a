//! `idem serve`: the idempotency layer around the proxy, the admin listener, the background
//! purger and a graceful shutdown that lets running requests finish and store their answers
//! within `--shutdown-grace`. How connections are held is in [`crate::listener`], TLS in
//! [`crate::tls`]; `idem demo` runs the same [`Gateway`] in-process (`demo::instance`).

use std::future::Future;
use std::time::Duration;

use anyhow::Context as _;
use std::sync::Arc;

use idem_core::replay_cache::ReplayCacheConfig;
use idem_core::{
    Keyring, Policy, RouteRule, Routes, ScopeSecrets, Store, protocol::Protocol, redact_url, store::StoreClock,
};
use idem_tower::IdempotencyLayer;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cli::ServeArgs;
use crate::config::{Limits, ServeConfig};
use crate::instrumented::{self, Prometheus};
use crate::proxy::Proxy;
use crate::telemetry::Telemetry;
use crate::{admin, listener, stores, tls};

/// The buckets of every latency histogram, in seconds: from a local store's half millisecond to
/// an upstream's minute.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The buckets of `idem_run_seconds`: the latency buckets, then on to the run timeout's default
/// (5 min) and past it, so that a route's runs can be compared with its run timeout.
const RUN_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// How often the background purger runs, and how many records one batch touches.
const PURGE_EVERY: Duration = Duration::from_secs(60);
const PURGE_BATCH: usize = 1000;

pub(crate) async fn run(args: ServeArgs, telemetry: &Telemetry) -> anyhow::Result<()> {
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        // Histograms, never summaries: buckets add up across instances, quantiles do not.
        .set_buckets(LATENCY_BUCKETS)
        .and_then(|builder| {
            builder.set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full(idem_core::metric_names::RUN_SECONDS.to_owned()),
                RUN_BUCKETS,
            )
        })
        .context("the metrics' buckets")?
        .install_recorder()
        .context("cannot install the metrics recorder")?;
    let config = ServeConfig::load(args)?;
    warn_of_no_expired_window(&config.policy, &config.routes);
    instrumented::at_start(&config.policy, &config.routes);
    let proxy = Proxy::with_options(
        config.upstream.clone(),
        config.upstream_timeout,
        &config.upstream_options,
    )
    .map_err(|err| config.place(err))?;
    let tls = tls::listener(config.tls_cert.as_deref(), config.tls_key.as_deref()).map_err(|err| config.place(err))?;
    let limits = config.limits.clone();
    let store: Arc<dyn Store> = Arc::new(idem_core::store::Observed::new(
        stores::open(&config.store, Some(idem_postgres::Access::Serve)).await?,
        Prometheus,
    ));
    // Leases and expiry are judged on the store's clock: measure it before the first request.
    let clock = StoreClock::new(store.clone());
    match clock.sync().await {
        Ok(offset_ms) => tracing::info!(offset_ms, "measured the store's clock against this machine's"),
        Err(err) => {
            tracing::warn!(error = %err, "could not read the store's clock; using this machine's until it answers")
        }
    }
    if let Some(keyring) = &config.keyring {
        let keys: Vec<&str> = keyring.ids().collect();
        tracing::info!(sealing_key = keys[0], ?keys, "stored answers are sealed at rest");
    }
    let protection = Protection {
        policy: config.policy.clone(),
        routes: config.routes.clone(),
        keyring: config.keyring.clone(),
        scope_secrets: config.scope_secrets.clone(),
        replay_cache: config.replay_cache,
    };
    let gateway = Gateway::protected(store.clone(), clock, protection, proxy);
    let replay_cache = gateway.protocol.as_ref().and_then(Protocol::replay_cache);
    // What `/metrics` reads the replay cache's channel from: the store's, which the cache watches.
    let channel = replay_cache.and_then(|_| store.invalidations());
    match replay_cache {
        Some(cache) => {
            let config = cache.config();
            tracing::info!(
                entries = config.entries,
                bytes = config.bytes,
                max_age = ?config.max_age,
                "replays of answers read before are answered from memory (the replay cache)"
            );
        }
        None if !config.replay_cache.is_off() => tracing::info!(
            "no replay cache: the store has no channel to announce deletes on (a PostgreSQL store with notify=off)"
        ),
        None => {}
    }
    if let Some(protocol) = &gateway.protocol {
        // Read (or, in a new store, made) before the first request: the first store to have a
        // salt notes until when the records from before it may live.
        match protocol.credential_scopes().await {
            Ok(scopes) => tracing::info!(
                ?scopes,
                secret = config.scope_secrets.has_secret(),
                "credential scopes are keyed by the store's salt"
            ),
            Err(err) => {
                tracing::warn!(error = %err, "could not read the store's scope salt; it is read at the first request with a credential")
            }
        }
    }

    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let admin_listener = TcpListener::bind(config.admin_listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.admin_listen))?;
    let (addr, admin_addr) = (listener.local_addr()?, admin_listener.local_addr()?);
    let scheme = if tls.is_some() { "https" } else { "http" };
    let routes: Vec<&str> = config.routes.iter().map(|route| route.pattern.as_str()).collect();
    let path_readings = config.routes.readings();
    tracing::info!(
        %addr,
        %admin_addr,
        upstream = %redact_url(&config.upstream.to_string()),
        store = %redact_url(&config.store),
        ?routes,
        %path_readings,
        "idem serve started"
    );
    // Whoever waits for this line (a supervisor, a test) finds the start-up's log lines written.
    telemetry.flush_logs();
    println!("idem listening on {scheme}://{addr} admin http://{admin_addr}");

    let shutdown = CancellationToken::new();
    let purger = gateway
        .protocol
        .clone()
        .map(|protocol| tokio::spawn(purge_forever(protocol, shutdown.clone())));
    let admin = tokio::spawn({
        let (shutdown, limits) = (shutdown.clone(), limits.clone());
        let router = admin::router(store.clone(), metrics, channel);
        async move {
            listener::serve(
                "admin",
                admin_listener,
                None,
                router,
                &limits,
                &TaskTracker::new(),
                shutdown.cancelled_owned(),
            )
            .await;
        }
    });
    // Returns at most the grace after the signal, the keyed handlers whose clients already left
    // (or timed out) included.
    gateway
        .serve(listener, tls, &limits, {
            let shutdown = shutdown.clone();
            let grace = limits.shutdown_grace;
            async move {
                terminated().await;
                telemetry.stop_by(std::time::Instant::now() + grace);
                tracing::info!(?grace, "shutting down: finishing requests in flight");
                shutdown.cancel();
            }
        })
        .await;
    shutdown.cancel();
    let _ = admin.await;
    if let Some(purger) = purger {
        let _ = purger.await;
    }
    drop(store);
    tracing::info!("idem serve stopped");
    Ok(())
}

/// Warns, for the gateway's policy and each protecting route's, when `tombstone-ttl` is not
/// longer than `ttl`: a record is then forgotten as soon as its answer expires, and a retry after
/// that runs again as a new request instead of answering `422 key-expired` (the store keeps a
/// record until the later of the two). Allowed, as a choice, but never what one gets by mistake.
fn warn_of_no_expired_window(policy: &Policy, routes: &Routes) {
    let protected = routes.iter().filter_map(|route| match &route.rule {
        RouteRule::Protect(policy) => Some((Some(route.pattern.as_str()), policy)),
        RouteRule::PassThrough => None,
    });
    for (route, policy) in std::iter::once((None, policy)).chain(protected) {
        if policy.tombstone_ttl <= policy.ttl {
            tracing::warn!(
                route = route.unwrap_or("(every route without its own)"),
                ttl = %humantime::format_duration(policy.ttl),
                tombstone_ttl = %humantime::format_duration(policy.tombstone_ttl),
                "tombstone-ttl is not longer than ttl: a key is forgotten as soon as its answer expires, and a retry after that runs again as a new request instead of answering 422 key-expired"
            );
        }
    }
}

/// How the gateway applies the protocol: its policy, its routes, and the keys that seal answers.
#[derive(Debug, Clone, Default)]
pub(crate) struct Protection {
    pub(crate) policy: Policy,
    pub(crate) routes: Routes,
    pub(crate) keyring: Option<Keyring>,
    /// Mixed into the hash of credential scopes.
    pub(crate) scope_secrets: ScopeSecrets,
    /// The replay cache's size.
    pub(crate) replay_cache: ReplayCacheConfig,
}

/// The gateway's service: the idempotency layer around the proxy, or the bare proxy.
pub(crate) struct Gateway {
    app: axum::Router,
    /// The keyed handlers still running (none without the layer).
    tasks: TaskTracker,
    /// The protocol the layer applies (`None`: the bare proxy).
    protocol: Option<Protocol>,
}

impl Gateway {
    /// The idempotency layer over `store` around `proxy`: what `idem serve` runs.
    pub(crate) fn protected(
        store: Arc<dyn Store>,
        clock: Arc<StoreClock>,
        protection: Protection,
        proxy: Proxy,
    ) -> Self {
        let mut layer = IdempotencyLayer::from_shared(store)
            .with_clock(clock)
            .with_policy(protection.policy)
            .with_routes(protection.routes)
            .with_scope_secrets(protection.scope_secrets)
            .with_replay_cache(protection.replay_cache);
        if let Some(keyring) = protection.keyring {
            layer = layer.with_encryption(keyring);
        }
        // Paths are passed on under the upstream's prefix: admission refuses one that climbs out.
        let layer = layer
            .with_response_timeout(proxy.timeout())
            .with_path_prefix(proxy.prefix());
        let (tasks, protocol) = (layer.tasks(), layer.protocol());
        let app = axum::Router::new().fallback_service(tower::ServiceBuilder::new().layer(layer).service(proxy));
        Self {
            app,
            tasks,
            protocol: Some(protocol),
        }
    }

    /// `proxy` with no idempotency at all (`idem demo`'s first set-up): nothing is admitted or
    /// refused, not even a path that climbs out of an upstream's prefix (admission's to refuse),
    /// so its upstream is the demo's own, which has none.
    pub(crate) fn unprotected(proxy: Proxy) -> Self {
        let app = axum::Router::new().fallback_service(
            tower::ServiceBuilder::new()
                .map_request(|request: http::Request<axum::body::Body>| request.map(idem_tower::Body::new))
                .service(proxy),
        );
        Self {
            app,
            tasks: TaskTracker::new(),
            protocol: None,
        }
    }

    /// Serves on `listener` (over TLS with `tls`) within `limits` until `shutdown` resolves; then
    /// stops accepting and returns once the open connections and the keyed handlers still running
    /// (their clients may have left) are done, or the shutdown grace has passed.
    pub(crate) async fn serve(
        &self,
        listener: TcpListener,
        tls: Option<TlsAcceptor>,
        limits: &Limits,
        shutdown: impl Future<Output = ()>,
    ) {
        listener::serve("proxy", listener, tls, self.app.clone(), limits, &self.tasks, shutdown).await;
    }
}

async fn purge_forever(protocol: Protocol, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(PURGE_EVERY) => {}
        }
        match protocol.purge(PURGE_BATCH).await {
            Ok(purged) if purged.total() > 0 => {
                tracing::info!(
                    deleted = purged.deleted,
                    tombstoned = purged.tombstoned,
                    "purged expired records"
                );
            }
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %err, "purge failed; retrying at the next round"),
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C.
async fn terminated() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler does not fail");
        tokio::select! {
            () = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await;
}
