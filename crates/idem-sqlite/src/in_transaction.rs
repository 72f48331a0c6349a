//! Completing a record inside the handler's own transaction, held in sqlx (feature `sqlx`): see
//! [`SqliteStore::complete_in`].

use bytes::Bytes;
use idem_core::StoreError;
use idem_core::protocol::{CompleteInError, InTransaction};
use sqlx::{Sqlite, Transaction};

use crate::{SqliteStore, sql};

impl SqliteStore {
    /// Completes the record of `run` inside the caller's own transaction: `tx` is a sqlx
    /// transaction on this store's file (the outermost one, not one begun inside another), in
    /// which the handler made its business writes.
    ///
    /// Under the database's write lock, the claim's token is checked and the answer `response`
    /// stored (as the route stores answers: allowed headers, sealed if keys are configured), and
    /// the record marked completed — in `tx`, so that it commits or rolls back with the business
    /// writes. `response` is marked, so that the layer sends it without storing it again. Commit
    /// the transaction this returns, then return `response`.
    ///
    /// `tx` is taken by value, unlike PostgreSQL's `complete_in`, because SQLite cannot keep a
    /// failed transaction open: once it is rolled back, each later statement on its connection
    /// would commit on its own. So on any error `tx` has been rolled back and is gone, and no
    /// write of the handler's can commit with it. [`CompleteInError::Fenced`] if the claim was
    /// lost (the lease ran out and the record was taken over, or an operator deleted it);
    /// [`CompleteInError::NotStored`] for a status the route does not store.
    ///
    /// A handler cannot go on writing in a transaction whose completion was fenced:
    ///
    /// ```compile_fail,E0382
    /// # async fn pay(store: idem_sqlite::SqliteStore, run: idem_core::protocol::InTransaction,
    /// #     pool: sqlx::SqlitePool, mut answer: http::Response<bytes::Bytes>) {
    /// let mut tx = pool.begin().await.unwrap();
    /// let _ignored = store.complete_in(tx, &run, &mut answer).await;
    /// sqlx::query("INSERT INTO ledger (key) VALUES ('x')").execute(&mut *tx).await.unwrap();
    /// tx.commit().await.unwrap();
    /// # }
    /// ```
    pub async fn complete_in<'c>(
        &self,
        mut tx: Transaction<'c, Sqlite>,
        run: &InTransaction,
        response: &mut http::Response<Bytes>,
    ) -> Result<Transaction<'c, Sqlite>, CompleteInError> {
        let completion = match run.completion(response) {
            Ok(completion) => completion,
            Err(err) => return Err(rolled_back(tx, err).await),
        };
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
            .await;
        let done = match done {
            Ok(done) => done,
            Err(err) => return Err(rolled_back(tx, StoreError::unavailable(err).into()).await),
        };
        if done.rows_affected() == 0 {
            // Fails by design, taking the whole SQLite transaction with it, savepoints and all,
            // even if `tx` was begun inside another: a holder that lost its claim must not
            // commit its business writes.
            let fenced = match sqlx::query(sql::ABORT_TRANSACTION).execute(&mut *tx).await {
                Err(_) => CompleteInError::Fenced,
                Ok(_) => StoreError::Corrupt(format!(
                    "idem_fence took a row, so the transaction of the lost claim on {} {} was not rolled back",
                    id.scope, id.key
                ))
                .into(),
            };
            return Err(rolled_back(tx, fenced).await);
        }
        run.mark(response);
        Ok(tx)
    }
}

/// Rolls `tx` back before `err` is returned, so that the connection is out of the transaction
/// (and the file's write lock free) by the time the caller sees the error. After `OR ROLLBACK`
/// SQLite has already ended it: sqlx then only updates its own count of open transactions.
async fn rolled_back(tx: Transaction<'_, Sqlite>, err: CompleteInError) -> CompleteInError {
    if let Err(rollback) = tx.rollback().await {
        // The error the caller needs is `err`. The transaction is gone all the same: sqlx queues
        // another rollback when it drops it, and nothing can commit it any more.
        tracing::warn!(error = %rollback, "rolling back a transaction whose completion failed");
    }
    err
}
