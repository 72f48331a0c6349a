//! The run under a claim, driven as the protocol wants it: the lease renewed *beside* the work (a
//! slow renewal never pauses it), the run given up after `run_timeout`, checkpoints recorded under
//! the claim, and an answer stored — or, when the store failed to take it, held and stored again
//! until it is stored or the claim is fenced.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;

use super::{Claim, Protocol};
use crate::metric_names;
use crate::response::StoredResponse;
use crate::store::{Checkpoint, RecordId};
use crate::store::{ClaimState, Completion, StoreError, StoreOperation};

/// The most answer bytes held in memory while the store refuses them; beyond it an answer is
/// given up (its record stays in flight, and a retry after the lease takes it over, marked
/// recovered).
pub const MAX_PENDING_BYTES: usize = 64 * 1024 * 1024;

/// The first pause before storing a pending answer again; it doubles up to [`MAX_RETRY_PAUSE`].
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(50);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(2);

/// The run took longer than the policy's `run_timeout` and was given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the run took longer than its run timeout")]
pub struct RunTimedOut;

/// An answer the store did not take when the run finished: it is held (within
/// [`MAX_PENDING_BYTES`]) until [`PendingAnswer::store`] stores it or the claim is fenced.
#[derive(Debug)]
#[must_use = "a pending answer is lost unless it is stored"]
pub struct PendingAnswer {
    protocol: Protocol,
    claim: Claim,
    status: u16,
    response: Bytes,
    _held: Held,
}

/// Why an answer was not stored.
#[derive(Debug)]
pub enum Unstored {
    /// The store failed; the answer is held to be stored again.
    Pending(PendingAnswer),
    /// The claim was lost (another holder took the record over), or the store failed and no more
    /// answers can be held: the answer cannot be kept.
    Lost(StoreError),
}

/// The bytes of the answers held, counted while they are held.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    bytes: AtomicUsize,
    answers: AtomicUsize,
}

#[derive(Debug)]
struct Held {
    pending: Arc<Pending>,
    bytes: usize,
}

impl Pending {
    fn hold(self: &Arc<Self>, bytes: usize) -> Option<Held> {
        self.bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&total| total <= MAX_PENDING_BYTES)
            })
            .ok()?;
        let answers = self.answers.fetch_add(1, Ordering::AcqRel) + 1;
        metrics::gauge!(metric_names::PENDING_ANSWERS).set(answers as f64);
        Some(Held {
            pending: self.clone(),
            bytes,
        })
    }

    /// How many answers are held now.
    pub(crate) fn answers(&self) -> usize {
        self.answers.load(Ordering::Acquire)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.pending.bytes.fetch_sub(self.bytes, Ordering::AcqRel);
        let answers = self.pending.answers.fetch_sub(1, Ordering::AcqRel) - 1;
        metrics::gauge!(metric_names::PENDING_ANSWERS).set(answers as f64);
    }
}

