//! Replay counts kept in memory and written in batches, so that a replay is one read, never a
//! write.
//!
//! Counting each replay as it happens makes the replay a write: a row lock and a commit in
//! PostgreSQL, a write command inside the claim script in Redis, and the copies of a hot key
//! queue on it. A store that uses [`ReplayCounts`] counts here instead and adds the counts to its
//! records every so often, in one go. The counts are statistics: another instance sees them up to
//! one interval late, and an instance that dies loses at most its last interval's. A write that
//! fails is tried again with the next batch, so a blip loses nothing; a write whose reply was lost
//! after it took effect is made again too, so such a blip counts its batch twice (at least once,
//! never lost).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::{
    StoreError,
    store::{Record, RecordId},
};

/// Replays counted and not yet written, by record.
#[derive(Debug, Default)]
pub struct ReplayCounts(Mutex<HashMap<RecordId, u64>>);

impl ReplayCounts {
    /// Counts one replay of `record` and returns it with every replay of it counted here and not
    /// yet written added to its stored count.
    pub fn replayed(&self, mut record: Record) -> Record {
        record.replays += self.add(&record.id);
        record
    }

    /// Counts one replay of `id` answered without reading its record (from a replay cache).
    pub fn count(&self, id: &RecordId) {
        self.add(id);
    }

    /// `record` with the replays of it counted here and not yet written added to its stored count.
    pub fn with_pending(&self, mut record: Record) -> Record {
        record.replays += self.pending(&record.id);
        record
    }

    /// Counts one replay of `id`; returns how many are counted here and not yet written.
    fn add(&self, id: &RecordId) -> u64 {
        let mut counts = self.lock();
        let count = counts.entry(id.clone()).or_default();
        *count += 1;
        *count
    }

    /// The replays of `id` counted here and not yet written.
    fn pending(&self, id: &RecordId) -> u64 {
        self.lock().get(id).copied().unwrap_or(0)
    }

    /// Forgets the replays of `id` not yet written, as its record was just deleted, and returns
    /// `deleted` (the record as the deletion read it, if it could) with them added to its count.
    /// They are forgotten whatever `deleted` holds: the record is gone either way.
    pub fn deleted(
        &self,
        id: &RecordId,
        deleted: Result<Option<Record>, StoreError>,
    ) -> Result<Option<Record>, StoreError> {
        let unwritten = self.forget(id);
        deleted.map(|record| {
            record.map(|mut record| {
                record.replays += unwritten;
                record
            })
        })
    }

    /// Forgets the replays of `id` not yet written and returns how many.
    fn forget(&self, id: &RecordId) -> u64 {
        self.lock().remove(id).unwrap_or(0)
    }

    /// Takes every count not yet written, to write them.
    pub fn take(&self) -> HashMap<RecordId, u64> {
        std::mem::take(&mut *self.lock())
    }

    /// Puts back counts whose write failed, to be written with the next batch.
    pub fn restore(&self, counts: HashMap<RecordId, u64>) {
        let mut pending = self.lock();
        for (id, n) in counts {
            *pending.entry(id).or_default() += n;
        }
    }

    /// Writes the counts every `every` while `alive` (the store) lives, and once more when it is
    /// gone. `write` gets the counts taken and returns those it could not write, which are put
    /// back for the next round (it says why itself).
    ///
    /// Must be called within a Tokio runtime.
    pub fn flush_forever<T, W, F>(counts: Arc<Self>, every: Duration, alive: Weak<T>, write: W)
    where
        T: Send + Sync + 'static,
        W: Fn(HashMap<RecordId, u64>) -> F + Send + 'static,
        F: Future<Output = HashMap<RecordId, u64>> + Send,
    {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let last = alive.strong_count() == 0;
                let taken = counts.take();
                if !taken.is_empty() {
                    counts.restore(write(taken).await);
                }
                if last {
                    return;
                }
            }
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RecordId, u64>> {
        // A panic while the lock was held left a map of plain counts: still usable.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IdempotencyKey, Scope};

    fn id(key: &str) -> RecordId {
        RecordId::new(Scope::from_stored("s"), IdempotencyKey::new(key).unwrap())
    }

    #[test]
    fn counts_until_taken_and_keeps_what_was_not_written() {
        let counts = ReplayCounts::default();
        assert_eq!(counts.add(&id("a")), 1);
        assert_eq!(counts.add(&id("a")), 2);
        assert_eq!(counts.add(&id("b")), 1);
        assert_eq!(counts.pending(&id("a")), 2);

        let taken = counts.take();
        assert_eq!(taken.len(), 2);
        assert_eq!(counts.pending(&id("a")), 0, "taken counts are no longer pending");
        counts.add(&id("a"));
        counts.restore(taken);
        assert_eq!(
            counts.pending(&id("a")),
            3,
            "a failed write is added to what came since"
        );
        assert_eq!(counts.forget(&id("a")), 3);
        assert_eq!(counts.pending(&id("a")), 0);
        assert_eq!(counts.pending(&id("b")), 1);
    }
}
