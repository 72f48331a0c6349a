//! Claims: a new key is claimed once however many ask at once, completed and replayed, fenced
//! by its token, renewed, released, taken over by the same request only (an in-transaction claim
//! unflagged), and the claim tells where it stands.

use std::sync::Arc;
use std::time::Duration;

use super::Harness;
use super::helpers::{
    DAY, LEASE, acquire, answered, assert_claimed, assert_fenced, begin, claim, completion, existing, fingerprint,
    fresh_id, in_flight_token, step, stored_response, taken_over_by_the_same_request_only, the_record, unknown_at,
    unknown_outcome,
};
use crate::store::{Begin, ClaimState, FencingToken, RecordId, RecordState, Release};
use crate::{StoreError, UnixMillis};

/// A new key is claimed; a second begin sees the claim and its token.
pub async fn claims_a_new_key(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    assert!(store.get(&id).await.expect("get").is_none());
    let token = acquire(&*store, &id, &fp, now).await;
    let record = existing(begin(&*store, &id, &fp, now).await.0);
    assert_eq!(in_flight_token(&record), token);
    assert_eq!(
        record.fingerprint, fp,
        "the record keeps the fingerprint with method and path"
    );
    assert_eq!(record.id, id);
    let read = the_record(store.get(&id).await, "the record exists");
    assert_eq!(in_flight_token(&read), token);
}

/// Fifty simultaneous begins of one key, over two handles: exactly one claim.
pub async fn one_claim_under_concurrency(h: &impl Harness) {
    let stores = [h.open().await, h.open().await];
    let (id, fp, now) = (fresh_id(), fingerprint("race"), UnixMillis::now());
    let barrier = Arc::new(tokio::sync::Barrier::new(50));
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let (store, id, fp, barrier) = (stores[i % 2].clone(), id.clone(), fp.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                begin(&*store, &id, &fp, now).await
            })
        })
        .collect();
    let mut winners = Vec::new();
    let mut seen = Vec::new();
    for task in tasks {
        match task.await.expect("task") {
            (Begin::Acquired { .. }, token) => winners.push(token),
            (Begin::Existing(record), _) => seen.push(in_flight_token(&record)),
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "exactly one of 50 concurrent begins may claim the key"
    );
    assert!(
        seen.iter().all(|t| *t == winners[0]),
        "every loser sees the winner's claim"
    );
}

/// A completed record is returned whole, and each matching begin counts a replay.
pub async fn completes_and_replays(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    answered(&*store, &id, &fp, now, b"stored answer").await;
    for replays in 1..=2 {
        let record = existing(begin(&*store, &id, &fp, now).await.0);
        assert_eq!(stored_response(&record).as_deref(), Some(b"stored answer".as_slice()));
        let read = the_record(store.get(&id).await, "record");
        assert_eq!(read.replays, replays);
    }
    let other = existing(begin(&*store, &id, &fingerprint("b"), now).await.0);
    assert_eq!(other.fingerprint, fp, "a mismatch sees the original fingerprint");
    assert_eq!(
        the_record(store.get(&id).await, "record").replays,
        2,
        "a mismatch is not a replay"
    );
}

/// Only the current token completes, releases, renews or records a step: neither a token that
/// never claimed the key nor the holder whose lease was taken over.
pub async fn fencing(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let first = acquire(&*store, &id, &fp, now).await;
    assert_fenced(
        &*store,
        &id,
        FencingToken::random(),
        now,
        "a token that never claimed the key",
    )
    .await;

    let later = now.plus(LEASE + Duration::from_secs(1));
    let (taken, second) = begin(&*store, &id, &fp, later).await;
    assert_claimed(&taken, true, "an expired lease is taken over");
    assert_fenced(&*store, &id, first, later, "the holder whose lease was taken over").await;
    store
        .complete(&id, second, completion(b"second", later, DAY, 7 * DAY))
        .await
        .expect("new holder completes");
    assert!(
        matches!(
            store.complete(&id, second, completion(b"x", later, DAY, 7 * DAY)).await,
            Err(StoreError::Fenced)
        ),
        "completion is final"
    );
    let record = existing(begin(&*store, &id, &fp, later).await.0);
    assert_eq!(stored_response(&record).as_deref(), Some(b"second".as_slice()));
}

/// An expired lease is taken over only by the same request.
pub async fn takeover_needs_the_same_fingerprint(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let token = acquire(&*store, &id, &fp, now).await;
    let later = now.plus(LEASE * 2);
    let record = existing(begin(&*store, &id, &fingerprint("other"), later).await.0);
    assert_eq!(
        in_flight_token(&record),
        token,
        "a different request does not take over"
    );
    let (begun, _) = begin(&*store, &id, &fp, later).await;
    assert_claimed(&begun, true, "the same request takes the lease over");
}

/// A renewed lease is not taken over.
pub async fn renewal_keeps_the_claim(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let token = acquire(&*store, &id, &fp, now).await;
    store.renew(&id, token, now.plus(LEASE * 3)).await.expect("renew");
    let record = existing(begin(&*store, &id, &fp, now.plus(LEASE * 2)).await.0);
    assert_eq!(in_flight_token(&record), token, "a renewed claim stays with its holder");
    let RecordState::InFlight { lease_until, .. } = record.state else {
        unreachable!()
    };
    assert_eq!(lease_until, now.plus(LEASE * 3));
    let (begun, _) = begin(&*store, &id, &fp, now.plus(LEASE * 4)).await;
    assert_claimed(&begun, true, "the ended lease is taken over");
}