/// One unit of a gauge for as long as it lives (a run in flight, a copy waiting).
pub(crate) struct Gauged(&'static str);

impl Gauged {
    pub(crate) fn new(name: &'static str) -> Self {
        metrics::gauge!(name).increment(1.0);
        Self(name)
    }
}

impl Drop for Gauged {
    fn drop(&mut self) {
        metrics::gauge!(self.0).decrement(1.0);
    }
}

impl Protocol {
    /// Drives `work` (the handler, then reading its answer) under `claim`: the lease is renewed
    /// beside it, so a slow handler never loses its record and a slow renewal never pauses the
    /// handler; after the policy's `run_timeout` (counted from the claim) the work is dropped.
    pub async fn drive<F: Future>(&self, claim: &Claim, work: F) -> Result<F::Output, RunTimedOut> {
        let _running = Gauged::new(metric_names::RUNS_IN_FLIGHT);
        let deadline = claim.run_deadline();
        self.renewing(claim, async move { tokio::time::timeout_at(deadline, work).await })
            .await
            .map_err(|_| RunTimedOut)
    }

    /// Runs `work` while renewing the claim's lease every third of it, concurrently: the work is
    /// polled whatever a renewal is waiting for. Renewal stops if the claim is fenced.
    pub(crate) async fn renewing<F: Future>(&self, claim: &Claim, work: F) -> F::Output {
        let every = self.renew_every();
        let renewal = async {
            let mut ticks = tokio::time::interval_at(super::deadline_after(every), every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                match self.renew(claim).await {
                    Ok(()) => {}
                    Err(StoreError::Fenced) => {
                        tracing::warn!(scope = %claim.id().scope, key = %claim.id().key, "the claim was taken over while the request ran; its answer will not be stored");
                        return;
                    }
                    // Held by a transaction still open (the run's own, completing the record: a run
                    // alive, which no other claim takes over while the lock is held).
                    Err(StoreError::Locked) => {
                        tracing::debug!(scope = %claim.id().scope, key = %claim.id().key, "the lease was not renewed this time: the record is locked by a transaction still open")
                    }
                    Err(err) => {
                        tracing::warn!(scope = %claim.id().scope, key = %claim.id().key, error = %err, "could not renew the lease")
                    }
                }
            }
        };
        let mut work = pin!(work);
        let mut renewal = pin!(renewal);
        tokio::select! {
            output = &mut work => output,
            () = &mut renewal => work.await,
        }
    }

    /// Stores the answer of a run (`body: None` stores it compact). If the store fails, the
    /// answer is handed back to be stored again ([`Unstored::Pending`]) rather than dropped.
    pub async fn finish(
        &self,
        claim: &Claim,
        head: &http::response::Parts,
        body: Option<Bytes>,
    ) -> Result<(), Unstored> {
        let response = self.capture(claim.id(), head, body);
        let status = head.status.as_u16();
        match self.complete(claim, status, response.clone()).await {
            Ok(()) => Ok(()),
            Err(err @ (StoreError::Fenced | StoreError::Corrupt(_))) => Err(Unstored::Lost(err)),
            Err(err) => match self.inner().pending.hold(response.len()) {
                Some(held) => {
                    tracing::warn!(scope = %claim.id().scope, key = %claim.id().key, error = %err, "could not store the answer; holding it and trying again");
                    Err(Unstored::Pending(PendingAnswer {
                        protocol: self.clone(),
                        claim: claim.clone(),
                        status,
                        response,
                        _held: held,
                    }))
                }
                None => {
                    tracing::error!(scope = %claim.id().scope, key = %claim.id().key, error = %err, limit = MAX_PENDING_BYTES, "could not store the answer, and too many answers are already held: giving it up");
                    Err(Unstored::Lost(err))
                }
            },
        }
    }

    /// How many answers are held now, waiting for the store to take them.
    pub fn pending_answers(&self) -> usize {
        self.inner().pending.answers()
    }

    async fn complete(&self, claim: &Claim, status: u16, response: Bytes) -> Result<(), StoreError> {
        let now = self.now();
        let (expires_at, purge_at) = self.policy().retention(now, claim.provisional());
        let completion = Completion {
            response,
            status,
            completed_at: now,
            expires_at,
            purge_at,
        };
        let store = self.store();
        match self
            .bounded(
                StoreOperation::Complete,
                store.complete(claim.id(), claim.token(), completion),
            )
            .await
        {
            // Stored under this claim already: by an earlier attempt whose reply was lost, or by
            // the run's own transaction.
            Err(StoreError::Fenced) => match self
                .bounded(StoreOperation::ClaimState, store.claim_state(claim.id(), claim.token()))
                .await
            {
                Ok(ClaimState::Completed) => Ok(()),
                Ok(ClaimState::Current | ClaimState::Ended) => {
                    // Counted here, once the claim is read, not at the store's first refusal:
                    // that one is also what an earlier attempt whose reply was lost gets.
                    metrics::counter!(metric_names::FENCED_COMPLETIONS_TOTAL).increment(1);
                    Err(StoreError::Fenced)
                }
                Err(err) => Err(err),
            },
            done => done,
        }
    }
}

impl PendingAnswer {
    /// Stores the answer, trying again with a short backoff (and renewing the lease meanwhile)
    /// until it is stored or the claim is fenced.
    pub async fn store(self) -> Result<(), StoreError> {
        let Self {
            protocol,
            claim,
            status,
            response,
            _held,
        } = self;
        let retries = async {
            let mut pause = FIRST_RETRY_PAUSE;
            loop {
                tokio::time::sleep(pause).await;
                match protocol.complete(&claim, status, response.clone()).await {
                    Ok(()) => {
                        tracing::info!(scope = %claim.id().scope, key = %claim.id().key, "the held answer is stored");
                        return Ok(());
                    }
                    Err(err @ (StoreError::Fenced | StoreError::Corrupt(_))) => return Err(err),
                    Err(err) => {
                        tracing::debug!(scope = %claim.id().scope, key = %claim.id().key, error = %err, "still cannot store the held answer");
                        pause = (pause * 2).min(MAX_RETRY_PAUSE);
                    }
                }
            }
        };
        protocol.renewing(&claim, retries).await
    }
}

impl Protocol {
    /// The stored form of an answer (`body: None`: compact).
    pub(crate) fn capture(&self, id: &RecordId, head: &http::response::Parts, body: Option<Bytes>) -> Bytes {
        self.capture_parts(id, head.status, &head.headers, body)
    }

    /// [`capture`](Self::capture) from an answer's status and headers.
    pub(crate) fn capture_parts(
        &self,
        id: &RecordId,
        status: http::StatusCode,
        headers: &http::HeaderMap,
        body: Option<Bytes>,
    ) -> Bytes {
        let stored = StoredResponse::capture(status, headers, &self.inner.policy.stored_headers, body);
        let encoded = stored.encode();
        match &self.inner.keyring {
            Some(keyring) => keyring.seal(id, &encoded),
            None => encoded.into(),
        }
    }

    /// Extends the claim's lease by another `lease` from now.
    pub async fn renew(&self, claim: &Claim) -> Result<(), StoreError> {
        let lease_until = self.now().plus(self.inner.policy.lease);
        self.bounded(
            StoreOperation::Renew,
            self.inner.store.renew(&claim.id, claim.token, lease_until),
        )
        .await
    }

    /// Records a step of the run under `claim`, so that a run taking the record over can resume
    /// after it. [`StoreError::Fenced`] if the claim was lost: the run must stop.
    pub async fn checkpoint(&self, claim: &Claim, checkpoint: Checkpoint) -> Result<(), StoreError> {
        // Marked before the store answers: a checkpoint whose reply was lost may stand.
        claim.stepped.store(true, Ordering::Release);
        self.bounded(
            StoreOperation::Checkpoint,
            self.inner.store.checkpoint(&claim.id, claim.token, checkpoint),
        )
        .await
    }

    /// The steps recorded by the runs of this record before `claim`: none for a new claim (no
    /// store operation), those of the crashed or given-up run for a recovered one.
    pub async fn checkpoints(&self, claim: &Claim) -> Result<Vec<Checkpoint>, StoreError> {
        if !claim.recovered {
            return Ok(Vec::new());
        }
        self.bounded(StoreOperation::Checkpoints, self.inner.store.checkpoints(&claim.id))
            .await
    }

    /// How often a running claim renews its lease: a third of it, so two renewals can fail first.
    pub fn renew_every(&self) -> Duration {
        // Never zero, which no timer accepts: a policy that was not validated must not panic here.
        (self.inner.policy.lease / 3).max(Duration::from_millis(1))
    }
}
