//! Completing a record inside the handler's own transaction, held in sqlx (feature `sqlx`): see
//! [`SqliteStore::complete_in`].

use bytes::Bytes;
use idem_core::StoreError;
use idem_core::protocol::{CompleteInError, InTransaction};

use crate::{SqliteStore, sql};

impl SqliteStore {
    /// Completes the record of `run` inside the caller's own transaction: `tx` is a sqlx connection
    /// to this store's file with a transaction open on it (`&mut *tx` of a
    /// `sqlx::Transaction<'_, Sqlite>`), in which the handler made its business writes.
    ///
    /// Under the database's write lock, the claim's token is checked and the answer `response`
    /// stored (as the route stores answers: allowed headers, sealed if keys are configured), and
    /// the record marked completed — in `tx`, so that it commits or rolls back with the business
    /// writes. `response` is marked, so that the layer sends it without storing it again. Commit
    /// `tx`, then return `response`.
    ///
    /// [`CompleteInError::Fenced`] if the claim was lost (the lease ran out and the record was
    /// taken over, or an operator deleted it): the transaction has been rolled back, so none of
    /// its writes can commit (a later commit fails). [`CompleteInError::NotStored`] for a status
    /// the route does not store (nothing is written).
    pub async fn complete_in(
        &self,
        tx: &mut sqlx::SqliteConnection,
        run: &InTransaction,
        response: &mut http::Response<Bytes>,
    ) -> Result<(), CompleteInError> {
        let completion = run.completion(response)?;
        let id = run.id();
        let done = sqlx::query(sql::COMPLETE)
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .bind(&run.token().as_bytes()[..])
            .bind(&completion.response[..])
            .bind(completion.completed_at.as_i64())
            .bind(completion.expires_at.as_i64())
            .bind(completion.purge_at.as_i64())
            .bind(completion.status)
            .execute(&mut *tx)
            .await
            .map_err(StoreError::unavailable)?;
        if done.rows_affected() == 0 {
            // Fails by design, taking the whole transaction with it: a holder that lost its claim
            // must not commit its business writes, even if it ignores this error.
            match sqlx::query(sql::ABORT_TRANSACTION).execute(&mut *tx).await {
                Err(_) => return Err(CompleteInError::Fenced),
                Ok(_) => {
                    return Err(StoreError::Corrupt(format!(
                        "idem_fence took a row, so the transaction of the lost claim on {} {} was not rolled back",
                        id.scope, id.key
                    ))
                    .into());
                }
            }
        }
        run.mark(response);
        Ok(())
    }
}
