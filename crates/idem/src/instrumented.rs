//! A store wrapper that times each operation and hands the measurement to an [`Observer`]: the
//! gateway's observer feeds Prometheus, `idem bench`'s records every sample.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_core::{
    Begin, BeginRequest, Checkpoint, Completion, FencingToken, Purged, Record, RecordId, Release, ScopeSalt, Store,
    StoreError, UnixMillis, WaitOutcome,
};

/// Receives one measurement per store operation.
pub(crate) trait Observer: Send + Sync + std::fmt::Debug + 'static {
    /// `operation` took `elapsed`; `failed` if the store failed (a fenced claim is not a failure).
    fn observe(&self, operation: &'static str, elapsed: Duration, failed: bool);
}

/// Feeds the Prometheus metrics `idem_store_operation_seconds` and `idem_store_errors_total`.
#[derive(Debug)]
pub(crate) struct Prometheus;

impl Observer for Prometheus {
    fn observe(&self, operation: &'static str, elapsed: Duration, failed: bool) {
        metrics::histogram!("idem_store_operation_seconds", "operation" => operation).record(elapsed.as_secs_f64());
        if failed {
            metrics::counter!("idem_store_errors_total", "operation" => operation).increment(1);
        }
    }
}

/// Times every operation of the store it wraps.
#[derive(Debug)]
pub(crate) struct Instrumented<O> {
    store: Arc<dyn Store>,
    observer: O,
}

impl<O: Observer> Instrumented<O> {
    pub(crate) fn new(store: Arc<dyn Store>, observer: O) -> Self {
        Self { store, observer }
    }

    async fn measure<T>(
        &self,
        operation: &'static str,
        work: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = work.await;
        let failed = matches!(&result, Err(err) if !matches!(err, StoreError::Fenced));
        self.observer.observe(operation, started.elapsed(), failed);
        result
    }
}

#[async_trait]
impl<O: Observer> Store for Instrumented<O> {
    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin, StoreError> {
        self.measure("begin", self.store.begin(request)).await
    }
    async fn complete(&self, id: &RecordId, token: FencingToken, completion: Completion) -> Result<(), StoreError> {
        self.measure("complete", self.store.complete(id, token, completion))
            .await
    }
    async fn release(&self, id: &RecordId, token: FencingToken, release: Release) -> Result<(), StoreError> {
        self.measure("release", self.store.release(id, token, release)).await
    }
    async fn renew(&self, id: &RecordId, token: FencingToken, lease_until: UnixMillis) -> Result<(), StoreError> {
        self.measure("renew", self.store.renew(id, token, lease_until)).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.measure("get", self.store.get(id)).await
    }
    async fn scope_salt(&self, candidate: ScopeSalt) -> Result<ScopeSalt, StoreError> {
        self.measure("scope_salt", self.store.scope_salt(candidate)).await
    }
    async fn delete(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.measure("delete", self.store.delete(id)).await
    }
    async fn checkpoint(&self, id: &RecordId, token: FencingToken, checkpoint: Checkpoint) -> Result<(), StoreError> {
        self.measure("checkpoint", self.store.checkpoint(id, token, checkpoint))
            .await
    }
    async fn checkpoints(&self, id: &RecordId) -> Result<Vec<Checkpoint>, StoreError> {
        self.measure("checkpoints", self.store.checkpoints(id)).await
    }
    async fn wait(
        &self,
        id: &RecordId,
        token: FencingToken,
        deadline: tokio::time::Instant,
    ) -> Result<WaitOutcome, StoreError> {
        self.measure("wait", self.store.wait(id, token, deadline)).await
    }
    async fn purge(&self, now: UnixMillis, batch: usize) -> Result<Purged, StoreError> {
        let purged = self.measure("purge", self.store.purge(now, batch)).await?;
        metrics::counter!("idem_purged_records_total").increment(purged.total());
        Ok(purged)
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.measure("ping", self.store.ping()).await
    }
    async fn clock(&self) -> Result<UnixMillis, StoreError> {
        self.measure("clock", self.store.clock()).await
    }
}
