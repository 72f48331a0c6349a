//! The replay cache: completed answers kept in this instance's memory, so that a replay is
//! answered without a store round trip.
//!
//! It never changes an answer, only where it is read from:
//! * an entry is a completed record exactly as the store returned it, and the request is judged on
//!   it as on the store's (the fingerprint compared, `422` on another body);
//! * it answers only before the record's `expires_at`, on the protocol's clock (the store's):
//!   from then on the store decides (a replay, a tombstone's `key-expired`);
//! * a delete anywhere reaches every instance's cache at once through the store's own notification
//!   channel ([`Invalidations`]: Redis pub/sub, PostgreSQL `NOTIFY`, in-process for SQLite, with a
//!   polled counter for other processes on the same file);
//! * while that channel is down the cache answers nothing, and it is emptied when the channel is
//!   back, since deletes announced meanwhile were lost;
//! * a notification lost without the channel noticing (a silently dead connection, a cluster
//!   node's resubscription) cannot leave an entry answering for long: each entry is read from the
//!   store again once it is [`ReplayCacheConfig::max_age`] old;
//! * a process that was stalled (stopped, paused, starved) for longer than [`STALL`] forgets
//!   everything before it answers again, since announcements may wait unread in its sockets;
//! * a store that lost its data (flushed, restarted empty, failed over to an empty node, migrated
//!   anew) announces nothing: a cache made for a store ([`ReplayCache::for_store`]) reads the
//!   store's [identity](crate::store::StoreIdentity) every [`IDENTITY_CHECK`], forgets
//!   everything when it changed, and answers only while the last read is recent
//!   ([`IDENTITY_TRUSTED`]), so no answer the store no longer holds is replayed from memory for
//!   longer than that.
//!
//! A read that raced a delete is not kept: every invalidation moves the cache's generation on,
//! and an entry is kept only if the generation is the one seen before the store was asked.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::store::invalidations::Invalidated;
use crate::store::{Invalidations, Record, RecordDigest, RecordId, RecordState, Store, StoreIdentity};
use crate::time::UnixMillis;

/// How large a [`ReplayCache`] may grow, and how long an entry is trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayCacheConfig {
    /// The most answers kept; `0` turns the cache off.
    pub entries: usize,
    /// The most bytes kept (the answers' encoded size, with their records' keys and
    /// fingerprints). An answer larger than an eighth of it is never kept.
    pub bytes: usize,
    /// How long an entry answers before it is read from the store again: the bound on how long
    /// an answer deleted elsewhere can still be replayed here if the delete's notification was
    /// lost without the channel noticing.
    pub max_age: Duration,
}

impl ReplayCacheConfig {
    /// The default: 10 000 answers, 32 MiB, entries read again after 10 s.
    pub const DEFAULT: Self = Self {
        entries: 10_000,
        bytes: 32 << 20,
        max_age: Duration::from_secs(10),
    };

    /// No cache: every replay is read from the store.
    pub const OFF: Self = Self {
        entries: 0,
        bytes: 0,
        max_age: Duration::ZERO,
    };

    /// True if this configuration keeps nothing.
    pub fn is_off(&self) -> bool {
        self.entries == 0 || self.bytes == 0 || self.max_age.is_zero()
    }
}

