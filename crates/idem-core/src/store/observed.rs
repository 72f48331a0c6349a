//! [`Observed`]: a store that reports each of its operations to an [`Observer`]. The gateway's
//! Prometheus metrics, `idem bench`'s latency samples and the tests' round-trip counts are three
//! observers of this one wrapper, so no forwarding impl of [`Store`] is written twice.

use std::fmt;
use std::time::Duration;
use tokio::time::Instant;

use async_trait::async_trait;

use crate::store::Invalidations;
use crate::store::{
    Begin, BeginRequest, Checkpoint, ClaimState, Completion, FencingToken, ListQuery, Listed, Purged, Record, RecordId,
    Release, ScopeSalt, Store, StoreError, StoreIdentity, WaitOutcome,
};
use crate::time::UnixMillis;

/// One operation of the [`Store`] trait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StoreOperation {
    /// [`Store::begin`].
    Begin,
    /// [`Store::complete`].
    Complete,
    /// [`Store::release`].
    Release,
    /// [`Store::renew`].
    Renew,
    /// [`Store::get`].
    Get,
    /// [`Store::wait`].
    Wait,
    /// [`Store::purge`].
    Purge,
    /// [`Store::ping`].
    Ping,
    /// [`Store::delete`].
    Delete,
    /// [`Store::clock`]: measured per instance in the background, never per request.
    Clock,
    /// [`Store::checkpoint`].
    Checkpoint,
    /// [`Store::checkpoints`].
    Checkpoints,
    /// [`Store::scope_salt`]: read once per instance, never per request.
    ScopeSalt,
    /// [`Store::identity`]: read by each replay cache every second, never per request.
    Identity,
    /// [`Store::claim_state`]: after a run that completed its record in its own transaction.
    ClaimState,
    /// [`Store::list`]: an operator's question.
    List,
}

impl StoreOperation {
    /// Every operation, in declaration order.
    pub const ALL: [Self; 16] = [
        Self::Begin,
        Self::Complete,
        Self::Release,
        Self::Renew,
        Self::Get,
        Self::Wait,
        Self::Purge,
        Self::Ping,
        Self::Delete,
        Self::Clock,
        Self::Checkpoint,
        Self::Checkpoints,
        Self::ScopeSalt,
        Self::Identity,
        Self::ClaimState,
        Self::List,
    ];

    /// The name used in metrics labels and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Begin => "begin",
            Self::Complete => "complete",
            Self::Release => "release",
            Self::Renew => "renew",
            Self::Get => "get",
            Self::Wait => "wait",
            Self::Purge => "purge",
            Self::Ping => "ping",
            Self::Delete => "delete",
            Self::Clock => "clock",
            Self::Checkpoint => "checkpoint",
            Self::Checkpoints => "checkpoints",
            Self::ScopeSalt => "scope_salt",
            Self::Identity => "identity",
            Self::ClaimState => "claim_state",
            Self::List => "list",
        }
    }

    /// The name of the operation's span in a trace (`store begin`).
    pub fn span_name(self) -> &'static str {
        match self {
            Self::Begin => "store begin",
            Self::Complete => "store complete",
            Self::Release => "store release",
            Self::Renew => "store renew",
            Self::Get => "store get",
            Self::Wait => "store wait",
            Self::Purge => "store purge",
            Self::Ping => "store ping",
            Self::Delete => "store delete",
            Self::Clock => "store clock",
            Self::Checkpoint => "store checkpoint",
            Self::Checkpoints => "store checkpoints",
            Self::ScopeSalt => "store scope_salt",
            Self::Identity => "store identity",
            Self::ClaimState => "store claim_state",
            Self::List => "store list",
        }
    }

    /// True for the operations an instance makes on its own (or an operator asks), never per
    /// request.
    pub fn per_instance(self) -> bool {
        matches!(self, Self::Clock | Self::ScopeSalt | Self::Identity | Self::List)
    }
}

impl fmt::Display for StoreOperation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Receives one report per store operation.
pub trait Observer: Send + Sync + fmt::Debug + 'static {
    /// `operation` took `elapsed`; `failed` if the store failed (a fenced claim is an answer, not
    /// a failure).
    fn observe(&self, operation: StoreOperation, elapsed: Duration, failed: bool);

    /// `operation` answered `err` (after [`Self::observe`]), for an observer that tells the
    /// causes apart: the gateway counts the writes Redis replicas did not acknowledge.
    fn error(&self, operation: StoreOperation, err: &StoreError) {
        let _ = (operation, err);
    }

    /// A purge batch did this much.
    fn purged(&self, purged: &Purged) {
        let _ = purged;
    }
}

