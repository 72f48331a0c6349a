//! Deletes announced to the replay caches ([`idem_core::replay_cache`]): at once to every store of
//! this process that opened the same file (a process-wide registry, as for the waiters), and to
//! other processes through the file's count of deletes (`idem_deletions`), which each store reads
//! every [`DELETIONS_POLL_INTERVAL`]: when it moved by more than this process's own deletes, every cache of
//! the file forgets everything.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};
use std::time::Duration;

use idem_core::store::Invalidations;
use idem_core::store::RecordDigest;
use rusqlite::{Connection, OptionalExtension, Transaction};

/// How often a store reads the file's count of deletes: the longest a delete made by another
/// process leaves an answer in this process's replay caches.
pub const DELETIONS_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Adds one to the file's count of deletes and returns it.
const COUNT_DELETE: &str = "
INSERT INTO idem_deletions (id, count) VALUES (1, 1)
ON CONFLICT (id) DO UPDATE SET count = count + 1
RETURNING count";

/// The file's count of deletes (no row: none yet).
const READ_COUNT: &str = "SELECT count FROM idem_deletions WHERE id = 1";

/// What the stores of this process on one file share: their replay caches' invalidations, and
/// the count of deletes they have accounted for.
#[derive(Debug)]
pub(crate) struct FileDeletions {
    invalidations: Arc<Invalidations>,
    /// The file's count of deletes that the caches have been told of (`UNKNOWN` before the
    /// first read).
    seen: AtomicI64,
}

const UNKNOWN: i64 = i64::MIN;

static FILES: LazyLock<Mutex<HashMap<Arc<Path>, Weak<FileDeletions>>>> = LazyLock::new(Default::default);

/// The deletes of the file `database` (its identity, as for the waiters), shared by every store
/// of this process that opened it.
pub(crate) fn of(database: &Arc<Path>) -> Arc<FileDeletions> {
    // Every critical section is one map operation: the map stays consistent after a panic.
    let mut files = FILES.lock().unwrap_or_else(PoisonError::into_inner);
    files.retain(|_, file| file.strong_count() > 0);
    if let Some(file) = files.get(database).and_then(Weak::upgrade) {
        return file;
    }
    let file = Arc::new(FileDeletions {
        invalidations: Arc::new(Invalidations::polled_every(DELETIONS_POLL_INTERVAL)),
        seen: AtomicI64::new(UNKNOWN),
    });
    files.insert(Arc::clone(database), Arc::downgrade(&file));
    file
}

impl FileDeletions {
    pub(crate) fn invalidations(&self) -> &Arc<Invalidations> {
        &self.invalidations
    }

    /// This process deleted the record with `digest`, which brought the file's count to `count`:
    /// the caches forget it. The count is accounted for only if it follows the one seen, so
    /// that another process's delete in between is still noticed by the next read.
    pub(crate) fn deleted(&self, digest: &RecordDigest, count: i64) {
        self.invalidations.deleted(digest);
        let _ = self
            .seen
            .compare_exchange(count - 1, count, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// What a read of the file's count found (`None`: it failed). Until a read succeeds the
    /// caches answer nothing; a count that moved without this process knowing empties them.
    pub(crate) fn polled(&self, count: Option<i64>) {
        let Some(count) = count else {
            if self.invalidations.is_listening() {
                tracing::warn!(
                    "cannot read the SQLite file's count of deletes; replay caches answer nothing until it can be read"
                );
            }
            self.invalidations.lost();
            return;
        };
        let before = self.seen.swap(count, Ordering::SeqCst);
        if !self.invalidations.is_listening() {
            self.invalidations.resumed();
        } else if before != count {
            self.invalidations.flush();
        }
    }
}

/// Adds the delete made in `tx` to the file's count; returns the new count.
pub(crate) fn count_delete(tx: &Transaction<'_>) -> rusqlite::Result<i64> {
    tx.prepare_cached(COUNT_DELETE)?.query_row([], |row| row.get(0))
}

/// Reads the file's count of deletes.
pub(crate) fn read_count(conn: &Connection) -> rusqlite::Result<i64> {
    Ok(conn
        .prepare_cached(READ_COUNT)?
        .query_row([], |row| row.get(0))
        .optional()?
        .unwrap_or(0))
}
