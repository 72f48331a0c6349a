//! How replay counts reach their rows: a replay is one read, never a write.
//!
//! Counting each replay in its own `UPDATE` made a replay a transaction with a row lock and a
//! commit (a WAL flush), five round trips where one `SELECT` answers it, and serialised the copies
//! of a hot key on its row lock. Instead each store counts replays in memory
//! ([`ReplayCounts`](idem_core::store::backend::ReplayCounts)) and adds them to their rows in one
//! statement every [`FLUSH_EVERY`]. The counts are statistics: `idem inspect` on another instance
//! sees them up to that late, and an instance that dies loses at most its last interval's.

use std::collections::HashMap;
use std::time::Duration;

use deadpool_postgres::Pool;
use idem_core::store::RecordId;

/// How often counted replays are added to their rows.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// Adds the counts to their rows, whichever still exist. Rows are locked in the order of their
/// keys, so that two instances flushing at once never deadlock.
const FLUSH: &str = "
WITH counts AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[]) AS c(scope, key, n)
),
locked AS (
    SELECT r.scope, r.key, c.n
    FROM idem_records r JOIN counts c ON r.scope = c.scope AND r.key = c.key
    ORDER BY r.scope, r.key
    FOR UPDATE OF r
)
UPDATE idem_records r SET replays = r.replays + locked.n
FROM locked WHERE r.scope = locked.scope AND r.key = locked.key";

/// Adds `counts` to their rows in one statement; returns them all if it failed (nothing was
/// written), none if it succeeded.
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
        client
            .execute(&stmt, &[&scopes, &keys, &ns])
            .await
            .map_err(|err| err.to_string())
    }
    .await;
    match written {
        Ok(_) => HashMap::new(),
        Err(err) => {
            tracing::warn!(error = %err, records = counts.len(), "could not write replay counts; trying again");
            counts
        }
    }
}
