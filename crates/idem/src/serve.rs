//! `idem serve`: the idempotency layer around the proxy, the admin listener, the background
//! purger and a graceful shutdown that lets running requests finish and store their answers.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use std::sync::Arc;

use idem_core::{Policy, Protocol, Store};
use idem_tower::IdempotencyLayer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::cli::ServeArgs;
use crate::instrumented::{Instrumented, Prometheus};
use crate::proxy::Proxy;
use crate::{admin, stores};

/// How often the background purger runs, and how many records one batch touches.
const PURGE_EVERY: Duration = Duration::from_secs(60);
const PURGE_BATCH: usize = 1000;

pub(crate) async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("cannot install the metrics recorder")?;
    let store: Arc<dyn Store> = Arc::new(Instrumented::new(stores::open(&args.store.store).await?, Prometheus));
    let policy = Policy {
        methods: args.methods.clone(),
        scope: args.scope.clone(),
        missing_key: args.missing_key,
        ttl: args.ttl,
        tombstone_ttl: args.tombstone_ttl,
        lease: args.lease,
        wait: args.wait,
        max_body: args.max_body,
        max_stored_body: args.max_stored_body,
        store_5xx: args.store_5xx,
        fail_open: args.fail_open,
        ..Policy::default()
    };
    let layer = IdempotencyLayer::from_shared(store.clone())
        .with_policy(policy)
        .with_response_timeout(args.upstream_timeout);
    let tasks = layer.tasks();
    let protocol = layer.protocol();
    let proxy = Proxy::new(args.upstream.clone(), args.upstream_timeout)?;
    let app = axum::Router::new().fallback_service(tower::ServiceBuilder::new().layer(layer).service(proxy));

    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let admin_listener = TcpListener::bind(args.admin_listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.admin_listen))?;
    let (addr, admin_addr) = (listener.local_addr()?, admin_listener.local_addr()?);
    println!("idem listening on http://{addr} admin http://{admin_addr}");
    tracing::info!(%addr, %admin_addr, upstream = %args.upstream, store = %args.store.store, "idem serve started");

    let shutdown = CancellationToken::new();
    let purger = tokio::spawn(purge_forever(protocol, shutdown.clone()));
    let admin = tokio::spawn({
        let shutdown = shutdown.clone();
        let router = admin::router(store.clone(), metrics);
        async move {
            axum::serve(admin_listener, router)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        }
    });
    let gateway = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown({
            let shutdown = shutdown.clone();
            async move {
                terminated().await;
                tracing::info!("shutting down: finishing requests in flight");
                shutdown.cancel();
            }
        });
    gateway.await.context("the gateway's listener failed")?;

    // Handlers whose clients already left (or timed out) may still run; let them store their answers.
    tasks.close();
    let grace = args.lease;
    if tokio::time::timeout(grace, tasks.wait()).await.is_err() {
        tracing::warn!(
            ?grace,
            "requests still running at exit; their keys are taken over when their leases end"
        );
    }
    shutdown.cancel();
    let _ = admin.await;
    let _ = purger.await;
    drop(store);
    tracing::info!("idem serve stopped");
    Ok(())
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
