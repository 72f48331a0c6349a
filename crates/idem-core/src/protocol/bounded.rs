//! Bounded store calls: every store operation is limited in time, so a store that hangs (a
//! half-open connection, a held lock) is a store that failed, and traced (a span of its own in the
//! request's, [`crate::spans`]). A leaf: it imports nothing back from the protocol.

use std::future::Future;
use std::time::Duration;

use super::Protocol;
use crate::spans::traced;
use crate::store::{StoreError, StoreOperation};

/// A store operation did not answer within the policy's `store_timeout`.
#[derive(Debug, thiserror::Error)]
#[error("the store did not answer within {0:?}")]
pub(crate) struct StoreTimedOut(pub(crate) Duration);

/// `operation`, or [`StoreError::Unavailable`] if it does not answer within `limit`.
pub(crate) async fn within<T>(
    limit: Duration,
    operation: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, operation)
        .await
        .unwrap_or_else(|_| Err(StoreError::unavailable(StoreTimedOut(limit))))
}

impl Protocol {
    /// Bounds the store operation `work` by the policy's `store_timeout`, traced as `operation`
    /// (a timeout is the operation's failure).
    pub(crate) async fn bounded<T>(
        &self,
        operation: StoreOperation,
        work: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        traced(operation, within(self.policy().store_timeout, work)).await
    }
}