impl Default for ReplayCacheConfig {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Completed answers kept in memory, bounded by entries and bytes, the oldest entry making way
/// first. Shared by every route of a layer (or gateway); see the [module](self) for why it never
/// changes an answer.
pub struct ReplayCache {
    config: ReplayCacheConfig,
    invalidations: Arc<Invalidations>,
    entries: Mutex<Entries>,
    /// When this instance last showed it was running: see [`STALL`].
    heartbeat: Heartbeat,
    /// The store's identity, read every [`IDENTITY_CHECK`] (`None`: a cache made without its
    /// store, which only the store's channel invalidates).
    identity: Option<IdentityWatch>,
}

/// A pause of this process longer than this (a `SIGSTOP`, a VM paused, a runtime starved) empties
/// the cache: announcements that arrived meanwhile wait unread in a socket, and a request served
/// first must not be answered from memory. Shown by a heartbeat every [`BEAT`]: a look-up that
/// finds it older, or a beat that comes this late, empties the cache first.
pub const STALL: Duration = Duration::from_secs(1);

/// How often the heartbeat beats.
const BEAT: Duration = Duration::from_millis(100);

/// How often a cache made for a store reads the store's identity: after a store lost its data,
/// its answers are replayed from memory for at most this long (plus one read of the store).
pub const IDENTITY_CHECK: Duration = Duration::from_secs(1);

/// How long a cache answers after the last read of its store's identity that succeeded: a store
/// that does not answer that read (an outage, a slow store) is not trusted to be the same one.
pub const IDENTITY_TRUSTED: Duration = Duration::from_secs(3);

/// What a cache made for a store knows of the store's identity.
struct IdentityWatch {
    store: Arc<dyn Store>,
    /// What the last successful read found (`Some(None)`: the store had no salt), `None` before it.
    known: Mutex<Option<Option<StoreIdentity>>>,
    /// When that read was made, in milliseconds since the heartbeat's origin; `u64::MAX` before it.
    confirmed_ms: AtomicU64,
}

/// The last beat, in milliseconds since the cache was made (no heartbeat without a runtime: then
/// never stale).
struct Heartbeat {
    origin: Instant,
    last_ms: AtomicU64,
    beating: AtomicBool,
}

impl Heartbeat {
    fn new() -> Self {
        Self {
            origin: Instant::now(),
            last_ms: AtomicU64::new(0),
            beating: AtomicBool::new(false),
        }
    }

    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether the last beat is older than [`STALL`] (never before the heart beats).
    fn stalled(&self) -> bool {
        self.beating.load(Ordering::Acquire)
            && self.elapsed_ms().saturating_sub(self.last_ms.load(Ordering::Acquire)) > STALL.as_millis() as u64
    }

    fn beat(&self) {
        self.last_ms.store(self.elapsed_ms(), Ordering::Release);
    }
}

/// What a look-up found.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// The record, completed and unexpired.
    Hit(Arc<Record>),
    /// Nothing usable: ask the store, and keep what it says with [`ReplayCache::keep`] under this
    /// generation.
    Miss(Generation),
}

/// The cache's generation when the store was asked (see the [module](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Generation(u64);

#[derive(Default)]
struct Entries {
    /// By record: a look-up hashes the id, as any map key; the digest a delete is announced by
    /// is computed once, when an entry is kept.
    map: HashMap<RecordId, Entry>,
    /// Insertion order, for eviction: each item names an entry by id and serial; one whose entry
    /// was replaced or removed since is skipped.
    order: VecDeque<(RecordId, u64)>,
    bytes: usize,
    serial: u64,
    generation: u64,
}

struct Entry {
    record: Arc<Record>,
    /// [`RecordId::digest`] of the record: what its delete is announced by.
    digest: RecordDigest,
    kept_at: Instant,
    size: usize,
    serial: u64,
}

impl ReplayCache {
    /// A cache of `config`'s size whose entries are invalidated by `invalidations` (the store's);
    /// `None` if `config` keeps nothing.
    pub fn new(config: ReplayCacheConfig, invalidations: Arc<Invalidations>) -> Option<Arc<Self>> {
        Self::watching(config, invalidations, None)
    }

    fn watching(
        config: ReplayCacheConfig,
        invalidations: Arc<Invalidations>,
        identity: Option<IdentityWatch>,
    ) -> Option<Arc<Self>> {
        if config.is_off() {
            return None;
        }
        let cache = Arc::new(Self {
            config,
            invalidations: Arc::clone(&invalidations),
            entries: Mutex::default(),
            heartbeat: Heartbeat::new(),
            identity,
        });
        let watcher: Arc<dyn Invalidated> = cache.clone();
        invalidations.watch(Arc::downgrade(&watcher));
        Some(cache)
    }

