//! `idem bench`: what a keyed request costs the store. It drives the idempotency layer in process
//! (no sockets, so the figures are the store's) with new keys, then replays them, and reports store
//! operations per request and each operation's latency.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use axum::Router;
use axum::body::Body;
use axum::extract::Extension;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_postgres::PostgresStore;
use idem_tower::{IdempotencyInfo, IdempotencyLayer, InTransaction, ReplayCacheConfig};
use tokio::task::JoinSet;
use tower::ServiceExt;

use crate::cli::{BenchArgs, BusinessWrite};
use crate::stores;

/// Every operation's latency samples.
#[derive(Debug, Default)]
struct Samples(Mutex<BTreeMap<&'static str, Vec<Duration>>>);

impl idem_core::store::Observer for Samples {
    fn observe(&self, operation: idem_core::store::StoreOperation, elapsed: Duration, _failed: bool) {
        self.0
            .lock()
            .expect("samples lock")
            .entry(operation.as_str())
            .or_default()
            .push(elapsed);
    }
}

impl Samples {
    fn take(&self) -> BTreeMap<&'static str, Vec<Duration>> {
        std::mem::take(&mut *self.0.lock().expect("samples lock"))
    }
}

/// One phase's results.
struct Phase {
    name: &'static str,
    requests: usize,
    elapsed: Duration,
    operations: BTreeMap<&'static str, Vec<Duration>>,
}

pub(crate) async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let samples = Arc::new(Samples::default());
    let store = idem_core::store::Observed::new(
        stores::open(&args.store.store, Some(idem_postgres::Access::Serve)).await?,
        samples.clone(),
    );
    let body = "x".repeat(args.body_size);
    // Sealed at rest when IDEM_ENCRYPTION_KEYS is set, as `idem serve` would seal them.
    let keyring = crate::config::keyring_from_env()?;
    let sealing = keyring.as_ref().and_then(|ring| ring.ids().next().map(str::to_owned));
    let cache = if args.replay_cache {
        ReplayCacheConfig::DEFAULT
    } else {
        ReplayCacheConfig::OFF
    };
    let mut layer = IdempotencyLayer::new(store).with_replay_cache(cache);
    if let Some(keyring) = keyring {
        layer = layer.with_encryption(keyring);
    }
    let route = match args.write {
        BusinessWrite::None => post(move || std::future::ready((StatusCode::CREATED, body.clone()).into_response())),
        write => {
            let writes = Arc::new(Writes::connect(&args.store.store).await?);
            if write == BusinessWrite::InTransaction {
                layer = layer.with_in_transaction(true);
            }
            post(
                move |info: Extension<IdempotencyInfo>, run: Option<Extension<InTransaction>>| {
                    let (writes, body) = (writes.clone(), body.clone());
                    async move { writes.pay(write, &info, run.as_deref(), body).await }
                },
            )
        }
    };
    let app = Router::new()
        .route("/pay", route)
        .layer(layer)
        // Built once, as `axum::serve` does: an unfinished router applies its layers anew for
        // every request, which is not what a service pays.
        .with_state(());
    let run_id = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let keys: Arc<Vec<String>> = Arc::new((0..args.requests).map(|i| format!("bench-{run_id}-{i}")).collect());

    // Warm up connections and prepared statements outside the measurement.
    drive(&app, Arc::new(vec![format!("bench-{run_id}-warmup")]), 1).await?;
    samples.take();
    let mut phases = Vec::new();
    for name in ["new", "replay"] {
        let started = Instant::now();
        drive(&app, keys.clone(), args.concurrency).await?;
        phases.push(Phase {
            name,
            requests: args.requests,
            elapsed: started.elapsed(),
            operations: samples.take(),
        });
    }
    print!(
        "{}",
        report(
            &idem_core::redact_url(&args.store.store),
            args.concurrency,
            sealing.as_deref(),
            args.write,
            &phases
        )
    );
    Ok(())
}

/// The handler's own table, in the store's database, and the store to complete in its
/// transactions.
struct Writes {
    pool: deadpool_postgres::Pool,
    store: PostgresStore,
    /// `idem_bench_writes` in the store's schema.
    table: String,
}