/// Forget frees the key; unknown keeps it so that the next run is recovered.
pub async fn release_forgets_or_remembers(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let token = acquire(&*store, &id, &fp, now).await;
    store.release(&id, token, Release::Forget).await.expect("release");
    assert!(
        store.get(&id).await.expect("get").is_none(),
        "a forgotten record is gone"
    );
    unknown_outcome(&*store, &id, &fp, now).await;
    let record = the_record(store.get(&id).await, "an unknown outcome is remembered");
    assert!(matches!(record.state, RecordState::Unknown { .. }), "{record:?}");
    taken_over_by_the_same_request_only(&*store, &id, &fp, now, "a released unknown outcome").await;
}

/// A claim can tell where it stands: current while in flight under it, completed once the record
/// was completed under it (whoever wrote the answer), ended otherwise.
pub async fn claim_state_follows_the_claim(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now, other) = (fresh_id(), fingerprint("a"), UnixMillis::now(), FencingToken::random());
    // Where the claim of `token` stands on `id`, and where another token's does.
    let stand = async |id: &RecordId, token: FencingToken| {
        let mut states = Vec::new();
        for token in [token, other] {
            states.push(store.claim_state(id, token).await.expect("claim_state"));
        }
        states
    };
    use ClaimState::{Completed, Current, Ended};
    assert_eq!(stand(&id, FencingToken::random()).await, [Ended, Ended], "no record");
    let token = acquire(&*store, &id, &fp, now).await;
    assert_eq!(stand(&id, token).await, [Current, Ended], "in flight");
    store
        .complete(&id, token, completion(b"ok", now, DAY, DAY))
        .await
        .expect("complete");
    assert_eq!(stand(&id, token).await, [Completed, Ended], "completed");

    let id = fresh_id();
    let token = acquire(&*store, &id, &fp, now).await;
    store.release(&id, token, unknown_at(now)).await.expect("release");
    assert_eq!(stand(&id, token).await, [Ended, Ended], "released as unknown");
}

/// An in-transaction claim (its token says so) whose holder died did not complete, so its
/// transaction never committed: the run that takes it over is a new one, unflagged, unless it
/// recorded checkpoints. A recovered run's claim, and any other claim, recover as before, and a
/// recovered claim holds its token [`for_run`](FencingToken::for_run)`(true)`. Only for a store
/// that completes in transactions: no other is handed such tokens.
pub async fn an_in_transaction_claim_that_died_is_taken_over_unflagged(h: &impl Harness) {
    let store = h.open().await;
    if !store.completes_in_transactions() {
        return;
    }
    let fp = fingerprint("a");
    let then = UnixMillis(UnixMillis::now().0 - 120_000);
    let now = UnixMillis::now();
    let take_over = async |id: &RecordId| {
        let token = FencingToken::random_in_transaction();
        match store.begin(claim(id, &fp, now, token)).await.expect("begin") {
            Begin::Acquired { recovered } => (recovered, token.for_run(recovered)),
            other => panic!("expected a takeover, got {other:?}"),
        }
    };
    let crashed_at = async |id: &RecordId, token: FencingToken| match store.begin(claim(id, &fp, then, token)).await {
        Ok(Begin::Acquired { recovered: false }) => token,
        other => panic!("expected a new claim, got {other:?}"),
    };

    // Died before its commit: nothing stands, the next run is new.
    let id = fresh_id();
    crashed_at(&id, FencingToken::random_in_transaction()).await;
    let (recovered, token) = take_over(&id).await;
    assert!(!recovered, "an in-transaction claim that died left nothing behind");
    assert!(token.in_transaction(), "and its successor's token says the same of it");
    store
        .renew(&id, token, now.plus(LEASE))
        .await
        .expect("the new claim holds its token");

    // It recorded a step: that stands, the next run recovers, and its claim loses the mark.
    let id = fresh_id();
    let stepped = crashed_at(&id, FencingToken::random_in_transaction()).await;
    store
        .checkpoint(&id, stepped, step("charged", "ch_1"))
        .await
        .expect("checkpoint");
    let (recovered, token) = take_over(&id).await;
    assert!(recovered, "a recorded step stands");
    assert!(!token.in_transaction());
    store
        .renew(&id, token, now.plus(LEASE))
        .await
        .expect("the claim holds the recovered run's token");
    assert_eq!(
        store.claim_state(&id, token).await.expect("claim_state"),
        ClaimState::Current
    );

    // A recovered run dies in turn: whatever its predecessor did may still stand.
    let id = fresh_id();
    let long_ago = UnixMillis(then.0 - 120_000);
    let first = store
        .begin(claim(&id, &fp, long_ago, FencingToken::random()))
        .await
        .expect("begin");
    assert_claimed(&first, false, "a new key");
    let recovered_token = FencingToken::random_in_transaction();
    let first = store
        .begin(claim(&id, &fp, then, recovered_token))
        .await
        .expect("begin");
    assert_claimed(&first, true, "an ordinary claim's successor recovers");
    let (recovered, _) = take_over(&id).await;
    assert!(
        recovered,
        "the successor of a recovered in-transaction run recovers too"
    );

    // Released as unknown: recovered, whatever the claim was.
    let id = fresh_id();
    let released = crashed_at(&id, FencingToken::random_in_transaction()).await;
    store.release(&id, released, unknown_at(then)).await.expect("release");
    let (recovered, _) = take_over(&id).await;
    assert!(recovered, "an unknown outcome is recovered");
}
