//! [`Invalidations`]: how a store tells this instance's [replay caches](crate::replay_cache) that
//! records were deleted, and whether its channel is up to tell them.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

/// What a pushed announcement is allowed to take from the delete's commit to every subscribed
/// instance (a Redis Cluster passes a `PUBLISH` from node to node over its bus): `idem delete`
/// waits this long. A loaded machine can take longer; the cache's `max_age` bounds what is left.
pub const PUSHED_DELIVERY: Duration = Duration::from_millis(250);

/// A short digest of a record's id ([`RecordId::digest`](crate::store::RecordId::digest)): what
/// stores' notifications name a record by, by which a replay cache finds the entry to forget.
pub type RecordDigest = [u8; 16];

/// What hears of deletes: a replay cache.
pub(crate) trait Invalidated: Send + Sync {
    /// The record with `digest` was deleted.
    fn forget(&self, digest: &RecordDigest);
    /// Any record may have changed unannounced.
    fn forget_all(&self);
}

/// What a store's notification channel tells the replay caches of this instance: which records
/// were deleted (by any instance, or by an operator's `idem delete`), and whether the channel is
/// up. A store keeps one and hands it out with [`Store::invalidations`](crate::Store).
pub struct Invalidations {
    watchers: Mutex<Vec<Weak<dyn Invalidated>>>,
    /// Whether the store's channel is up: while it is down, deletes may go unannounced, and no
    /// cache answers.
    listening: AtomicBool,
    /// How many times the channel came up.
    resumptions: AtomicU64,
    /// How long a delete made elsewhere may take to reach this instance's caches while the channel
    /// is up: [`PUSHED_DELIVERY`] for a pushed announcement, two intervals for a polled one.
    reach: Duration,
}

/// A pushed channel ([`Invalidations::new`]): a derived default would allow no time for delivery.
impl Default for Invalidations {
    fn default() -> Self {
        Self::new()
    }
}

impl Invalidations {
    /// A channel that pushes each announcement (pub/sub, `NOTIFY`), not up yet: caches answer
    /// once the store calls [`Self::resumed`].
    pub fn new() -> Self {
        Self::reaching_within(PUSHED_DELIVERY)
    }

    /// A channel that this instance reads every `interval` (a count of deletes in the store),
    /// not up yet.
    pub fn polled_every(interval: Duration) -> Self {
        // A poll that started just before the delete committed, then the next one.
        Self::reaching_within(interval * 2)
    }

    fn reaching_within(reach: Duration) -> Self {
        Self {
            watchers: Mutex::default(),
            listening: AtomicBool::default(),
            resumptions: AtomicU64::default(),
            reach,
        }
    }

    /// How long a delete made by another process may take to reach this instance's caches while
    /// the channel is up: [`PUSHED_DELIVERY`] for a pushed announcement (sent when the delete
    /// commits, delivered a moment later: across a Redis Cluster's bus, then to the subscriber's
    /// task), two intervals for a polled one. An operator's `idem delete` waits this long before it
    /// returns, so that no instance replays the answer once it has.
    pub fn reach(&self) -> Duration {
        self.reach
    }

    /// The record with `digest` was deleted: every cache forgets it.
    pub fn deleted(&self, digest: &RecordDigest) {
        self.each(|watcher| watcher.forget(digest));
    }

    /// Records may have changed without notice (several deletes, or deletes whose notifications
    /// may have been missed): every cache forgets everything.
    pub fn flush(&self) {
        self.each(|watcher| watcher.forget_all());
    }

    /// The channel went down: deletes from now on may go unannounced, so caches stop answering
    /// (and forget what they hold) until [`Self::resumed`].
    pub fn lost(&self) {
        self.listening.store(false, Ordering::SeqCst);
        self.flush();
    }

    /// The channel is up (again): caches forget what they held (deletes announced while it was
    /// down were lost) and answer again.
    pub fn resumed(&self) {
        // Flushed after the flag is up: an entry kept in between was read after the channel was
        // back, and a flush before it could miss one read while it was down.
        self.listening.store(true, Ordering::SeqCst);
        self.flush();
        self.resumptions.fetch_add(1, Ordering::SeqCst);
    }

    /// How many times the channel came up (at the start, and after each loss).
    pub fn resumptions(&self) -> u64 {
        self.resumptions.load(Ordering::SeqCst)
    }

    /// Whether the channel is up.
    pub fn is_listening(&self) -> bool {
        self.listening.load(Ordering::SeqCst)
    }

    /// Whether any cache listens, so that a store can skip work nobody needs (polling).
    pub fn is_watched(&self) -> bool {
        self.lock().iter().any(|watcher| watcher.strong_count() > 0)
    }

    /// Tells `watcher` (a replay cache) of every delete, for as long as it lives.
    pub(crate) fn watch(&self, watcher: Weak<dyn Invalidated>) {
        let mut watchers = self.lock();
        watchers.retain(|watcher| watcher.strong_count() > 0);
        watchers.push(watcher);
    }

    fn each(&self, mut apply: impl FnMut(&dyn Invalidated)) {
        for watcher in self.lock().iter().filter_map(Weak::upgrade) {
            apply(&*watcher);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Weak<dyn Invalidated>>> {
        // Every critical section is one call on the list: it stays consistent after a panic.
        self.watchers.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for Invalidations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Invalidations")
            .field("watchers", &self.lock().len())
            .field("listening", &self.is_listening())
            .finish()
    }
}