impl Writes {
    async fn connect(url: &str) -> anyhow::Result<Self> {
        anyhow::ensure!(
            crate::config::completes_with_sql(url),
            "--write needs a PostgreSQL store, in whose database the handler writes"
        );
        let store = PostgresStore::connect(url)
            .await
            .context("cannot open the PostgreSQL store")?;
        let database = idem_postgres::StoreDatabase::parse(url)?;
        let writes = Self {
            pool: stores::postgres_pool(&database, 16)?,
            store,
            table: database.qualify("idem_bench_writes"),
        };
        writes
            .pool
            .get()
            .await?
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {} (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL)",
                writes.table
            ))
            .await
            .context("cannot create the bench's table")?;
        Ok(writes)
    }

    /// A row for the key, then the answer: committed on their own (`Separate`), or together.
    async fn pay(
        &self,
        write: BusinessWrite,
        info: &IdempotencyInfo,
        run: Option<&InTransaction>,
        body: String,
    ) -> Response {
        match self.write(write, info, run, body).await {
            Ok(response) => response,
            Err(err) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{err:#}")).into_response(),
        }
    }

    async fn write(
        &self,
        write: BusinessWrite,
        info: &IdempotencyInfo,
        run: Option<&InTransaction>,
        body: String,
    ) -> anyhow::Result<Response> {
        let insert = format!("INSERT INTO {} (key) VALUES ($1)", self.table);
        let mut client = self.pool.get().await?;
        let key = info.key.as_str();
        let run = match (write, run) {
            (BusinessWrite::InTransaction, Some(run)) => run,
            _ => {
                client.execute(&insert, &[&key]).await?;
                return Ok((StatusCode::CREATED, body).into_response());
            }
        };
        let tx = client.transaction().await?;
        tx.execute(&insert, &[&key]).await?;
        let mut answer = http::Response::builder()
            .status(StatusCode::CREATED)
            .body(bytes::Bytes::from(body))?;
        self.store.complete_in_client(&*tx, run, &mut answer).await?;
        tx.commit().await?;
        Ok(answer.map(Body::from).into_response())
    }
}

/// Sends one keyed `POST /pay` per key, `concurrency` at a time; every answer must be a 201.
async fn drive(app: &Router, keys: Arc<Vec<String>>, concurrency: usize) -> anyhow::Result<()> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (app, keys, next) = (app.clone(), keys.clone(), next.clone());
        workers.spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(key) = keys.get(i) else { return Ok(()) };
                let request = Request::post("/pay")
                    .header("idempotency-key", format!("\"{key}\""))
                    .header("content-type", "application/json")
                    .body(Body::from(r#"{"amount":100,"currency":"EUR"}"#))
                    .context("build a request")?;
                let response = app.clone().oneshot(request).await.context("the layer failed")?;
                anyhow::ensure!(
                    response.status() == StatusCode::CREATED,
                    "unexpected answer {}",
                    response.status()
                );
            }
        });
    }
    while let Some(result) = workers.join_next().await {
        result.context("a worker panicked")??;
    }
    Ok(())
}

fn report(store: &str, concurrency: usize, sealing: Option<&str>, write: BusinessWrite, phases: &[Phase]) -> String {
    let sealed = match sealing {
        Some(key) => format!("sealed by key {key}"),
        None => "not sealed".to_owned(),
    };
    let mut out = format!(
        "idem bench  store: {store}  concurrency: {concurrency}  answers: {sealed}  write: {}\n\n",
        write.name()
    );
    out.push_str("phase    requests  req/s    store ops/request  operation      p50       p99       max\n");
    for phase in phases {
        let total: usize = phase.operations.values().map(Vec::len).sum();
        let per_request = total as f64 / phase.requests as f64;
        let rate = phase.requests as f64 / phase.elapsed.as_secs_f64();
        let mut first = true;
        for (operation, samples) in &phase.operations {
            let mut sorted = samples.clone();
            sorted.sort();
            let (p50, p99, max) = (
                percentile(&sorted, 50.0),
                percentile(&sorted, 99.0),
                sorted[sorted.len() - 1],
            );
            let lead = if first {
                format!(
                    "{:<8} {:<9} {:<8.0} {:<18.2}",
                    phase.name, phase.requests, rate, per_request
                )
            } else {
                " ".repeat(46)
            };
            first = false;
            out.push_str(&format!(
                "{lead} {:<14} {:<9} {:<9} {}\n",
                format!("{operation}×{}", samples.len()),
                ms(p50),
                ms(p99),
                ms(max)
            ));
        }
    }
    out
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(duration: Duration) -> String {
    format!("{:.3}ms", duration.as_secs_f64() * 1000.0)
}
