//! A replay cache over the store: it answers only what it may, counts its replays in the store,
//! and forgets an answer as soon as any instance deletes it, a channel outage included.

use std::sync::Arc;
use std::time::Duration;

use super::Harness;
use super::helpers::{
    DAY, acquire, begin, completion, eventually, existing, fingerprint, fresh_id, stored_response, the_record,
};
use crate::replay_cache::{Lookup, ReplayCache, ReplayCacheConfig};
use crate::store::{Begin, Invalidations, RecordId};
use crate::{Store, UnixMillis};

/// How long a store may take to tell another instance's replay cache of a delete: at once
/// through its channel (Redis, PostgreSQL, SQLite in one process), within
/// two `idem_sqlite::DELETIONS_POLL_INTERVAL`s (100 ms) from another process; a margin for a loaded
/// machine on top.
pub const DELETE_REACHES_CACHES_WITHIN: Duration = Duration::from_secs(3);

/// A replay cache on `here` whose entries never age out during a test, once `here`'s channel is
/// up; and the store's invalidations.
async fn listening_cache(here: &Arc<dyn Store>) -> (Arc<ReplayCache>, Arc<Invalidations>) {
    let config = ReplayCacheConfig {
        max_age: Duration::from_secs(3600),
        ..ReplayCacheConfig::DEFAULT
    };
    let cache = ReplayCache::for_store(here, config).expect("every store announces its deletes");
    let invalidations = here.invalidations().expect("the store's invalidations");
    eventually(Duration::from_secs(10), "the store's channel is up", || {
        invalidations.is_listening()
    })
    .await;
    // A first look-up starts the reads of the store's identity; the cache answers once one came.
    let _ = cache.lookup(&fresh_id(), UnixMillis::now());
    eventually(Duration::from_secs(10), "the store's identity is read", || {
        cache.knows_its_stores_identity()
    })
    .await;
    (cache, invalidations)
}

/// Completes `id` through `there` with `answer` (as of `now`, replayable for `ttl`), and keeps
/// the record `here` reads in `cache`, as `Protocol::begin` does; asserts it is kept.
async fn cache_an_answer(
    cache: &Arc<ReplayCache>,
    (here, there): (&dyn Store, &dyn Store),
    id: &RecordId,
    (now, ttl): (UnixMillis, Duration),
    answer: &[u8],
) {
    let fp = fingerprint("a");
    let token = acquire(there, id, &fp, now).await;
    there
        .complete(id, token, completion(answer, now, ttl, 7 * DAY))
        .await
        .expect("complete");
    let Lookup::Miss(generation) = cache.lookup(id, now) else {
        panic!("not kept yet");
    };
    let record = existing(begin(here, id, &fp, now).await.0);
    cache.keep(&record, now, generation);
    match cache.lookup(id, now) {
        Lookup::Hit(cached) => assert_eq!(stored_response(&cached).as_deref(), Some(answer)),
        Lookup::Miss(_) => panic!("the completed answer read from the store is kept"),
    }
}

/// A replay cache in one instance keeps an answer another instance stored, answers only before
/// its `expires_at` on the clock it is given, counts the replays it answers in the store, and
/// forgets the answer as soon as a third instance deletes the record: the store announces every
/// delete to every instance.
pub async fn replay_cache_forgets_what_any_instance_deletes(h: &impl Harness) {
    let (here, there, operator) = (h.open().await, h.open().await, h.open().await);
    let (cache, _) = listening_cache(&here).await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    cache_an_answer(&cache, (&*here, &*there), &id, (now, DAY), b"answer").await;

    // Replays answered from the cache are counted in the store, as the one `begin` answered.
    here.count_replay(&id);
    here.count_replay(&id);
    let mut replays = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while replays != 3 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        replays = the_record(there.get(&id).await, "record").replays;
    }
    assert_eq!(replays, 3, "the replays answered from the cache reach the store");

    // An answer past its expiry is never answered from the cache: the store decides.
    let (short, short_now, ttl) = (fresh_id(), UnixMillis::now(), Duration::from_secs(60));
    cache_an_answer(&cache, (&*here, &*there), &short, (short_now, ttl), b"short").await;
    assert!(matches!(
        cache.lookup(&short, short_now.plus(ttl - Duration::from_millis(1))),
        Lookup::Hit(_)
    ));
    assert!(
        matches!(cache.lookup(&short, short_now.plus(ttl)), Lookup::Miss(_)),
        "at its expires_at the answer is the store's to give"
    );

    the_record(operator.delete(&id).await, "the record was there");
    eventually(
        DELETE_REACHES_CACHES_WITHIN,
        "the delete reaches the other instance's cache",
        || matches!(cache.lookup(&id, now), Lookup::Miss(_)),
    )
    .await;
    assert!(
        matches!(
            begin(&*here, &id, &fp, now).await.0,
            Begin::Acquired { recovered: false }
        ),
        "the key is free again"
    );
}

/// A delete made while `here`'s notification channel is cut (by `cut`, which returns once it is)
/// is not missed by `here`'s replay cache: the cache answers nothing while the channel is down,
/// and it starts afresh once the channel is back, so the deleted answer is never replayed from
/// it. `there` is another instance on the same store. Each store's own tests cut its channel
/// their way (a killed pub/sub connection, a terminated `LISTEN` backend).
pub async fn a_delete_while_the_channel_is_down_is_not_missed<F>(here: Arc<dyn Store>, there: Arc<dyn Store>, cut: F)
where
    F: std::future::Future<Output = ()>,
{
    let (cache, invalidations) = listening_cache(&here).await;
    let (id, now) = (fresh_id(), UnixMillis::now());
    cache_an_answer(&cache, (&*here, &*there), &id, (now, DAY), b"answer").await;

    let resumptions = invalidations.resumptions();
    cut.await;
    there.delete(&id).await.expect("delete").expect("the record was there");
    // Whether or not the delete's announcement got through, the answer is gone from the cache
    // once the channel is back (it may be back already).
    eventually(Duration::from_secs(30), "the channel is up again", || {
        invalidations.resumptions() > resumptions && invalidations.is_listening()
    })
    .await;
    assert!(
        matches!(cache.lookup(&id, now), Lookup::Miss(_)),
        "the deleted answer survived the channel's outage in the cache"
    );
    // And the cache works again.
    cache_an_answer(
        &cache,
        (&*here, &*there),
        &fresh_id(),
        (UnixMillis::now(), DAY),
        b"again",
    )
    .await;
}
