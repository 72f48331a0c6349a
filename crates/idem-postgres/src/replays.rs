//! Replay counts, written in batches: a replay is one read, never a write.
//!
//! Counting each replay in its own `UPDATE` made a replay a transaction with a row lock and a
//! commit (a WAL flush), five round trips where one `SELECT` answers it, and serialised the copies
//! of a hot key on its row lock. Instead each store counts replays in memory and adds them to
//! their rows in one statement every [`FLUSH_EVERY`]. The counts are statistics: `idem inspect`
//! on another instance sees them up to that late, and an instance that dies loses at most its
//! last interval's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use deadpool_postgres::Pool;
use idem_core::RecordId;

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

/// Replays counted and not yet written, by record.
#[derive(Debug, Default)]
pub(crate) struct ReplayCounts(Mutex<HashMap<RecordId, u64>>);

impl ReplayCounts {
    /// Counts one replay of `id`; returns how many are counted here and not yet written.
    pub(crate) fn add(&self, id: &RecordId) -> u64 {
        let mut counts = self.0.lock().expect("replay counts lock");
        let count = counts.entry(id.clone()).or_default();
        *count += 1;
        *count
    }

    /// The replays of `id` counted here and not yet written.
    pub(crate) fn pending(&self, id: &RecordId) -> u64 {
        self.0.lock().expect("replay counts lock").get(id).copied().unwrap_or(0)
    }

    /// Forgets the replays of `id` not yet written (its record is gone).
    pub(crate) fn forget(&self, id: &RecordId) -> u64 {
        self.0.lock().expect("replay counts lock").remove(id).unwrap_or(0)
    }

    fn take(&self) -> HashMap<RecordId, u64> {
        std::mem::take(&mut *self.0.lock().expect("replay counts lock"))
    }

    /// Puts back counts whose write failed, to try again with the next.
    fn restore(&self, counts: HashMap<RecordId, u64>) {
        let mut pending = self.0.lock().expect("replay counts lock");
        for (id, n) in counts {
            *pending.entry(id).or_default() += n;
        }
    }

    /// Writes the counts every [`FLUSH_EVERY`] while `alive` (the store) lives, and once more
    /// when it is gone.
    pub(crate) fn flush_forever<T: Send + Sync + 'static>(counts: Arc<Self>, pool: Pool, alive: Weak<T>) {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(FLUSH_EVERY).await;
                let last = alive.strong_count() == 0;
                counts.flush(&pool).await;
                if last {
                    return;
                }
            }
        });
    }

    async fn flush(&self, pool: &Pool) {
        let counts = self.take();
        if counts.is_empty() {
            return;
        }
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
        if let Err(err) = written {
            tracing::warn!(error = %err, records = counts.len(), "could not write replay counts; trying again");
            self.restore(counts);
        }
    }
}
