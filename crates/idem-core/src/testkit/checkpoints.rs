//! Checkpoints: written under the current claim only, read back in order, kept for the run that
//! takes a claim over or follows an unknown outcome, and gone with the run.

use std::time::Duration;

use bytes::Bytes;

use super::Harness;
use super::helpers::{DAY, acquire, assert_claimed, begin, completion, fingerprint, fresh_id, step, unknown_at};
use crate::store::{Begin, Checkpoint, FencingToken, Release};
use crate::{StoreError, UnixMillis};

/// Checkpoints are written under the current claim only, replace one of the same name, and read
/// back in the order they were first written.
pub async fn checkpoints_belong_to_the_current_claim(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    assert!(
        store.checkpoints(&id).await.expect("checkpoints").is_empty(),
        "no record, none"
    );
    let stranger = FencingToken::random();
    assert!(
        matches!(
            store.checkpoint(&id, stranger, step("x", "1")).await,
            Err(StoreError::Fenced)
        ),
        "no record: nobody holds a claim to write under"
    );
    let token = acquire(&*store, &id, &fp, now).await;
    assert!(
        store.checkpoints(&id).await.expect("checkpoints").is_empty(),
        "a new claim has none"
    );
    store
        .checkpoint(&id, token, step("reserved", "order 7"))
        .await
        .expect("checkpoint");
    store
        .checkpoint(&id, token, step("charged", "ch_1"))
        .await
        .expect("checkpoint");
    store
        .checkpoint(&id, token, step("reserved", "order 8"))
        .await
        .expect("checkpoint");
    let other = h.open().await;
    assert_eq!(
        other.checkpoints(&id).await.expect("checkpoints"),
        vec![step("reserved", "order 8"), step("charged", "ch_1")],
        "every instance reads them; a name written again keeps its place with the new value"
    );
    assert!(
        matches!(
            other.checkpoint(&id, stranger, step("charged", "ch_2")).await,
            Err(StoreError::Fenced)
        ),
        "another token cannot write"
    );
    let big = Checkpoint {
        name: "receipt".to_owned(),
        value: Bytes::from(vec![0u8; 64 * 1024]),
    };
    store.checkpoint(&id, token, big.clone()).await.expect("a 64 KiB value");
    assert_eq!(
        store.checkpoints(&id).await.expect("checkpoints")[2],
        big,
        "binary values round-trip"
    );
}

/// A takeover sees the checkpoints of the run before it, and the old holder is fenced from
/// writing more; a release as unknown keeps them for the next run; completing, forgetting and
/// deleting drop them.
pub async fn checkpoints_survive_a_takeover_and_end_with_the_run(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp) = (fresh_id(), fingerprint("a"));
    // A claim from two minutes ago, whose lease has ended: its holder crashed after one step.
    let then = UnixMillis(UnixMillis::now().0 - 120_000);
    let crashed = acquire(&*store, &id, &fp, then).await;
    store
        .checkpoint(&id, crashed, step("charged", "ch_1"))
        .await
        .expect("checkpoint");
    let (taken, token) = begin(&*store, &id, &fp, UnixMillis::now()).await;
    assert_claimed(&taken, true, "the crashed claim is taken over");
    assert_eq!(
        store.checkpoints(&id).await.expect("checkpoints"),
        vec![step("charged", "ch_1")]
    );
    assert!(
        matches!(
            store.checkpoint(&id, crashed, step("late", "x")).await,
            Err(StoreError::Fenced)
        ),
        "the crashed holder is fenced"
    );
    store
        .checkpoint(&id, token, step("receipt", "sent"))
        .await
        .expect("checkpoint");

    // Released as unknown: the next run resumes from both.
    let now = UnixMillis::now();
    store.release(&id, token, unknown_at(now)).await.expect("release");
    assert_eq!(store.checkpoints(&id).await.expect("checkpoints").len(), 2);
    let (again, token) = begin(&*store, &id, &fp, now).await;
    assert_claimed(&again, true, "an unknown outcome is taken over");
    assert_eq!(
        store.checkpoints(&id).await.expect("checkpoints"),
        vec![step("charged", "ch_1"), step("receipt", "sent")]
    );

    // Completed: the run is over, and so are its checkpoints.
    store
        .complete(&id, token, completion(b"ok", now, DAY, DAY))
        .await
        .expect("complete");
    assert!(
        store.checkpoints(&id).await.expect("checkpoints").is_empty(),
        "gone on completion"
    );

    // Forgotten, and deleted: gone with the run (a deleted claim leaves the key unknown, so the
    // next run is a recovered one, without checkpoints).
    for end in ["forget", "delete"] {
        let id = fresh_id();
        let token = acquire(&*store, &id, &fp, now).await;
        store
            .checkpoint(&id, token, step("charged", "ch_9"))
            .await
            .expect("checkpoint");
        match end {
            "forget" => store.release(&id, token, Release::Forget).await.expect("release"),
            _ => drop(store.delete(&id).await.expect("delete")),
        }
        assert!(
            store.checkpoints(&id).await.expect("checkpoints").is_empty(),
            "gone on {end}"
        );
        let (again, _) = begin(&*store, &id, &fp, now).await;
        assert!(matches!(again, Begin::Acquired { .. }), "{again:?}");
        assert!(
            store.checkpoints(&id).await.expect("checkpoints").is_empty(),
            "a new claim after {end}"
        );
    }
}

/// A record past its `purge_at` is a new claim, and its checkpoints are not the new run's.
pub async fn a_new_claim_never_sees_old_checkpoints(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp) = (fresh_id(), fingerprint("a"));
    let now = UnixMillis::now();
    let old = UnixMillis(now.0 - 10 * DAY.as_millis() as u64);
    let token = acquire(&*store, &id, &fp, old).await;
    store
        .checkpoint(&id, token, step("charged", "ch_old"))
        .await
        .expect("checkpoint");
    let unknown = Release::Unknown {
        expires_at: old.plus(Duration::from_secs(60)),
        purge_at: old.plus(Duration::from_secs(60)),
    };
    store.release(&id, token, unknown).await.expect("release");
    // The record is past its purge time (purge has not run): the key is new again.
    let (fresh, _) = begin(&*store, &id, &fp, now).await;
    assert_claimed(&fresh, false, "a record past its purge_at is a new key");
    assert!(
        store.checkpoints(&id).await.expect("checkpoints").is_empty(),
        "a new claim starts with no checkpoints"
    );
}
