//! How replay counts reach their rows: a replay is one read, never a write.
//!
//! Counting each replay in its own `UPDATE` made a replay a transaction with a row lock and a
//! commit (a WAL flush), five round trips where one `SELECT` answers it, and serialised the copies
//! of a hot key on its row lock. Instead each store counts replays in memory
//! ([`ReplayCounts`](idem_core::store::backend::ReplayCounts)) and adds them to their rows in one
//! statement every [`FLUSH_EVERY`]. The counts are statistics: `idem inspect` on another instance
//! sees them up to that late, and an instance that dies loses at most its last interval's.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use deadpool_postgres::Pool;
use idem_core::store::RecordId;

/// How often counted replays are added to their rows.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// Adds the counts to their rows, whichever still exist, and returns the rows it skipped. A row
/// locked by another transaction (a handler's own, completing a record of that key in it; an
/// operator's delete) is skipped, not waited for: nothing of idem's queues on a record's row lock
/// (docs/design.md, "Where each store waits"). Its count is kept for the next round, unless the row
/// is gone. Rows are locked in the order of their keys all the same.
const FLUSH: &str = "
WITH counts AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[]) AS c(scope, key, n)
),
locked AS (
    SELECT r.scope, r.key, c.n
    FROM idem_records r JOIN counts c ON r.scope = c.scope AND r.key = c.key
    ORDER BY r.scope, r.key
    FOR UPDATE OF r SKIP LOCKED
),
added AS (
    UPDATE idem_records r SET replays = r.replays + locked.n
    FROM locked WHERE r.scope = locked.scope AND r.key = locked.key
    RETURNING r.scope, r.key
)
SELECT c.scope, c.key FROM counts c
WHERE NOT EXISTS (SELECT 1 FROM added a WHERE a.scope = c.scope AND a.key = c.key)
    AND EXISTS (SELECT 1 FROM idem_records r WHERE r.scope = c.scope AND r.key = c.key)";

/// Adds `counts` to their rows in one statement; returns them all if it failed (nothing was
/// written), and those of rows it found locked if it succeeded.
pub(crate) async fn write(pool: &Pool, counts: HashMap<RecordId, u64>) -> HashMap<RecordId, u64> {
    let (mut scopes, mut keys, mut ns) = (Vec::new(), Vec::new(), Vec::new());
    for (id, n) in &counts {
        scopes.push(id.scope.as_str());
        keys.push(id.key.as_str());
        ns.push(i64::try_from(*n).unwrap_or(i64::MAX));
    }
    let written = async {
        let client = pool.get().await.map_err(|err| err.to_string())?;
        let stmt = client.prepare_cached(FLUSH).await.map_err(|err| err.to_string())?;
        let skipped = client
            .query(&stmt, &[&scopes, &keys, &ns])
            .await
            .map_err(|err| err.to_string())?;
        skipped
            .iter()
            .map(|row| Ok((row.try_get::<_, String>(0)?, row.try_get::<_, String>(1)?)))
            .collect::<Result<HashSet<_>, tokio_postgres::Error>>()
            .map_err(|err| err.to_string())
    }
    .await;
    match written {
        Ok(skipped) if skipped.is_empty() => HashMap::new(),
        Ok(skipped) => {
            tracing::debug!(
                records = skipped.len(),
                "replay counts kept for the next round: their rows were locked"
            );
            counts
                .into_iter()
                .filter(|(id, _)| skipped.contains(&(id.scope.as_str().to_owned(), id.key.as_str().to_owned())))
                .collect()
        }
        Err(err) => {
            tracing::warn!(error = %err, records = counts.len(), "could not write replay counts; trying again");
            counts
        }
    }
}
