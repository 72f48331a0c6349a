//! Retention: an answer expires to a tombstone and then to nothing; an unknown outcome and an
//! abandoned claim expire at their ttl and live until their `purge_at`; purge works in batches.
//! Some cases run on real time, since a store may expire records natively (Redis).

use std::time::Duration;

use super::Harness;
use super::helpers::{
    DAY, LEASE, acquire, answered, assert_claimed, begin, claim, completion, existing, fingerprint, fresh_id,
    sleep_until, stored_response, the_record,
};
use crate::UnixMillis;
use crate::store::{BeginRequest, FencingToken, RecordState, Release};

/// An unknown outcome is taken over by the same request only until its `expires_at`: past it the
/// key is expired (the record is returned unchanged, for a `key-expired` answer), as a completed
/// one is, until its `purge_at`.
pub async fn unknown_outcome_expires_at_its_ttl(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp) = (fresh_id(), fingerprint("a"));
    let base = UnixMillis::now().minus(DAY * 20);
    let token = acquire(&*store, &id, &fp, base).await;
    let (expires_at, purge_at) = (base.plus(Duration::from_secs(60)), base.plus(DAY));
    store
        .release(&id, token, Release::Unknown { expires_at, purge_at })
        .await
        .expect("release");
    for at in [expires_at, base.plus(Duration::from_secs(3600))] {
        let record = existing(begin(&*store, &id, &fp, at).await.0);
        assert!(
            matches!(record.state, RecordState::Unknown { expires_at: e, purge_at: p } if e == expires_at && p == purge_at),
            "past its ttl an unknown outcome is not taken over: {record:?}"
        );
    }
    let (taken, _) = begin(&*store, &id, &fp, base.plus(Duration::from_secs(59))).await;
    assert_claimed(&taken, true, "within its ttl it is");
}

/// A claim whose holder vanished (its lease ended) is taken over only until the claim's
/// `expires_at`; past it the record is returned unchanged, in flight, until its `purge_at`.
pub async fn abandoned_claim_expires_at_its_ttl(h: &impl Harness) {
    let store = h.open().await;
    let fp = fingerprint("a");
    let base = UnixMillis::now().minus(DAY * 21);
    let claim_with_ttl = |id, ttl| BeginRequest {
        expires_at: base.plus(ttl),
        purge_at: base.plus(DAY),
        ..claim(id, &fp, base, FencingToken::random())
    };
    let (expired, live) = (fresh_id(), fresh_id());
    for (id, ttl) in [(&expired, LEASE * 2), (&live, LEASE * 10)] {
        let begun = store.begin(claim_with_ttl(id, ttl)).await.expect("begin");
        assert_claimed(&begun, false, "a new key");
    }
    let later = base.plus(LEASE * 5);
    let record = existing(begin(&*store, &expired, &fp, later).await.0);
    assert!(
        matches!(record.state, RecordState::InFlight { expires_at: Some(e), lease_until, .. }
            if e == base.plus(LEASE * 2) && lease_until == base.plus(LEASE)),
        "past its ttl an abandoned claim is not taken over: {record:?}"
    );
    let (taken, _) = begin(&*store, &live, &fp, later).await;
    assert_claimed(&taken, true, "within its ttl it is");
}

/// Retention keeps an unknown outcome and an abandoned claim until their `purge_at`, not their
/// `expires_at`, and never deletes a claim whose lease still runs; past `purge_at` they are gone
/// and the key is new.
///
/// On real time, as [`expiry_leaves_a_tombstone`] (a store may expire records natively).
pub async fn purge_keeps_unanswered_keys_until_purge_at(h: &impl Harness) {
    let store = h.open().await;
    let fp = fingerprint("a");
    let keep = Duration::from_millis(1500);
    let start = UnixMillis::now();
    let (unknown, abandoned, running) = (fresh_id(), fresh_id(), fresh_id());

    let token = acquire(&*store, &unknown, &fp, start).await;
    let released = UnixMillis::now();
    let release = Release::Unknown {
        expires_at: released,
        purge_at: released.plus(keep),
    };
    store.release(&unknown, token, release).await.expect("release");
    // Claimed two minutes ago: its lease and its ttl have ended, its purge_at has not.
    let then = start.minus(LEASE * 2);
    let begun = store
        .begin(BeginRequest {
            expires_at: then.plus(LEASE),
            purge_at: start.plus(keep),
            ..claim(&abandoned, &fp, then, FencingToken::random())
        })
        .await
        .expect("begin");
    assert_claimed(&begun, false, "a new key");
    // A claim whose ttl and purge_at are shorter than its lease (a handler still running).
    let begun = store
        .begin(BeginRequest {
            expires_at: start.plus(keep / 4),
            purge_at: start.plus(keep / 2),
            ..claim(&running, &fp, start, FencingToken::random())
        })
        .await
        .expect("begin");
    assert_claimed(&begun, false, "a new key");

    store.purge(UnixMillis::now(), 1000).await.expect("purge");
    for id in [&unknown, &abandoned, &running] {
        assert!(
            store.get(id).await.expect("get").is_some(),
            "kept until purge_at, past expires_at"
        );
    }
    sleep_until(start.plus(keep + Duration::from_millis(300))).await;
    store.purge(UnixMillis::now(), 1000).await.expect("purge");
    for id in [&unknown, &abandoned] {
        assert!(store.get(id).await.expect("get").is_none(), "deleted at purge_at");
        let (begun, _) = begin(&*store, id, &fp, UnixMillis::now()).await;
        assert_claimed(&begun, false, "a purged key is new");
    }
    let record = the_record(
        store.get(&running).await,
        "a claim whose lease runs is kept past its purge_at",
    );
    assert!(matches!(record.state, RecordState::InFlight { .. }), "{record:?}");
    let still = existing(begin(&*store, &running, &fp, UnixMillis::now()).await.0);
    assert!(
        matches!(still.state, RecordState::InFlight { .. }),
        "and not claimed anew"
    );
}

