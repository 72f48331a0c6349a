//! A store wrapper that records each operation's latency and errors as Prometheus metrics.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use idem_core::{
    Begin, BeginRequest, Completion, FencingToken, Purged, Record, RecordId, Release, Store, StoreError, UnixMillis,
    WaitOutcome,
};

/// Measures every operation of the store it wraps.
#[derive(Debug)]
pub(crate) struct MeteredStore(pub(crate) Arc<dyn Store>);

async fn measure<T>(
    operation: &'static str,
    work: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let started = Instant::now();
    let result = work.await;
    metrics::histogram!("idem_store_operation_seconds", "operation" => operation)
        .record(started.elapsed().as_secs_f64());
    // A fenced claim is the protocol working, not the store failing.
    if let Err(err) = &result
        && !matches!(err, StoreError::Fenced)
    {
        metrics::counter!("idem_store_errors_total", "operation" => operation).increment(1);
    }
    result
}

#[async_trait]
impl Store for MeteredStore {
    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin, StoreError> {
        measure("begin", self.0.begin(request)).await
    }
    async fn complete(&self, id: &RecordId, token: FencingToken, completion: Completion) -> Result<(), StoreError> {
        measure("complete", self.0.complete(id, token, completion)).await
    }
    async fn release(&self, id: &RecordId, token: FencingToken, release: Release) -> Result<(), StoreError> {
        measure("release", self.0.release(id, token, release)).await
    }
    async fn renew(&self, id: &RecordId, token: FencingToken, lease_until: UnixMillis) -> Result<(), StoreError> {
        measure("renew", self.0.renew(id, token, lease_until)).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        measure("get", self.0.get(id)).await
    }
    async fn wait(
        &self,
        id: &RecordId,
        token: FencingToken,
        deadline: tokio::time::Instant,
    ) -> Result<WaitOutcome, StoreError> {
        measure("wait", self.0.wait(id, token, deadline)).await
    }
    async fn purge(&self, now: UnixMillis, batch: usize) -> Result<Purged, StoreError> {
        let purged = measure("purge", self.0.purge(now, batch)).await?;
        metrics::counter!("idem_purged_records_total").increment(purged.total());
        Ok(purged)
    }
    async fn ping(&self) -> Result<(), StoreError> {
        measure("ping", self.0.ping()).await
    }
}
