//! An operator's delete: it fences an in-flight claim's holder and leaves its key unknown, frees
//! a key in every other state, and finds nothing where there is nothing.

use std::time::Duration;

use bytes::Bytes;

use super::Harness;
use super::helpers::{
    DAY, acquire, answered, assert_claimed, assert_fenced, begin, completion, existing, fingerprint, fresh_id,
    in_flight_token, step, stored_response, taken_over_by_the_same_request_only, the_record, unknown_outcome,
};
use crate::store::{Completion, Record, RecordId, RecordState};
use crate::{Scope, StoreError, UnixMillis};

/// Deleting an in-flight record returns it, fences its holder and leaves the key unknown (the run
/// may have had effects): the old token can no longer complete, release, renew or checkpoint, the
/// run's checkpoints are gone, and the same request then runs again marked recovered, another
/// request not at all. Deleting the unknown record then frees the key.
pub async fn delete_fences_the_holder(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let token = acquire(&*store, &id, &fp, now).await;
    store
        .checkpoint(&id, token, step("charged", "ch_1"))
        .await
        .expect("checkpoint");
    let deleted = the_record(store.delete(&id).await, "delete returns the in-flight record");
    assert_eq!(deleted.id, id);
    assert_eq!(deleted.fingerprint, fp, "the deleted record keeps its fingerprint");
    assert_eq!(in_flight_token(&deleted), token, "the claim that was deleted");
    let unknown_after_delete = |record: Option<Record>, what: &str| {
        let record = record.unwrap_or_else(|| panic!("{what}: the key is left unknown, not freed"));
        assert!(
            matches!(record.state, RecordState::Unknown { expires_at, purge_at }
                if expires_at == now.plus(DAY) && purge_at == now.plus(7 * DAY)),
            "{what}: unknown, with the claim's expires_at and purge_at: {record:?}"
        );
        assert_eq!(record.fingerprint, fp);
    };
    unknown_after_delete(store.get(&id).await.expect("get"), "after delete");
    assert_fenced(&*store, &id, token, now, "the holder of a deleted claim").await;
    unknown_after_delete(store.get(&id).await.expect("get"), "after the fenced holder's attempts");
    assert!(
        store.checkpoints(&id).await.expect("checkpoints").is_empty(),
        "delete drops the run's checkpoints"
    );
    let new_token = taken_over_by_the_same_request_only(&*store, &id, &fp, now, "a deleted claim").await;
    assert!(
        matches!(
            store.complete(&id, token, completion(b"x", now, DAY, 7 * DAY)).await,
            Err(StoreError::Fenced)
        ),
        "the old holder is not the new claim's holder"
    );
    let record = the_record(store.get(&id).await, "the new claim");
    assert_eq!(in_flight_token(&record), new_token);

    // Deleted again while in flight, then once more as unknown: the key is free.
    store.delete(&id).await.expect("delete").expect("the new claim");
    let deleted = store.delete(&id).await.expect("delete").expect("the unknown record");
    assert!(matches!(deleted.state, RecordState::Unknown { .. }), "{deleted:?}");
    assert!(
        store.get(&id).await.expect("get").is_none(),
        "a deleted unknown record is gone"
    );
    let (begun, _) = begin(&*store, &id, &fingerprint("other request"), now).await;
    assert_claimed(&begun, false, "a deleted unknown record frees the key");
}

/// Deleting a completed record, a tombstone or an unknown outcome returns it as it was and frees
/// the key: the same request then runs again as new (neither replayed, nor `key-expired`, nor
/// recovered).
pub async fn delete_frees_the_key_in_every_state(h: &impl Harness) {
    let store = h.open().await;
    let (fp, now) = (fingerprint("a"), UnixMillis::now());

    let completed = fresh_id();
    answered(&*store, &completed, &fp, now, b"stored answer").await;
    existing(begin(&*store, &completed, &fp, now).await.0);
    let deleted = the_record(store.delete(&completed).await, "delete returns the completed record");
    assert_eq!(deleted.id, completed);
    assert_eq!(deleted.fingerprint, fp);
    assert_eq!(deleted.replays, 1, "the deleted record's replays");
    assert_eq!(stored_response(&deleted).as_deref(), Some(b"stored answer".as_slice()));

    // A tombstone: the answer expired (a second ago) and was dropped, the record stays.
    let tombstone = fresh_id();
    let token = acquire(&*store, &tombstone, &fp, now).await;
    let written = UnixMillis::now();
    let expired = Completion {
        response: Bytes::from_static(b"old answer"),
        status: 201,
        completed_at: written.minus(Duration::from_secs(2)),
        expires_at: written.minus(Duration::from_secs(1)),
        purge_at: written.plus(DAY),
    };
    store.complete(&tombstone, token, expired).await.expect("complete");
    // Other cases' records may be due too, and another purger may hold the work for a moment:
    // purge until this one's answer is dropped.
    for attempt in 0.. {
        let record = the_record(store.get(&tombstone).await, "the record");
        if stored_response(&record).is_none() {
            break;
        }
        assert!(attempt < 100, "purge never dropped the expired answer");
        store.purge(UnixMillis::now(), 1000).await.expect("purge");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let deleted = the_record(store.delete(&tombstone).await, "delete returns the tombstone");
    assert_eq!(stored_response(&deleted), None, "a tombstone, as it was");
    assert_eq!(deleted.fingerprint, fp);

    let unknown = fresh_id();
    unknown_outcome(&*store, &unknown, &fp, now).await;
    let deleted = the_record(store.delete(&unknown).await, "delete returns the unknown outcome");
    assert!(matches!(deleted.state, RecordState::Unknown { .. }), "{deleted:?}");

    for id in [&completed, &tombstone, &unknown] {
        assert!(store.get(id).await.expect("get").is_none(), "a deleted record is gone");
        let (claimed, _) = begin(&*store, id, &fp, UnixMillis::now()).await;
        assert_claimed(&claimed, false, "the same request runs again as new");
    }
}

/// Deleting a key that has no record returns `None`, and deleting twice finds nothing the second
/// time; neither touches a record of the same key in another scope.
pub async fn delete_of_a_missing_key_is_none(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    assert!(store.delete(&id).await.expect("delete").is_none());
    let other_scope = RecordId {
        scope: Scope::application(uuid::Uuid::new_v4().to_string()),
        key: id.key.clone(),
    };
    let token = acquire(&*store, &other_scope, &fp, now).await;
    answered(&*store, &id, &fp, now, b"x").await;
    assert!(store.delete(&id).await.expect("delete").is_some());
    assert!(
        store.delete(&id).await.expect("delete").is_none(),
        "a second delete finds nothing"
    );
    let kept = the_record(
        store.get(&other_scope).await,
        "the same key in another scope is untouched",
    );
    assert_eq!(in_flight_token(&kept), token);
}