impl<O: Observer + ?Sized> Observer for std::sync::Arc<O> {
    fn observe(&self, operation: StoreOperation, elapsed: Duration, failed: bool) {
        (**self).observe(operation, elapsed, failed);
    }

    fn error(&self, operation: StoreOperation, err: &StoreError) {
        (**self).error(operation, err);
    }

    fn purged(&self, purged: &Purged) {
        (**self).purged(purged);
    }
}

/// A store whose every operation is timed and reported to an [`Observer`].
#[derive(Debug)]
pub struct Observed<S, O> {
    inner: S,
    observer: O,
}

impl<S, O> Observed<S, O> {
    /// Reports the operations on `inner` to `observer`.
    pub fn new(inner: S, observer: O) -> Self {
        Self { inner, observer }
    }

    /// The observer.
    pub fn observer(&self) -> &O {
        &self.observer
    }
}

impl<S: Store, O: Observer> Observed<S, O> {
    async fn measure<T>(
        &self,
        operation: StoreOperation,
        work: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = std::time::Instant::now();
        let result = work.await;
        let failed = matches!(&result, Err(err) if !matches!(err, StoreError::Fenced));
        self.observer.observe(operation, started.elapsed(), failed);
        if let Err(err) = &result {
            self.observer.error(operation, err);
        }
        result
    }
}

#[async_trait]
impl<S: Store, O: Observer> Store for Observed<S, O> {
    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin, StoreError> {
        self.measure(StoreOperation::Begin, self.inner.begin(request)).await
    }
    async fn complete(&self, id: &RecordId, token: FencingToken, completion: Completion) -> Result<(), StoreError> {
        self.measure(StoreOperation::Complete, self.inner.complete(id, token, completion))
            .await
    }
    async fn claim_state(&self, id: &RecordId, token: FencingToken) -> Result<ClaimState, StoreError> {
        self.measure(StoreOperation::ClaimState, self.inner.claim_state(id, token))
            .await
    }
    fn completes_in_transactions(&self) -> bool {
        self.inner.completes_in_transactions()
    }
    async fn release(&self, id: &RecordId, token: FencingToken, release: Release) -> Result<(), StoreError> {
        self.measure(StoreOperation::Release, self.inner.release(id, token, release))
            .await
    }
    async fn renew(&self, id: &RecordId, token: FencingToken, lease_until: UnixMillis) -> Result<(), StoreError> {
        self.measure(StoreOperation::Renew, self.inner.renew(id, token, lease_until))
            .await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.measure(StoreOperation::Get, self.inner.get(id)).await
    }
    async fn checkpoint(&self, id: &RecordId, token: FencingToken, checkpoint: Checkpoint) -> Result<(), StoreError> {
        self.measure(StoreOperation::Checkpoint, self.inner.checkpoint(id, token, checkpoint))
            .await
    }
    async fn checkpoints(&self, id: &RecordId) -> Result<Vec<Checkpoint>, StoreError> {
        self.measure(StoreOperation::Checkpoints, self.inner.checkpoints(id))
            .await
    }
    async fn scope_salt(&self, candidate: ScopeSalt) -> Result<ScopeSalt, StoreError> {
        self.measure(StoreOperation::ScopeSalt, self.inner.scope_salt(candidate))
            .await
    }
    async fn identity(&self) -> Result<Option<StoreIdentity>, StoreError> {
        self.measure(StoreOperation::Identity, self.inner.identity()).await
    }
    async fn delete(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.measure(StoreOperation::Delete, self.inner.delete(id)).await
    }
    async fn wait(&self, id: &RecordId, token: FencingToken, deadline: Instant) -> Result<WaitOutcome, StoreError> {
        self.measure(StoreOperation::Wait, self.inner.wait(id, token, deadline))
            .await
    }
    async fn purge(&self, now: UnixMillis, batch: usize) -> Result<Purged, StoreError> {
        let purged = self
            .measure(StoreOperation::Purge, self.inner.purge(now, batch))
            .await?;
        self.observer.purged(&purged);
        Ok(purged)
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.measure(StoreOperation::Ping, self.inner.ping()).await
    }
    async fn clock(&self) -> Result<UnixMillis, StoreError> {
        self.measure(StoreOperation::Clock, self.inner.clock()).await
    }
    fn clock_is_local(&self) -> bool {
        self.inner.clock_is_local()
    }
    fn invalidations(&self) -> Option<std::sync::Arc<Invalidations>> {
        self.inner.invalidations()
    }
    fn count_replay(&self, id: &RecordId) {
        self.inner.count_replay(id);
    }
    async fn list(&self, query: &ListQuery) -> Result<Vec<Listed>, StoreError> {
        self.measure(StoreOperation::List, self.inner.list(query)).await
    }
}
