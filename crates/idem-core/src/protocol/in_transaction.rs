//! Exactly once with the business write: a handler whose data lives in the store's own database
//! completes its record inside its own transaction.
//!
//! On a store that [completes in transactions](crate::Store::completes_in_transactions), every
//! keyed handler is given an [`InTransaction`] (the gateway passes its
//! [`completion_token`](InTransaction::completion_token) to its upstream). It hands its
//! transaction and its answer to the store's `complete_in` (`idem_postgres`, `idem_sqlite`), which
//! checks the claim's token under the record's lock, stores the answer and marks the record
//! completed — all in that transaction. Then:
//!
//! * the transaction commits: the business write and the answer stand together, and the layer
//!   sends the answer without storing it again ([`Protocol::confirm`] reads that it was stored);
//! * it rolls back, or the process dies before the commit: neither stands. On a route that
//!   declares every effect of its handlers to be in that transaction
//!   ([`Policy::in_transaction`](crate::Policy)), the claim is given up (or, its holder dead,
//!   taken over) as a run that had no effect: the retry runs unflagged; elsewhere it is flagged
//!   recovered, as for any handler;
//! * the claim was lost meanwhile (a holder frozen past its lease and taken over): the completion
//!   fails and aborts the transaction, so the holder's business write never commits.

use bytes::Bytes;
use http::{Response, StatusCode};

use super::{Claim, Protocol};
use crate::problem::{Problem, ProblemKind};
use crate::scope::hex;
use crate::store::{ClaimState, Completion, FencingToken, RecordId, StoreError, StoreOperation};
use crate::time::UnixMillis;

/// What a keyed handler on a store that completes in transactions finds in its request's
/// extensions: the claim it runs under, to complete in its own transaction.
#[derive(Debug, Clone)]
pub struct InTransaction {
    protocol: Protocol,
    claim: Claim,
}

/// Put into a response's extensions once its answer was written in the handler's transaction:
/// the layer then sends it without storing it again, once it has read that the record was
/// completed under the claim (that the transaction committed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompletedInTransaction {
    token: FencingToken,
}

impl CompletedInTransaction {
    /// Whether the answer was written under `claim`.
    pub fn is_of(&self, claim: &Claim) -> bool {
        self.token == claim.token()
    }
}

/// Why an answer could not be completed in the handler's transaction.
#[derive(Debug, thiserror::Error)]
pub enum CompleteInError {
    /// The claim is no longer current (the lease was lost and the record taken over, released or
    /// deleted): the transaction was aborted, so none of its writes can commit. Stop: the run
    /// that holds the key now answers the client.
    #[error("the claim on this record was lost (fencing token is no longer current); the transaction was aborted")]
    Fenced,
    /// The answer's status is one the route does not store (a retry runs again instead): return
    /// it without completing, and do not commit the transaction's writes.
    #[error("a {0} answer is not stored (a retry runs the request again); it cannot complete the record")]
    NotStored(StatusCode),
    /// The database failed; the transaction cannot be relied on.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl CompleteInError {
    /// What the client should get when the completion failed, for a handler to return (its
    /// transaction's writes must not commit): `409 key-in-flight` when the claim was lost (a retry
    /// gets the answer of the run that holds the key now), `500` for a status that is not stored,
    /// `503 store-unavailable` when the database failed.
    pub fn problem(&self) -> Problem {
        match self {
            Self::Fenced => claim_lost(),
            Self::NotStored(status) => Problem::new(
                ProblemKind::Internal,
                format!("the handler tried to complete its record with a {status} answer, which is not stored"),
            ),
            Self::Store(err) => Problem::new(
                ProblemKind::StoreUnavailable,
                format!(
                    "the answer could not be stored with the request's writes ({err}); nothing was committed, retry with the same key"
                ),
            ),
        }
    }
}

/// `409 key-in-flight`: the claim of a run that completes in its transaction was lost while it ran
/// (taken over after its lease, or deleted), so its writes did not commit; the run that holds the
/// key now answers the retry.
pub(crate) fn claim_lost() -> Problem {
    Problem::new(
        ProblemKind::KeyInFlight,
        "another run took this key over while this one ran, and this one's writes did not commit; retry with the same key to receive that run's answer",
    )
}

impl InTransaction {
    /// The handle of the run under `claim`.
    pub fn new(protocol: Protocol, claim: Claim) -> Self {
        Self { protocol, claim }
    }

    /// The record.
    pub fn id(&self) -> &RecordId {
        self.claim.id()
    }

    /// The claim's token, which the completion checks.
    pub fn token(&self) -> FencingToken {
        self.claim.token()
    }

    /// True if an earlier run of this key may have had effects: check before acting again. (An
    /// in-transaction run that died before its commit left none: its successor is not recovered.)
    pub fn recovered(&self) -> bool {
        self.claim.recovered()
    }

    /// The stored form of `response` (its allowed headers; the body whole, or compact if it is
    /// over `max_stored_body`; sealed if keys are configured) with its retention, on the store's
    /// clock: what the store writes in the transaction.
    pub fn completion(&self, response: &Response<Bytes>) -> Result<Completion, CompleteInError> {
        let policy = self.protocol.policy();
        if !policy.stores(response.status()) {
            return Err(CompleteInError::NotStored(response.status()));
        }
        let body = (response.body().len() <= policy.max_stored_body).then(|| response.body().clone());
        let stored = self
            .protocol
            .capture_parts(self.id(), response.status(), response.headers(), body);
        let now = self.protocol.now();
        let (expires_at, purge_at) = policy.retention(now, self.claim.provisional());
        Ok(Completion {
            response: stored,
            status: response.status().as_u16(),
            completed_at: now,
            expires_at,
            purge_at,
        })
    }

    /// The run's completion token, for an upstream in any language to pass to the SQL function
    /// `idem_complete(token, status, headers, body)` that the PostgreSQL store installs:
    /// `idem1.<scope>.<key>.<fencing token>.<ttl ms>.<record ms>`, the first three in hex. It names
    /// this record and this claim only, and is unguessable (the fencing token's random bytes);
    /// the two durations are the route's retention, from the completion.
    pub fn completion_token(&self) -> String {
        let (expires_at, purge_at) = self
            .protocol
            .policy()
            .retention(UnixMillis(0), self.claim.provisional());
        let id = self.id();
        format!(
            "idem1.{}.{}.{}.{}.{}",
            hex(id.scope.as_str().as_bytes()),
            hex(id.key.as_str().as_bytes()),
            hex(self.token().as_bytes()),
            expires_at.as_i64(),
            purge_at.as_i64()
        )
    }

    /// Marks `response` as completed in the transaction: the layer will not store it again.
    pub fn mark<B>(&self, response: &mut Response<B>) {
        response.extensions_mut().insert(CompletedInTransaction {
            token: self.claim.token(),
        });
    }
}

impl Protocol {
    /// True if the store can complete records in a handler's own transaction: then every keyed
    /// handler is given an [`InTransaction`].
    pub fn completes_in_transactions(&self) -> bool {
        self.store().completes_in_transactions()
    }

    /// Where the run under `claim` stands once its handler answered with an answer it completed in
    /// its own transaction: [`ClaimState::Completed`] if that transaction committed,
    /// [`ClaimState::Current`] if it did not (nothing of it stands), [`ClaimState::Ended`] if the
    /// claim was lost.
    pub async fn confirm(&self, claim: &Claim) -> Result<ClaimState, StoreError> {
        self.bounded(
            StoreOperation::ClaimState,
            self.store().claim_state(claim.id(), claim.token()),
        )
        .await
    }
}
