//! Completing a record inside the handler's own transaction: [`PostgresStore::complete_in`] for a
//! transaction held in sqlx (feature `sqlx`), [`PostgresStore::complete_in_client`] for one held in
//! tokio-postgres. Both call `idem_complete_claim`, which the migrations install (schema.rs): its
//! nine-argument form, which keeps the answer's status too (migration 7).

use std::error::Error as StdError;

use bytes::Bytes;
use idem_core::StoreError;
use idem_core::protocol::{CompleteInError, InTransaction};
use idem_core::store::Completion;

use crate::PostgresStore;
use crate::listener::payload;

/// The SQLSTATE `idem_complete_claim` raises when the claim is no longer current.
const FENCED: &str = "IDEM1";

impl PostgresStore {
    /// The call of `idem_complete_claim` in this store's schema, with the status (the eight-argument
    /// form without it is only for callers deployed before it).
    fn complete_claim_sql(&self) -> String {
        let function = match self.schema() {
            // The schema's name is checked when the URL is read: letters, digits and `_` only.
            Some(schema) => format!("\"{schema}\".idem_complete_claim"),
            None => "idem_complete_claim".to_owned(),
        };
        format!("SELECT {function}($1, $2, $3, $4, $5, $6, $7, $8, $9)")
    }

    /// Completes the record of `run` inside the caller's own transaction: `tx` is a sqlx
    /// connection to this store's database with a transaction open on it (`&mut *tx` of a
    /// `sqlx::Transaction<'_, Postgres>`), in which the handler made its business writes.
    ///
    /// Under the record's row lock, the claim's token is checked and the answer `response` stored
    /// (as the route stores answers: allowed headers, sealed if keys are configured), and the
    /// record marked completed — in `tx`, so that it commits or rolls back with the business
    /// writes. `response` is marked, so that the layer sends it without storing it again. Commit
    /// `tx`, then return `response`.
    ///
    /// [`CompleteInError::Fenced`] if the claim was lost (the lease ran out and the record was
    /// taken over, or an operator deleted it): the statement raised, so the transaction is
    /// aborted and none of its writes can commit. [`CompleteInError::NotStored`] for a status the
    /// route does not store (nothing is written).
    #[cfg(feature = "sqlx")]
    pub async fn complete_in(
        &self,
        tx: &mut sqlx::PgConnection,
        run: &InTransaction,
        response: &mut http::Response<Bytes>,
    ) -> Result<(), CompleteInError> {
        let completion = run.completion(response)?;
        let id = run.id();
        // The only part not bound is the schema's name, checked when the URL was read.
        let called = sqlx::query(sqlx::AssertSqlSafe(self.complete_claim_sql()))
            .bind(id.scope.as_str())
            .bind(id.key.as_str())
            .bind(&run.token().as_bytes()[..])
            .bind(&completion.response[..])
            .bind(completion.completed_at.as_i64())
            .bind(completion.expires_at.as_i64())
            .bind(completion.purge_at.as_i64())
            .bind(payload(id))
            .bind(i32::from(completion.status))
            .execute(&mut *tx)
            .await;
        match called {
            Ok(_) => {
                run.mark(response);
                Ok(())
            }
            Err(sqlx::Error::Database(err)) if err.code().as_deref() == Some(FENCED) => Err(CompleteInError::Fenced),
            Err(err) => Err(failed(err)),
        }
    }

    /// [`complete_in`](Self::complete_in) for a transaction held in tokio-postgres: `tx` is a
    /// `tokio_postgres::Transaction` (or any client with a transaction open) on this store's
    /// database.
    pub async fn complete_in_client(
        &self,
        tx: &impl tokio_postgres::GenericClient,
        run: &InTransaction,
        response: &mut http::Response<Bytes>,
    ) -> Result<(), CompleteInError> {
        let Completion {
            response: stored,
            status,
            completed_at,
            expires_at,
            purge_at,
        } = run.completion(response)?;
        let id = run.id();
        let stored: &[u8] = &stored;
        let called = tx
            .execute(
                &self.complete_claim_sql(),
                &[
                    &id.scope.as_str(),
                    &id.key.as_str(),
                    &&run.token().as_bytes()[..],
                    &stored,
                    &completed_at.as_i64(),
                    &expires_at.as_i64(),
                    &purge_at.as_i64(),
                    &payload(id),
                    &i32::from(status),
                ],
            )
            .await;
        match called {
            Ok(_) => {
                run.mark(response);
                Ok(())
            }
            Err(err) if err.code().is_some_and(|code| code.code() == FENCED) => Err(CompleteInError::Fenced),
            Err(err) => Err(failed(err)),
        }
    }
}

fn failed(err: impl StdError + Send + Sync + 'static) -> CompleteInError {
    CompleteInError::Store(StoreError::unavailable(err))
}