    /// Starts the heartbeat (once, and only within a runtime); it stops with the cache.
    fn start_heartbeat(self: &Arc<Self>) {
        if self.heartbeat.beating.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.heartbeat.beating.swap(true, Ordering::AcqRel) {
            return;
        }
        self.heartbeat.beat();
        let cache = Arc::downgrade(self);
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(BEAT).await;
                let Some(cache) = cache.upgrade() else { return };
                if cache.heartbeat.stalled() {
                    cache.clear();
                }
                cache.heartbeat.beat();
            }
        });
        if let Some(watch) = &self.identity {
            let (cache, store) = (Arc::downgrade(self), Arc::clone(&watch.store));
            runtime.spawn(async move {
                loop {
                    let read = tokio::time::timeout(IDENTITY_CHECK, store.identity()).await;
                    let Some(cache) = cache.upgrade() else { return };
                    if let Ok(Ok(found)) = read {
                        cache.identity_read(found);
                    }
                    drop(cache);
                    tokio::time::sleep(IDENTITY_CHECK).await;
                }
            });
        }
    }

    /// The store's identity was read (by the cache's own reads, or with the store's salt, which
    /// carries it): if it is not the one read before, the store lost its data (or was replaced)
    /// and everything kept is forgotten.
    pub(crate) fn identity_read(&self, found: Option<StoreIdentity>) {
        let Some(watch) = &self.identity else { return };
        let mut known = watch.known.lock().unwrap_or_else(PoisonError::into_inner);
        if known.is_some_and(|known| known != found) {
            self.clear();
            tracing::warn!(
                "the store is not the one this instance knew (its data was lost, flushed or replaced): the replay cache was emptied"
            );
        }
        *known = Some(found);
        watch.confirmed_ms.store(self.heartbeat.elapsed_ms(), Ordering::Release);
    }

    /// Whether the cache answers as far as its store's identity goes (for the conformance suite,
    /// which waits for it after the cache's first look-up started the reads).
    #[cfg(feature = "testkit")]
    pub(crate) fn knows_its_stores_identity(&self) -> bool {
        self.identity_trusted()
    }

    /// Whether the store's identity was read recently enough for the cache to answer (always, for
    /// a cache made without its store).
    fn identity_trusted(&self) -> bool {
        self.identity.as_ref().is_none_or(|watch| {
            let confirmed = watch.confirmed_ms.load(Ordering::Acquire);
            confirmed != u64::MAX
                && self.heartbeat.elapsed_ms().saturating_sub(confirmed) <= IDENTITY_TRUSTED.as_millis() as u64
        })
    }

    /// A cache of `config`'s size in front of `store`, invalidated by its notification channel
    /// and by a change of its identity; `None` if `config` keeps nothing or the store cannot
    /// announce deletes.
    pub fn for_store(store: &Arc<dyn Store>, config: ReplayCacheConfig) -> Option<Arc<Self>> {
        let watch = IdentityWatch {
            store: Arc::clone(store),
            known: Mutex::default(),
            confirmed_ms: AtomicU64::new(u64::MAX),
        };
        Self::watching(config, store.invalidations()?, Some(watch))
    }

    /// The cache's configuration.
    pub fn config(&self) -> ReplayCacheConfig {
        self.config
    }

    /// How many answers it holds, and their bytes.
    pub fn usage(&self) -> (usize, usize) {
        let entries = self.lock();
        (entries.map.len(), entries.bytes)
    }

    /// The completed record of `id`, if kept, not past its `expires_at` at `now` and younger
    /// than `max_age`.
    pub(crate) fn lookup(self: &Arc<Self>, id: &RecordId, now: UnixMillis) -> Lookup {
        self.start_heartbeat();
        if self.heartbeat.stalled() {
            // What is read from the store from now on was read after the stall.
            self.clear();
            self.heartbeat.beat();
        }
        let mut entries = self.lock();
        let generation = Generation(entries.generation);
        if !self.invalidations.is_listening() || !self.identity_trusted() {
            return Lookup::Miss(generation);
        }
        let Some(entry) = entries.map.get(id) else {
            return Lookup::Miss(generation);
        };
        let usable = entry.kept_at.elapsed() < self.config.max_age
            && matches!(entry.record.state, RecordState::Completed { expires_at, .. } if now < expires_at);
        if usable {
            return Lookup::Hit(Arc::clone(&entry.record));
        }
        entries.remove(id);
        Lookup::Miss(generation)
    }

    /// Keeps `record` if it is a completed answer not past its `expires_at` at `now`, no
    /// invalidation came since `generation`, and the channel is up.
    pub(crate) fn keep(&self, record: &Record, now: UnixMillis, generation: Generation) {
        let RecordState::Completed {
            response: Some(response),
            expires_at,
            ..
        } = &record.state
        else {
            return;
        };
        if now >= *expires_at {
            return;
        }
        let size = response.len()
            + record.fingerprint.encode().len()
            + record.id.scope.as_str().len()
            + record.id.key.as_str().len()
            + ENTRY_OVERHEAD;
        if size > self.config.bytes / 8 {
            return;
        }
        let (record, digest) = (Arc::new(record.clone()), record.id.digest());
        let mut entries = self.lock();
        if entries.generation != generation.0 || !self.invalidations.is_listening() {
            return;
        }
        entries.insert(record, digest, size, &self.config);
    }

    fn clear(&self) {
        let mut entries = self.lock();
        let generation = entries.generation + 1;
        *entries = Entries {
            generation,
            ..Entries::default()
        };
    }

    fn lock(&self) -> MutexGuard<'_, Entries> {
        // Every critical section leaves the entries consistent before anything can panic.
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Invalidated for ReplayCache {
    /// A scan of the entries: deletes are rare, look-ups are every request.
    fn forget(&self, digest: &RecordDigest) {
        let mut entries = self.lock();
        entries.generation += 1;
        let deleted = entries
            .map
            .iter()
            .find_map(|(id, entry)| (entry.digest == *digest).then(|| id.clone()));
        if let Some(id) = deleted {
            entries.remove(&id);
        }
    }

    fn forget_all(&self) {
        self.clear();
    }
}

