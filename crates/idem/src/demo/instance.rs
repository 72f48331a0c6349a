//! [`Instance`]: the gateway of `idem serve` inside this process, on a thread and a runtime of its
//! own, so that `idem demo` can start, stop and crash instances as if they were processes.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use idem_core::{Policy, store::StoreClock};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::config::{Limits, UpstreamOptions, completes_with_sql};
use crate::proxy::Proxy;
use crate::serve::Gateway;
use crate::stores;

/// What an in-process [`Instance`] puts in front of its upstream.
#[derive(Debug, Clone)]
pub(crate) enum Protection {
    /// Nothing: a bare proxy.
    None,
    /// The idempotency layer over the store at `url` (opened by the instance itself, as a process
    /// would, so that its connections live and die with it).
    Store { url: String, policy: Box<Policy> },
}

/// How an in-process instance is set up.
#[derive(Debug, Clone)]
pub(crate) struct InstanceConfig {
    pub(crate) listen: SocketAddr,
    pub(crate) upstream: http::Uri,
    pub(crate) upstream_timeout: Duration,
    pub(crate) protection: Protection,
}

/// How an instance is asked to end.
#[derive(Debug)]
enum Ending {
    /// Stop accepting, let running requests finish and store their answers.
    Graceful,
    /// Crash: everything in flight vanishes.
    Crash,
}

/// A gateway running in this process on a thread and a Tokio runtime of its own, which behaves
/// like a separate process: it opens its own store connections, and [`Instance::kill`] drops its
/// runtime with whatever was in flight (handlers, lease renewals, connections), as a crash would.
/// Dropping the handle kills the instance too.
#[derive(Debug)]
pub(crate) struct Instance {
    addr: SocketAddr,
    control: Option<oneshot::Sender<Ending>>,
    ended: Option<oneshot::Receiver<()>>,
}

impl Instance {
    /// Starts an instance; returns once it listens.
    pub(crate) async fn start(config: InstanceConfig) -> anyhow::Result<Self> {
        let (ready_tx, ready_rx) = oneshot::channel();
        let (control_tx, control_rx) = oneshot::channel();
        let (ended_tx, ended_rx) = oneshot::channel();
        std::thread::Builder::new()
            .name("idem-instance".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(runtime) => runtime,
                    Err(err) => {
                        let _ = ready_tx.send(Err(anyhow::Error::new(err).context("cannot start a runtime")));
                        return;
                    }
                };
                runtime.block_on(run_instance(config, ready_tx, control_rx));
                // Whatever is still spawned on the runtime is dropped here without being polled
                // again: after a crash, that is every request in flight.
                runtime.shutdown_background();
                let _ = ended_tx.send(());
            })
            .context("cannot start a thread for the instance")?;
        let addr = ready_rx.await.context("the instance ended before it listened")??;
        Ok(Self {
            addr,
            control: Some(control_tx),
            ended: Some(ended_rx),
        })
    }

    /// Where it listens.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets running requests finish and store their answers, then ends.
    pub(crate) async fn stop(mut self) {
        self.end(Ending::Graceful).await;
    }

    /// Crashes the instance: its listener closes and everything it had in flight vanishes, its
    /// records stay in flight in the store until their leases end.
    pub(crate) async fn kill(mut self) {
        self.end(Ending::Crash).await;
    }

    async fn end(&mut self, ending: Ending) {
        if let Some(control) = self.control.take() {
            let _ = control.send(ending);
        }
        if let Some(ended) = self.ended.take() {
            let _ = ended.await;
        }
    }
}

async fn run_instance(
    config: InstanceConfig,
    ready: oneshot::Sender<anyhow::Result<SocketAddr>>,
    control: oneshot::Receiver<Ending>,
) {
    let started = async {
        let (gateway, grace) = match config.protection {
            Protection::None => (
                Gateway::unprotected(Proxy::new(config.upstream, config.upstream_timeout)?),
                config.upstream_timeout,
            ),
            Protection::Store { url, policy } => {
                let grace = policy.lease;
                let store = stores::open(&url, Some(idem_postgres::Access::Serve)).await?;
                (
                    Gateway::protected(
                        store.clone(),
                        StoreClock::new(store),
                        crate::serve::Protection {
                            policy: *policy,
                            ..Default::default()
                        },
                        Proxy::with_options(
                            config.upstream,
                            config.upstream_timeout,
                            &UpstreamOptions {
                                completion_tokens: completes_with_sql(&url),
                                ..UpstreamOptions::default()
                            },
                        )?,
                    ),
                    grace,
                )
            }
        };
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let addr = listener.local_addr()?;
        anyhow::Ok((gateway, grace, listener, addr))
    };
    let (gateway, grace, listener, addr) = match started.await {
        Ok(started) => started,
        Err(err) => {
            let _ = ready.send(Err(err));
            return;
        }
    };
    if ready.send(Ok(addr)).is_err() {
        return;
    }
    let shutdown = CancellationToken::new();
    let limits = Limits {
        shutdown_grace: grace,
        ..Limits::default()
    };
    let serving = gateway.serve(listener, None, &limits, shutdown.clone().cancelled_owned());
    tokio::pin!(serving);
    tokio::select! {
        () = &mut serving => {}
        ending = control => match ending {
            Ok(Ending::Graceful) => {
                shutdown.cancel();
                // Connections still open after the grace period are cut, as a supervisor would.
                serving.await;
            }
            // A handle dropped without a word is a crash too.
            Ok(Ending::Crash) | Err(_) => {}
        },
    }
}