/// Past `expires_at` the answer is reported as expired; once that time has really passed, purge
/// leaves a tombstone (the answer is gone, the fingerprint stays) until `purge_at`, after which the
/// record is gone and the key is free.
///
/// Retention runs on real time here: a store may expire records natively (Redis), so the times
/// must really pass. The durations are short.
pub async fn expiry_leaves_a_tombstone(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp) = (fresh_id(), fingerprint("a"));
    let token = acquire(&*store, &id, &fp, UnixMillis::now()).await;
    let (ttl, keep) = (Duration::from_millis(800), Duration::from_millis(2500));
    // A store may count native expiry from when its write runs, so `start` is taken just before.
    let start = UnixMillis::now();
    store
        .complete(&id, token, completion(b"old answer", start, ttl, keep))
        .await
        .expect("complete");
    let written = UnixMillis::now();
    let after_ttl = start.plus(Duration::from_millis(1000));
    let record = existing(begin(&*store, &id, &fp, after_ttl).await.0);
    assert!(matches!(record.state, RecordState::Completed { expires_at, .. } if expires_at <= after_ttl));
    assert_eq!(
        the_record(store.get(&id).await, "record").replays,
        0,
        "an expired answer is no replay"
    );

    sleep_until(written.plus(ttl + Duration::from_millis(300))).await;
    store.purge(UnixMillis::now(), 1000).await.expect("purge");
    let tombstone = the_record(store.get(&id).await, "a tombstone remains after the ttl");
    assert_eq!(stored_response(&tombstone), None, "the expired answer is dropped");
    assert_eq!(tombstone.fingerprint, fp, "the tombstone keeps the fingerprint");
    let record = existing(begin(&*store, &id, &fp, UnixMillis::now()).await.0);
    assert!(
        matches!(record.state, RecordState::Completed { response: None, .. }),
        "a tombstone is not claimable"
    );

    sleep_until(written.plus(keep + Duration::from_millis(300))).await;
    store.purge(UnixMillis::now(), 1000).await.expect("purge");
    assert!(
        store.get(&id).await.expect("get").is_none(),
        "the tombstone is deleted at purge_at"
    );
    let (begun, _) = begin(&*store, &id, &fp, UnixMillis::now()).await;
    assert_claimed(&begun, false, "a purged key is new");
}

/// A record past `purge_at` is claimable even before purge runs.
pub async fn purge_time_frees_the_key_without_purge(h: &impl Harness) {
    let store = h.open().await;
    let base = UnixMillis::now().minus(DAY * 40);
    let (id, fp) = (fresh_id(), fingerprint("a"));
    let token = acquire(&*store, &id, &fp, base).await;
    store
        .complete(
            &id,
            token,
            completion(b"x", base, Duration::from_secs(1), Duration::from_secs(2)),
        )
        .await
        .expect("complete");
    let later = base.plus(Duration::from_secs(3));
    let (begun, _) = begin(&*store, &id, &fingerprint("new"), later).await;
    assert_claimed(&begun, false, "a key past its purge_at is new, before any purge");
}

/// Purge never does more than a batch at a time, finishes, and removes every record past its
/// `purge_at` while leaving live records alone. (A store that expires records natively may find
/// nothing left to do.)
pub async fn purge_in_batches(h: &impl Harness) {
    let store = h.open().await;
    let fp = fingerprint("a");
    let keep = Duration::from_millis(1000);
    let mut ids = Vec::new();
    for _ in 0..25 {
        let id = fresh_id();
        let token = acquire(&*store, &id, &fp, UnixMillis::now()).await;
        // A store may count native expiry from when its write runs: each record gets its own time.
        let at = UnixMillis::now();
        store
            .complete(&id, token, completion(b"x", at, keep / 2, keep))
            .await
            .expect("complete");
        ids.push(id);
    }
    let written = UnixMillis::now();
    let live = fresh_id();
    answered(&*store, &live, &fp, written, b"x").await;

    sleep_until(written.plus(keep + Duration::from_millis(300))).await;
    let now = UnixMillis::now();
    let mut rounds = 0;
    loop {
        let purged = store.purge(now, 10).await.expect("purge");
        assert!(
            purged.deleted <= 10 && purged.tombstoned <= 10,
            "a batch stays within its size: {purged:?}"
        );
        if purged.deleted == 0 {
            break;
        }
        rounds += 1;
        assert!(rounds < 100, "purge does not terminate");
    }
    for id in &ids {
        assert!(
            store.get(id).await.expect("get").is_none(),
            "every due record is purged"
        );
    }
    assert!(
        store.get(&live).await.expect("get").is_some(),
        "a live record survives purge"
    );
}