/// What an entry costs besides its bytes: the map's slot and key, the record's fixed fields, the
/// order's item.
const ENTRY_OVERHEAD: usize = 256;

impl Entries {
    fn insert(&mut self, record: Arc<Record>, digest: RecordDigest, size: usize, config: &ReplayCacheConfig) {
        self.serial += 1;
        let serial = self.serial;
        let id = record.id.clone();
        self.remove(&id);
        self.order.push_back((id.clone(), serial));
        self.map.insert(
            id,
            Entry {
                record,
                digest,
                kept_at: Instant::now(),
                size,
                serial,
            },
        );
        self.bytes += size;
        while self.map.len() > config.entries || self.bytes > config.bytes {
            let Some((oldest, serial)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&oldest).is_some_and(|entry| entry.serial == serial) {
                self.remove(&oldest);
            }
        }
        // Entries replaced or removed leave their items behind: dropped once they outnumber the
        // live ones, so that the order stays within twice the entries.
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order
                .retain(|(id, serial)| map.get(id).is_some_and(|entry| entry.serial == *serial));
        }
    }

    fn remove(&mut self, id: &RecordId) {
        if let Some(entry) = self.map.remove(id) {
            self.bytes -= entry.size;
        }
    }
}

impl fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (entries, bytes) = self.usage();
        f.debug_struct("ReplayCache")
            .field("config", &self.config)
            .field("entries", &entries)
            .field("bytes", &bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::{HeaderMap, Method};

    use super::*;
    use crate::store::Origin;
    use crate::{Fingerprint, IdempotencyKey, Scope};

    fn id(key: &str) -> RecordId {
        RecordId::new(Scope::from_stored("s"), IdempotencyKey::new(key).unwrap())
    }

    fn completed(key: &str, body: usize, expires_at: u64) -> Record {
        Record {
            id: id(key),
            fingerprint: Fingerprint::of(&Method::POST, &"/pay".parse().unwrap(), &HeaderMap::new(), b"{}"),
            created_at: UnixMillis(1),
            replays: 0,
            state: RecordState::Completed {
                response: Some(Bytes::from(vec![b'x'; body])),
                completed_at: UnixMillis(1),
                expires_at: UnixMillis(expires_at),
                purge_at: UnixMillis(expires_at * 2),
            },
            origin: Origin::default(),
            recovered: false,
            status: None,
        }
    }

    fn listening() -> Arc<Invalidations> {
        let invalidations = Arc::new(Invalidations::new());
        invalidations.resumed();
        invalidations
    }

    fn new_cache(config: ReplayCacheConfig) -> (Arc<ReplayCache>, Arc<Invalidations>) {
        let invalidations = listening();
        (
            ReplayCache::new(config, Arc::clone(&invalidations)).unwrap(),
            invalidations,
        )
    }

    fn keep(cache: &Arc<ReplayCache>, record: &Record, now: u64) {
        let Lookup::Miss(generation) = cache.lookup(&record.id, UnixMillis(now)) else {
            panic!("expected a miss");
        };
        cache.keep(record, UnixMillis(now), generation);
    }

    fn hit(cache: &Arc<ReplayCache>, key: &str, now: u64) -> bool {
        let id = id(key);
        matches!(cache.lookup(&id, UnixMillis(now)), Lookup::Hit(_))
    }

    #[test]
    fn answers_until_the_record_expires_on_the_given_clock() {
        let (cache, _) = new_cache(ReplayCacheConfig::DEFAULT);
        keep(&cache, &completed("a", 10, 1_000), 10);
        assert!(hit(&cache, "a", 999));
        assert!(!hit(&cache, "a", 1_000), "at expires_at the store decides");
        assert!(
            !hit(&cache, "a", 10),
            "an expired entry is dropped, not kept for a clock that goes back"
        );
        keep(&cache, &completed("b", 10, 1_000), 1_000);
        assert!(!hit(&cache, "b", 10), "an expired record is never kept");
    }

    #[test]
    fn keeps_only_completed_answers() {
        let (cache, _) = new_cache(ReplayCacheConfig::DEFAULT);
        let mut tombstone = completed("t", 10, 1_000);
        if let RecordState::Completed { response, .. } = &mut tombstone.state {
            *response = None;
        }
        keep(&cache, &tombstone, 10);
        let unknown = Record {
            state: RecordState::Unknown {
                expires_at: UnixMillis(1_000),
                purge_at: UnixMillis(2_000),
            },
            ..completed("u", 10, 1_000)
        };
        keep(&cache, &unknown, 10);
        assert_eq!(cache.usage().0, 0);
    }

    #[test]
    fn stays_within_its_entries_and_bytes_dropping_the_oldest() {
        let config = ReplayCacheConfig {
            entries: 3,
            bytes: 1 << 20,
            max_age: Duration::from_secs(60),
        };
        let (cache, _) = new_cache(config);
        for key in ["a", "b", "c", "d"] {
            keep(&cache, &completed(key, 10, 1_000), 10);
        }
        assert_eq!(cache.usage().0, 3);
        assert!(!hit(&cache, "a", 10) && hit(&cache, "d", 10));

        let config = ReplayCacheConfig {
            entries: 100,
            bytes: 8 * 1024,
            max_age: Duration::from_secs(60),
        };
        let (cache, _) = new_cache(config);
        keep(&cache, &completed("huge", 2 * 1024, 1_000), 10);
        assert_eq!(cache.usage().0, 0, "larger than an eighth of the bytes: never kept");
        for n in 0..100 {
            keep(&cache, &completed(&format!("k{n}"), 500, 1_000), 10);
            assert!(cache.usage().1 <= 8 * 1024);
        }
        assert!(hit(&cache, "k99", 10) && !hit(&cache, "k0", 10));
    }

    #[test]
    fn the_order_does_not_grow_with_entries_kept_again() {
        let (cache, _) = new_cache(ReplayCacheConfig::DEFAULT);
        for _ in 0..10_000 {
            keep(&cache, &completed("a", 10, 1_000), 10);
            cache.forget(&id("a").digest());
        }
        assert!(cache.lock().order.len() <= 65);
    }

    #[test]
    fn a_delete_or_a_lost_channel_empties_it_and_a_raced_read_is_not_kept() {
        let (cache, invalidations) = new_cache(ReplayCacheConfig::DEFAULT);
        keep(&cache, &completed("a", 10, 1_000), 10);
        keep(&cache, &completed("b", 10, 1_000), 10);
        invalidations.deleted(&id("a").digest());
        assert!(!hit(&cache, "a", 10) && hit(&cache, "b", 10));

        // A read that started before a delete reached this instance.
        let record = completed("c", 10, 1_000);
        let Lookup::Miss(generation) = cache.lookup(&record.id, UnixMillis(10)) else {
            panic!("expected a miss");
        };
        invalidations.deleted(&id("someone-else").digest());
        cache.keep(&record, UnixMillis(10), generation);
        assert!(!hit(&cache, "c", 10), "kept after an invalidation it may have missed");

        invalidations.lost();
        assert!(!hit(&cache, "b", 10));
        keep(&cache, &completed("d", 10, 1_000), 10);
        assert!(!hit(&cache, "d", 10), "nothing is kept while the channel is down");
        invalidations.resumed();
        keep(&cache, &completed("d", 10, 1_000), 10);
        assert!(hit(&cache, "d", 10));
    }

    #[test]
    fn entries_are_read_again_after_max_age() {
        let config = ReplayCacheConfig {
            max_age: Duration::from_millis(50),
            ..ReplayCacheConfig::DEFAULT
        };
        let (cache, _) = new_cache(config);
        keep(&cache, &completed("a", 10, 1_000), 10);
        assert!(hit(&cache, "a", 10));
        std::thread::sleep(Duration::from_millis(60));
        assert!(!hit(&cache, "a", 10));
    }

    /// A process that was not running for longer than [`STALL`] (here its one thread blocked, as
    /// a `SIGSTOP` would) may have announcements waiting unread: it forgets everything before it
    /// answers again.
    #[tokio::test(flavor = "current_thread")]
    async fn a_stalled_process_forgets_everything() {
        let (cache, _) = new_cache(ReplayCacheConfig::DEFAULT);
        keep(&cache, &completed("a", 10, 1_000), 10);
        tokio::time::sleep(BEAT * 2).await;
        assert!(hit(&cache, "a", 10), "a beating heart keeps its entries");
        std::thread::sleep(STALL + BEAT * 2);
        assert!(!hit(&cache, "a", 10), "forgotten after the stall");
        keep(&cache, &completed("a", 10, 1_000), 10);
        assert!(hit(&cache, "a", 10), "and kept again afterwards");
    }

    #[test]
    fn a_channel_never_up_answers_nothing() {
        let invalidations = Arc::new(Invalidations::new());
        let cache = ReplayCache::new(ReplayCacheConfig::DEFAULT, invalidations).unwrap();
        keep(&cache, &completed("a", 10, 1_000), 10);
        assert!(!hit(&cache, "a", 10));
        assert!(ReplayCache::new(ReplayCacheConfig::OFF, listening()).is_none());
    }
}
