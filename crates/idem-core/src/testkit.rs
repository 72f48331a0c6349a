//! The conformance suite every [`Store`] must pass, written once and run by each store crate
//! against a real server with [`conformance_tests!`](crate::conformance_tests).
//!
//! Every case works in its own random scope and keeps its fake times either near the present or in
//! its own stretch of the past, so that cases can share one database and run at the same time.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{HeaderMap, Method};

use crate::replay_cache::{Lookup, ReplayCache, ReplayCacheConfig};
use crate::store::Invalidations;
use crate::store::{Observed, Observer, StoreOperation};
use crate::{
    Fingerprint, IdempotencyKey, Scope, Store, StoreError, UnixMillis,
    store::{
        Begin, BeginRequest, Checkpoint, ClaimState, Completion, FencingToken, ListQuery, Listed, ListedState, Origin,
        Record, RecordId, RecordState, Release, ScopeSalt, StoreIdentity, WaitOutcome,
    },
};

/// Opens handles on the store under test.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// Opens a new handle (a new connection or pool) on the same backing store, as another
    /// instance of a service would. Panics with a message saying how to start the server when it
    /// cannot connect.
    async fn open(&self) -> Arc<dyn Store>;

    /// Makes the store lose every record and its salt under the handles already open, as a store
    /// restarted without persistence, flushed, failed over to an empty node or whose schema was
    /// dropped and migrated anew does.
    async fn lose_data(&self);
}

/// The lease of every claim the helpers below make.
pub const LEASE: Duration = Duration::from_secs(60);
/// A day, the ttl of every record the helpers below make (their tombstones last a week).
pub const DAY: Duration = Duration::from_secs(24 * 3600);

/// A fresh record id in a scope of its own.
pub fn fresh_id() -> RecordId {
    RecordId {
        scope: Scope::application(uuid::Uuid::new_v4().to_string()),
        key: IdempotencyKey::new(&uuid::Uuid::now_v7().to_string()).expect("a UUID is a valid key"),
    }
}

/// The fingerprint of `POST /pay` with `body`.
pub fn fingerprint(body: &str) -> Fingerprint {
    Fingerprint::of(
        &Method::POST,
        &"/pay".parse().expect("static URI"),
        &HeaderMap::new(),
        body.as_bytes(),
    )
}

/// Begins `id` at `now` with a fresh token ([`claim`]); returns what the store decided and the token.
///
/// # Panics
/// If the store fails.
pub async fn begin(store: &dyn Store, id: &RecordId, fp: &Fingerprint, now: UnixMillis) -> (Begin, FencingToken) {
    let token = FencingToken::random();
    (store.begin(claim(id, fp, now, token)).await.expect("begin"), token)
}

/// A claim at `now` under the default lease, with a ttl of a day and a tombstone of a week.
pub fn claim<'a>(id: &'a RecordId, fp: &'a Fingerprint, now: UnixMillis, token: FencingToken) -> BeginRequest<'a> {
    BeginRequest {
        id,
        fingerprint: fp,
        now,
        lease_until: now.plus(LEASE),
        expires_at: now.plus(DAY),
        purge_at: now.plus(7 * DAY),
        token,
        origin: origin(),
        identity: None,
    }
}

/// The origin the suite's claims carry: `POST /payments`, no trace.
pub fn origin() -> &'static Origin {
    static ORIGIN: std::sync::LazyLock<Origin> = std::sync::LazyLock::new(|| Origin::new("POST", "/payments", None));
    &ORIGIN
}

/// An unknown outcome released at `now`, with a ttl of a day and a tombstone of a week.
pub fn unknown_at(now: UnixMillis) -> Release {
    Release::Unknown {
        expires_at: now.plus(DAY),
        purge_at: now.plus(7 * DAY),
    }
}

/// Claims a new key at `now` and returns the claim's token.
///
/// # Panics
/// If the store does not hand out a new (not recovered) claim.
pub async fn acquire(store: &dyn Store, id: &RecordId, fp: &Fingerprint, now: UnixMillis) -> FencingToken {
    match begin(store, id, fp, now).await {
        (Begin::Acquired { recovered: false }, token) => token,
        (other, _) => panic!("expected a new claim, got {other:?}"),
    }
}

/// The completion of a claim at `at` with `body` as the stored answer, kept `ttl` and its tombstone
/// until `tombstone` after `at`.
pub fn completion(body: &[u8], at: UnixMillis, ttl: Duration, tombstone: Duration) -> Completion {
    Completion {
        response: Bytes::copy_from_slice(body),
        status: 201,
        completed_at: at,
        expires_at: at.plus(ttl),
        purge_at: at.plus(tombstone),
    }
}

/// The record a begin found.
///
/// # Panics
/// If the begin handed out a claim instead.
pub fn existing(result: Begin) -> Record {
    match result {
        Begin::Existing(record) => record,
        Begin::Acquired { .. } => panic!("expected the existing record, but the store handed out a claim"),
    }
}

/// The token of an in-flight record.
///
/// # Panics
/// If the record is not in flight.
pub fn in_flight_token(record: &Record) -> FencingToken {
    match record.state {
        RecordState::InFlight { token, .. } => token,
        ref other => panic!("expected an in-flight record, got {other:?}"),
    }
}

/// The stored answer of a completed record.
///
/// # Panics
/// If the record is not completed.
pub fn stored_response(record: &Record) -> Option<Bytes> {
    match &record.state {
        RecordState::Completed { response, .. } => response.clone(),
        other => panic!("expected a completed record, got {other:?}"),
    }
}

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
    let read = store.get(&id).await.expect("get").expect("the record exists");
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
    let token = acquire(&*store, &id, &fp, now).await;
    store
        .complete(&id, token, completion(b"stored answer", now, DAY, 7 * DAY))
        .await
        .expect("complete");
    for replays in 1..=2 {
        let record = existing(begin(&*store, &id, &fp, now).await.0);
        assert_eq!(stored_response(&record).as_deref(), Some(b"stored answer".as_slice()));
        let read = store.get(&id).await.expect("get").expect("record");
        assert_eq!(read.replays, replays);
    }
    let other = existing(begin(&*store, &id, &fingerprint("b"), now).await.0);
    assert_eq!(other.fingerprint, fp, "a mismatch sees the original fingerprint");
    assert_eq!(
        store.get(&id).await.expect("get").expect("record").replays,
        2,
        "a mismatch is not a replay"
    );
}

/// Only the current token completes, releases or renews.
pub async fn fencing(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let first = acquire(&*store, &id, &fp, now).await;
    let stranger = FencingToken::random();
    let done = || completion(b"x", now, DAY, 7 * DAY);
    assert!(matches!(
        store.complete(&id, stranger, done()).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.release(&id, stranger, Release::Forget).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.renew(&id, stranger, now.plus(LEASE)).await,
        Err(StoreError::Fenced)
    ));

    let later = now.plus(LEASE + Duration::from_secs(1));
    let (taken, second) = begin(&*store, &id, &fp, later).await;
    assert!(
        matches!(taken, Begin::Acquired { recovered: true }),
        "an expired lease is taken over: {taken:?}"
    );
    assert!(
        matches!(store.complete(&id, first, done()).await, Err(StoreError::Fenced)),
        "the old holder is fenced"
    );
    assert!(matches!(
        store.release(&id, first, Release::Forget).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.renew(&id, first, later.plus(LEASE)).await,
        Err(StoreError::Fenced)
    ));
    store
        .complete(&id, second, completion(b"second", later, DAY, 7 * DAY))
        .await
        .expect("new holder completes");
    assert!(
        matches!(store.complete(&id, second, done()).await, Err(StoreError::Fenced)),
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
    assert!(matches!(
        begin(&*store, &id, &fp, later).await.0,
        Begin::Acquired { recovered: true }
    ));
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
    assert!(matches!(
        begin(&*store, &id, &fp, now.plus(LEASE * 4)).await.0,
        Begin::Acquired { recovered: true }
    ));
}

/// How many claims [`wake_latencies`] waits on at once and settles one after another.
const WAKE_ROUNDS: u32 = 10;
/// When [`wake_latencies`] settles its first claim. Every store's waiter has backed off to its
/// slowest poll well before (after 155 ms for SQLite, 150 ms for PostgreSQL, 190 ms for Redis).
const WAKE_FIRST_SETTLE: Duration = Duration::from_millis(400);
/// The gap between two settles. Ten of them spread the settles over 270 ms, which covers a whole
/// poll cycle of every store (100 ms for SQLite, 200 ms for PostgreSQL, 250 ms for Redis, by
/// default), whatever its phase: to a store that only polls, some settles always come just after
/// a check.
const WAKE_STEP: Duration = Duration::from_millis(30);
/// How soon after the holder's write returns its waiter must have noticed it. A woken waiter only
/// has to re-check its record (well under a millisecond on an idle machine); a waiter that relies
/// on its poll sees a settle up to a whole poll cycle late, and that cycle is never shorter than
/// 100 ms: with the settles spread over the cycle, half of them or more come later than this.
const WAKE_BOUND: Duration = Duration::from_millis(50);
/// How many times [`woken_by`] measures before it concludes that wake-ups are lost. A machine
/// under heavy load can stall a woken waiter now and then, but a store that loses its wake-ups is
/// late in every attempt.
const WAKE_ATTEMPTS: usize = 3;

/// Requires every waiter on another handle to notice within [`WAKE_BOUND`], well inside the poll
/// cycle, when its claim is settled: only a wake-up is fast enough every time, so a store that
/// loses its notifications fails here even though its waiters would still find out by polling.
async fn woken_by(h: &impl Harness, what: &str, settle: impl AsyncFn(&dyn Store, &RecordId, FencingToken)) {
    let (holder, waiter) = (h.open().await, h.open().await);
    let mut attempts = Vec::new();
    for _ in 0..WAKE_ATTEMPTS {
        let latencies = wake_latencies(&*holder, &waiter, what, &settle).await;
        if latencies.iter().all(|latency| *latency <= WAKE_BOUND) {
            return;
        }
        attempts.push(latencies.iter().map(Duration::as_millis).collect::<Vec<_>>());
    }
    panic!(
        "every waiter must be woken by the {what} within {WAKE_BOUND:?} (polling alone is later for half of \
         them or more), but in each of {WAKE_ATTEMPTS} attempts some were not; the waiters noticed their \
         {what} after (ms) {attempts:?}"
    );
}

/// Waits on [`WAKE_ROUNDS`] claims at once, settles them one after another, [`WAKE_STEP`] apart,
/// and returns how long after each settle returned its waiter returned.
async fn wake_latencies(
    holder: &dyn Store,
    waiter: &Arc<dyn Store>,
    what: &str,
    settle: &impl AsyncFn(&dyn Store, &RecordId, FencingToken),
) -> Vec<Duration> {
    let fp = fingerprint("a");
    let mut claims = Vec::new();
    for _ in 0..WAKE_ROUNDS {
        let id = fresh_id();
        let token = acquire(holder, &id, &fp, UnixMillis::now()).await;
        claims.push((id, token));
    }
    let start = tokio::time::Instant::now();
    let deadline = start + Duration::from_secs(30);
    let waits: Vec<_> = claims
        .iter()
        .map(|(id, token)| {
            let (waiter, id, token) = (Arc::clone(waiter), id.clone(), *token);
            tokio::spawn(async move {
                let outcome = waiter.wait(&id, token, deadline).await;
                (outcome, tokio::time::Instant::now())
            })
        })
        .collect();
    let mut settled_at = Vec::new();
    for (round, ((id, token), wait)) in (0..).zip(claims.iter().zip(&waits)) {
        tokio::time::sleep_until(start + WAKE_FIRST_SETTLE + WAKE_STEP * round).await;
        assert!(
            !wait.is_finished(),
            "waiter {round} returned while its claim was still held"
        );
        settle(holder, id, *token).await;
        settled_at.push(tokio::time::Instant::now());
    }
    let mut latencies = Vec::new();
    for (round, (wait, settled_at)) in (0..).zip(waits.into_iter().zip(settled_at)) {
        let (outcome, woken_at) = tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .unwrap_or_else(|_| panic!("waiter {round} did not notice the {what} within 10 s"))
            .expect("task");
        assert_eq!(outcome.expect("wait"), WaitOutcome::Changed);
        latencies.push(woken_at.saturating_duration_since(settled_at));
    }
    latencies
}

/// Waiters on another handle are woken when the holder completes, not found later by polling.
pub async fn wait_wakes_on_completion(h: &impl Harness) {
    woken_by(h, "completion", async |store, id, token| {
        let now = UnixMillis::now();
        store
            .complete(id, token, completion(b"done", now, DAY, 7 * DAY))
            .await
            .expect("complete");
    })
    .await;
}

/// Waiters on another handle are woken when the holder releases, not found later by polling.
pub async fn wait_wakes_on_release(h: &impl Harness) {
    woken_by(h, "release", async |store, id, token| {
        store.release(id, token, Release::Forget).await.expect("release")
    })
    .await;
}

/// Waiters on another handle are woken when an operator deletes the record they wait on.
pub async fn wait_wakes_on_delete(h: &impl Harness) {
    woken_by(h, "delete", async |store, id, _token| {
        store
            .delete(id)
            .await
            .expect("delete")
            .expect("the in-flight record was there");
    })
    .await;
}

/// A wait on a claim that is already gone returns at once; one on a held claim times out.
pub async fn wait_checks_before_sleeping(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let far = tokio::time::Instant::now() + Duration::from_secs(3600);
    let gone = tokio::time::timeout(Duration::from_secs(10), store.wait(&id, FencingToken::random(), far)).await;
    assert_eq!(gone.expect("returns at once").expect("wait"), WaitOutcome::Changed);
    let token = acquire(&*store, &id, &fp, now).await;
    let soon = tokio::time::Instant::now() + Duration::from_millis(200);
    assert_eq!(store.wait(&id, token, soon).await.expect("wait"), WaitOutcome::TimedOut);
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
    let token = acquire(&*store, &id, &fp, now).await;
    store.release(&id, token, unknown_at(now)).await.expect("release");
    let record = store
        .get(&id)
        .await
        .expect("get")
        .expect("an unknown outcome is remembered");
    assert!(matches!(record.state, RecordState::Unknown { .. }), "{record:?}");
    let other = existing(begin(&*store, &id, &fingerprint("other"), now).await.0);
    assert!(
        matches!(other.state, RecordState::Unknown { .. }),
        "a different request does not claim it"
    );
    assert!(matches!(
        begin(&*store, &id, &fp, now).await.0,
        Begin::Acquired { recovered: true }
    ));
}

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
    let deleted = store
        .delete(&id)
        .await
        .expect("delete")
        .expect("delete returns the in-flight record");
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
    assert!(
        matches!(
            store.complete(&id, token, completion(b"x", now, DAY, 7 * DAY)).await,
            Err(StoreError::Fenced)
        ),
        "the holder of a deleted claim cannot complete it"
    );
    assert!(matches!(
        store.release(&id, token, Release::Forget).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.release(&id, token, unknown_at(now)).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.renew(&id, token, now.plus(LEASE)).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.checkpoint(&id, token, step("late", "x")).await,
        Err(StoreError::Fenced)
    ));
    unknown_after_delete(store.get(&id).await.expect("get"), "after the fenced holder's attempts");
    assert!(
        store.checkpoints(&id).await.expect("checkpoints").is_empty(),
        "delete drops the run's checkpoints"
    );
    let other = existing(begin(&*store, &id, &fingerprint("other request"), now).await.0);
    assert!(
        matches!(other.state, RecordState::Unknown { .. }),
        "another request does not claim the key: {other:?}"
    );
    let (claimed, new_token) = begin(&*store, &id, &fp, now).await;
    assert!(
        matches!(claimed, Begin::Acquired { recovered: true }),
        "the same request runs again, marked recovered: {claimed:?}"
    );
    assert!(
        matches!(
            store.complete(&id, token, completion(b"x", now, DAY, 7 * DAY)).await,
            Err(StoreError::Fenced)
        ),
        "the old holder is not the new claim's holder"
    );
    let record = store.get(&id).await.expect("get").expect("the new claim");
    assert_eq!(in_flight_token(&record), new_token);

    // Deleted again while in flight, then once more as unknown: the key is free.
    store.delete(&id).await.expect("delete").expect("the new claim");
    let deleted = store.delete(&id).await.expect("delete").expect("the unknown record");
    assert!(matches!(deleted.state, RecordState::Unknown { .. }), "{deleted:?}");
    assert!(
        store.get(&id).await.expect("get").is_none(),
        "a deleted unknown record is gone"
    );
    assert!(matches!(
        begin(&*store, &id, &fingerprint("other request"), now).await.0,
        Begin::Acquired { recovered: false }
    ));
}

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
    assert!(
        matches!(taken, Begin::Acquired { recovered: true }),
        "within its ttl it is: {taken:?}"
    );
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
        assert!(matches!(begun, Begin::Acquired { recovered: false }), "{begun:?}");
    }
    let later = base.plus(LEASE * 5);
    let record = existing(begin(&*store, &expired, &fp, later).await.0);
    assert!(
        matches!(record.state, RecordState::InFlight { expires_at: Some(e), lease_until, .. }
            if e == base.plus(LEASE * 2) && lease_until == base.plus(LEASE)),
        "past its ttl an abandoned claim is not taken over: {record:?}"
    );
    let (taken, _) = begin(&*store, &live, &fp, later).await;
    assert!(
        matches!(taken, Begin::Acquired { recovered: true }),
        "within its ttl it is: {taken:?}"
    );
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
    assert!(matches!(begun, Begin::Acquired { recovered: false }), "{begun:?}");
    // A claim whose ttl and purge_at are shorter than its lease (a handler still running).
    let begun = store
        .begin(BeginRequest {
            expires_at: start.plus(keep / 4),
            purge_at: start.plus(keep / 2),
            ..claim(&running, &fp, start, FencingToken::random())
        })
        .await
        .expect("begin");
    assert!(matches!(begun, Begin::Acquired { recovered: false }), "{begun:?}");

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
        assert!(matches!(
            begin(&*store, id, &fp, UnixMillis::now()).await.0,
            Begin::Acquired { recovered: false }
        ));
    }
    let record = store
        .get(&running)
        .await
        .expect("get")
        .expect("a claim whose lease runs is kept past its purge_at");
    assert!(matches!(record.state, RecordState::InFlight { .. }), "{record:?}");
    let still = existing(begin(&*store, &running, &fp, UnixMillis::now()).await.0);
    assert!(
        matches!(still.state, RecordState::InFlight { .. }),
        "and not claimed anew"
    );
}

/// Deleting a completed record, a tombstone or an unknown outcome returns it as it was and frees
/// the key: the same request then runs again as new (neither replayed, nor `key-expired`, nor
/// recovered).
pub async fn delete_frees_the_key_in_every_state(h: &impl Harness) {
    let store = h.open().await;
    let (fp, now) = (fingerprint("a"), UnixMillis::now());

    let completed = fresh_id();
    let token = acquire(&*store, &completed, &fp, now).await;
    store
        .complete(&completed, token, completion(b"stored answer", now, DAY, 7 * DAY))
        .await
        .expect("complete");
    existing(begin(&*store, &completed, &fp, now).await.0);
    let deleted = store
        .delete(&completed)
        .await
        .expect("delete")
        .expect("delete returns the completed record");
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
        let record = store.get(&tombstone).await.expect("get").expect("the record");
        if stored_response(&record).is_none() {
            break;
        }
        assert!(attempt < 100, "purge never dropped the expired answer");
        store.purge(UnixMillis::now(), 1000).await.expect("purge");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let deleted = store
        .delete(&tombstone)
        .await
        .expect("delete")
        .expect("delete returns the tombstone");
    assert_eq!(stored_response(&deleted), None, "a tombstone, as it was");
    assert_eq!(deleted.fingerprint, fp);

    let unknown = fresh_id();
    let token = acquire(&*store, &unknown, &fp, now).await;
    store.release(&unknown, token, unknown_at(now)).await.expect("release");
    let deleted = store
        .delete(&unknown)
        .await
        .expect("delete")
        .expect("delete returns the unknown outcome");
    assert!(matches!(deleted.state, RecordState::Unknown { .. }), "{deleted:?}");

    for id in [&completed, &tombstone, &unknown] {
        assert!(store.get(id).await.expect("get").is_none(), "a deleted record is gone");
        let (claimed, _) = begin(&*store, id, &fp, UnixMillis::now()).await;
        assert!(
            matches!(claimed, Begin::Acquired { recovered: false }),
            "the same request runs again as new: {claimed:?}"
        );
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
    let completed = acquire(&*store, &id, &fp, now).await;
    store
        .complete(&id, completed, completion(b"x", now, DAY, 7 * DAY))
        .await
        .expect("complete");
    assert!(store.delete(&id).await.expect("delete").is_some());
    assert!(
        store.delete(&id).await.expect("delete").is_none(),
        "a second delete finds nothing"
    );
    let kept = store
        .get(&other_scope)
        .await
        .expect("get")
        .expect("the same key in another scope is untouched");
    assert_eq!(in_flight_token(&kept), token);
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
        store.get(&id).await.expect("get").expect("record").replays,
        0,
        "an expired answer is no replay"
    );

    sleep_until(written.plus(ttl + Duration::from_millis(300))).await;
    store.purge(UnixMillis::now(), 1000).await.expect("purge");
    let tombstone = store
        .get(&id)
        .await
        .expect("get")
        .expect("a tombstone remains after the ttl");
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
    assert!(matches!(
        begin(&*store, &id, &fp, UnixMillis::now()).await.0,
        Begin::Acquired { recovered: false }
    ));
}

async fn sleep_until(at: UnixMillis) {
    tokio::time::sleep(at.since(UnixMillis::now())).await;
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
    assert!(matches!(
        begin(&*store, &id, &fingerprint("new"), later).await.0,
        Begin::Acquired { recovered: false }
    ));
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
    let token = acquire(&*store, &live, &fp, written).await;
    store
        .complete(&live, token, completion(b"x", written, DAY, 7 * DAY))
        .await
        .expect("complete");

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

/// The same key in two scopes is two records.
pub async fn scopes_are_isolated(h: &impl Harness) {
    let store = h.open().await;
    let (alice, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let bob = RecordId {
        scope: Scope::application(uuid::Uuid::new_v4().to_string()),
        key: alice.key.clone(),
    };
    let token = acquire(&*store, &alice, &fp, now).await;
    store
        .complete(&alice, token, completion(b"alice's answer", now, DAY, 7 * DAY))
        .await
        .expect("complete");
    let bob_token = acquire(&*store, &bob, &fp, now).await;
    let record = store.get(&bob).await.expect("get").expect("record");
    assert_eq!(in_flight_token(&record), bob_token, "bob never sees alice's answer");
}

/// Answers of several MiB are stored and returned byte for byte.
pub async fn large_bodies(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let body: Vec<u8> = (0..6 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let token = acquire(&*store, &id, &fp, now).await;
    store
        .complete(&id, token, completion(&body, now, DAY, 7 * DAY))
        .await
        .expect("complete a 6 MiB answer");
    let record = existing(begin(&*store, &id, &fp, now).await.0);
    assert!(
        stored_response(&record).as_deref() == Some(body.as_slice()),
        "the large answer comes back intact"
    );
}

/// Records survive closing every handle and opening a new one.
pub async fn records_survive_reopen(h: &impl Harness) {
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    {
        let store = h.open().await;
        let token = acquire(&*store, &id, &fp, now).await;
        store
            .complete(&id, token, completion(b"kept", now, DAY, 7 * DAY))
            .await
            .expect("complete");
    }
    let store = h.open().await;
    let record = existing(begin(&*store, &id, &fp, now).await.0);
    assert_eq!(stored_response(&record).as_deref(), Some(b"kept".as_slice()));
    store.ping().await.expect("ping");
}

/// The store tells its time, and a [`StoreClock`](crate::store::StoreClock) over it reads that time: the
/// tests' servers run on this machine, so both are this machine's time, give or take a second.
pub async fn tells_its_time(h: &impl Harness) {
    let store = h.open().await;
    let before = UnixMillis::now();
    let told = store.clock().await.expect("clock");
    let after = UnixMillis::now();
    assert!(
        told.0 + 1_000 >= before.0 && told.0 <= after.0 + 1_000,
        "the store's clock ({told}) is this machine's ({before}..{after})"
    );
    let clock = crate::store::StoreClock::new(store);
    let offset = clock.sync().await.expect("sync");
    assert!(offset.abs() < 1_000, "offset {offset} ms");
    let read = crate::Clock::now(&*clock);
    assert!(read.0.abs_diff(UnixMillis::now().0) < 1_000);
}

fn step(name: &str, value: &str) -> Checkpoint {
    Checkpoint {
        name: name.to_owned(),
        value: Bytes::copy_from_slice(value.as_bytes()),
    }
}

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
    assert!(matches!(taken, Begin::Acquired { recovered: true }), "{taken:?}");
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
    assert!(matches!(again, Begin::Acquired { recovered: true }), "{again:?}");
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

/// A claim can tell where it stands: current while in flight under it, completed once the record
/// was completed under it (whoever wrote the answer), ended otherwise.
pub async fn claim_state_follows_the_claim(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp) = (fresh_id(), fingerprint("a"));
    let now = UnixMillis::now();
    assert_eq!(
        store
            .claim_state(&id, FencingToken::random())
            .await
            .expect("claim_state"),
        ClaimState::Ended,
        "no record"
    );
    let token = acquire(&*store, &id, &fp, now).await;
    let other = FencingToken::random();
    assert_eq!(
        store.claim_state(&id, token).await.expect("claim_state"),
        ClaimState::Current
    );
    assert_eq!(
        store.claim_state(&id, other).await.expect("claim_state"),
        ClaimState::Ended
    );
    store
        .complete(&id, token, completion(b"ok", now, DAY, DAY))
        .await
        .expect("complete");
    assert_eq!(
        store.claim_state(&id, token).await.expect("claim_state"),
        ClaimState::Completed
    );
    assert_eq!(
        store.claim_state(&id, other).await.expect("claim_state"),
        ClaimState::Ended
    );

    let id = fresh_id();
    let token = acquire(&*store, &id, &fp, now).await;
    store.release(&id, token, unknown_at(now)).await.expect("release");
    assert_eq!(
        store.claim_state(&id, token).await.expect("claim_state"),
        ClaimState::Ended
    );
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
    assert!(matches!(first, Begin::Acquired { recovered: false }), "{first:?}");
    let recovered_token = FencingToken::random_in_transaction();
    let first = store
        .begin(claim(&id, &fp, then, recovered_token))
        .await
        .expect("begin");
    assert!(
        matches!(first, Begin::Acquired { recovered: true }),
        "an ordinary claim's successor recovers: {first:?}"
    );
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
    assert!(matches!(fresh, Begin::Acquired { recovered: false }), "{fresh:?}");
    assert!(
        store.checkpoints(&id).await.expect("checkpoints").is_empty(),
        "a new claim starts with no checkpoints"
    );
}

/// The salt that instances asking at once with `candidates` got: asserts that every one got the
/// same salt (`salts`), and that it is one of the candidates.
pub fn one_salt_of(salts: &[ScopeSalt], candidates: &[ScopeSalt]) -> ScopeSalt {
    let salt = salts[0];
    assert!(
        salts.iter().all(|s| *s == salt),
        "every instance gets the same salt: {salts:?}"
    );
    assert!(
        candidates
            .iter()
            .any(|c| c.salt == salt.salt && c.created_at == salt.created_at),
        "the salt is one of the candidates"
    );
    salt
}

/// The scope salt is made once per store: instances asking at once all get the same one, made from
/// one of their candidates, and a handle opened later gets it too. A store that held no records
/// when it made the salt says so.
pub async fn scope_salt_is_one_per_store(h: &impl Harness) {
    let now = UnixMillis::now();
    let mut handles = Vec::new();
    for _ in 0..8 {
        handles.push(h.open().await);
    }
    let candidates: Vec<ScopeSalt> = (0..8).map(|_| ScopeSalt::random(now)).collect();
    let asked = handles.iter().zip(&candidates).map(|(store, candidate)| {
        let (store, candidate) = (store.clone(), *candidate);
        tokio::spawn(async move { store.scope_salt(candidate).await.expect("scope_salt") })
    });
    let mut salts = Vec::new();
    for task in asked.collect::<Vec<_>>() {
        salts.push(task.await.expect("the task"));
    }
    let salt = one_salt_of(&salts, &candidates);
    assert_eq!(
        salt.older_records_until, None,
        "the store held no records when it made the salt"
    );

    // Records written after the salt change nothing; later handles get the same salt.
    let (id, fp) = (fresh_id(), fingerprint("{}"));
    let token = acquire(&*handles[0], &id, &fp, now).await;
    let done = completion(b"ok", now, DAY, 2 * DAY);
    handles[0].complete(&id, token, done).await.expect("complete");
    let later = h.open().await;
    assert_eq!(
        later.scope_salt(ScopeSalt::random(now)).await.expect("scope_salt"),
        salt
    );
}

/// A claim carries the identity of the store whose salt hashed its scope, and the store checks it
/// in the same atomic step: under another identity, or after the store lost its data (and so its
/// salt), nothing is claimed and nothing written. The salt read again is the one every instance
/// reads, made by the first to ask after the loss, with an identity of its own. Many keys, so
/// that on a cluster every node's slots are claimed in.
pub async fn claims_check_the_stores_identity(h: &impl Harness) {
    let (a, now) = (h.open().await, UnixMillis::now());
    let before = a.scope_salt(ScopeSalt::random(now)).await.expect("scope_salt");
    let seen = a.identity().await.expect("identity");
    assert!(seen.is_some(), "a store with a salt has an identity");
    assert_eq!(a.identity().await.expect("identity"), seen, "and keeps it");
    claims_under(&a, before.identity, true, "the store's identity").await;
    claims_under(&a, StoreIdentity::random(), false, "another identity").await;

    h.lose_data().await;
    assert_eq!(a.identity().await.expect("identity"), None, "the store lost its salt");
    claims_under(&a, before.identity, false, "a store that lost its data").await;
    let c = h.open().await;
    let after = c.scope_salt(ScopeSalt::random(now)).await.expect("scope_salt");
    assert_ne!(
        after.identity, before.identity,
        "a store that lost its salt makes a new one"
    );
    assert_eq!(a.scope_salt(ScopeSalt::random(now)).await.expect("scope_salt"), after);
    claims_under(&a, after.identity, true, "the new identity, by the instance of before").await;
    claims_under(&c, after.identity, true, "the new identity, by a new instance").await;
    claims_under(&c, before.identity, false, "the identity of before the loss").await;
}

/// Claims 24 new keys (spread over a cluster's slots) under `identity`: each is acquired if
/// `acquired`, else refused with nothing written.
async fn claims_under(store: &Arc<dyn Store>, identity: StoreIdentity, acquired: bool, what: &str) {
    let (now, fp) = (UnixMillis::now(), fingerprint("{}"));
    for _ in 0..24 {
        let id = fresh_id();
        let begun = store
            .begin(BeginRequest {
                identity: Some(identity),
                ..claim(&id, &fp, now, FencingToken::random())
            })
            .await;
        if acquired {
            assert!(
                matches!(begun, Ok(Begin::Acquired { recovered: false })),
                "{what}: {begun:?}"
            );
        } else {
            assert!(matches!(begun, Err(StoreError::IdentityChanged)), "{what}: {begun:?}");
            assert!(
                store.get(&id).await.expect("get").is_none(),
                "{what}: nothing was written"
            );
        }
    }
}

/// A salt made by a store that already holds records tells until when those records may live, so
/// that scopes hashed before there was a salt are still looked up until then.
pub async fn scope_salt_tells_how_long_older_records_live(h: &impl Harness) {
    let store = h.open().await;
    let now = UnixMillis::now();
    let (fp, mut latest) = (fingerprint("{}"), now);
    for days in [3, 9, 5] {
        let id = fresh_id();
        let token = acquire(&*store, &id, &fp, now).await;
        let done = completion(b"ok", now, DAY, Duration::from_secs(days * 24 * 3600));
        latest = latest.max(done.purge_at);
        store.complete(&id, token, done).await.expect("complete");
    }
    // One still in flight: its run ends (and its record's life begins) later, which the protocol
    // allows for on its side.
    acquire(&*store, &fresh_id(), &fp, now).await;
    let salt = store.scope_salt(ScopeSalt::random(now)).await.expect("scope_salt");
    let until = salt
        .older_records_until
        .expect("the store held records when it made the salt");
    assert!(
        until >= latest,
        "older records live until {latest}, the salt says {until}"
    );
    assert!(
        until <= latest.plus(LEASE),
        "the salt says older records live until {until}, long after the latest ({latest})"
    );
}

/// A record keeps what it is about: the request's method and path and the trace id of its latest
/// run (a takeover's own), whether that run was recovered, and its answer's status; `get` and
/// `list` both show them.
pub async fn a_record_keeps_its_origin_status_and_recovery(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let first = Origin::new("POST", "/payments/pay_1", Some(run_trace(1)));
    let token = FencingToken::random();
    let begun = store
        .begin(BeginRequest {
            origin: &first,
            ..claim(&id, &fp, now, token)
        })
        .await
        .expect("begin");
    assert!(matches!(begun, Begin::Acquired { recovered: false }), "{begun:?}");
    let record = store.get(&id).await.expect("get").expect("the claim");
    assert_eq!((&record.origin, record.recovered, record.status), (&first, false, None));
    store.release(&id, token, unknown_at(now)).await.expect("release");

    // The same request again, in another trace: taken over, recovered; the record now names the
    // run that answers.
    let retry = Origin::new("POST", "/payments/pay_1", Some(run_trace(2)));
    let token = FencingToken::random();
    let later = now.plus(Duration::from_secs(1));
    let begun = store
        .begin(BeginRequest {
            origin: &retry,
            ..claim(&id, &fp, later, token)
        })
        .await
        .expect("begin");
    assert!(matches!(begun, Begin::Acquired { recovered: true }), "{begun:?}");
    let declined = Completion {
        status: 402,
        ..completion(b"declined", later, DAY, 7 * DAY)
    };
    store.complete(&id, token, declined).await.expect("complete");
    let record = store.get(&id).await.expect("get").expect("the record");
    assert_eq!(record.origin, retry, "the trace of the run that answered");
    assert!(record.recovered, "the answering run was recovered");
    assert_eq!(record.status, Some(402));
    assert_eq!(
        record.created_at, now,
        "a takeover keeps when the key was first claimed"
    );
    let listed = store
        .list(&ListQuery {
            path: Some("/payments/pay_1".into()),
            recovered: true,
            ..ListQuery::all(later, 1000)
        })
        .await
        .expect("list");
    let mine: Vec<_> = listed.iter().filter(|listed| listed.id == id).collect();
    assert_eq!(mine.len(), 1, "{listed:?}");
    assert_eq!(
        (
            mine[0].state,
            &mine[0].origin,
            mine[0].status,
            mine[0].recovered,
            mine[0].created_at
        ),
        (ListedState::Completed, &retry, Some(402), true, now)
    );

    // A copy that finds the answer is told which run made it (its span links to that run's).
    let copy = Origin::new("POST", "/payments/pay_1", Some(run_trace(3)));
    let found = store
        .begin(BeginRequest {
            origin: &copy,
            ..claim(&id, &fp, later, FencingToken::random())
        })
        .await
        .expect("begin");
    let Begin::Existing(found) = found else {
        panic!("a completed record is found, not claimed: {found:?}");
    };
    assert_eq!(found.origin.trace, retry.trace, "the trace of the run that answered");

    // A record whose request carried no trace keeps none; its run was not recovered.
    let plain = fresh_id();
    let token = acquire(&*store, &plain, &fp, now).await;
    store
        .complete(&plain, token, completion(b"ok", now, DAY, 7 * DAY))
        .await
        .expect("complete");
    let record = store.get(&plain).await.expect("get").expect("the record");
    assert_eq!(
        (&record.origin, record.recovered, record.status),
        (origin(), false, Some(201))
    );
}

/// `list` answers an operator's questions about the records under one path: by state, judged at
/// the query's `now` (a tombstone is an answer past its `expires_at`), by recovery, by creation
/// time, newest first, at most `limit`; a path filter takes the path and what lies below it only.
pub async fn lists_records_by_state_time_path_and_recovery(h: &impl Harness) {
    let store = h.open().await;
    let route = format!("/list-{}", uuid::Uuid::new_v4());
    let fp = fingerprint("a");
    let base = UnixMillis::now();
    let at = |ms: u64| base.plus(Duration::from_millis(ms));
    let origin_of = |name: &str| Origin::new("POST", &format!("{route}/{name}"), Some(run_trace(7)));
    let claim_as = |id: &RecordId, name: &str, now: UnixMillis| {
        let (store, id, origin, fp) = (store.clone(), id.clone(), origin_of(name), fp.clone());
        async move {
            let token = FencingToken::random();
            let begun = store
                .begin(BeginRequest {
                    origin: &origin,
                    ..claim(&id, &fp, now, token)
                })
                .await
                .expect("begin");
            (begun, token)
        }
    };
    let [in_flight, completed, unknown, tombstone, recovered, outside] = std::array::from_fn(|_| fresh_id());
    claim_as(&in_flight, "in-flight", at(0)).await;
    let (_, token) = claim_as(&completed, "completed", at(1)).await;
    store
        .complete(&completed, token, completion(b"ok", at(1), DAY, 7 * DAY))
        .await
        .expect("complete");
    let (_, token) = claim_as(&unknown, "unknown", at(2)).await;
    store
        .release(&unknown, token, unknown_at(at(2)))
        .await
        .expect("release");
    let (_, token) = claim_as(&tombstone, "tombstone", at(3)).await;
    let short = Completion {
        expires_at: at(5),
        ..completion(b"old", at(3), DAY, 7 * DAY)
    };
    store.complete(&tombstone, token, short).await.expect("complete");
    let (_, token) = claim_as(&recovered, "recovered", at(4)).await;
    store
        .release(&recovered, token, unknown_at(at(4)))
        .await
        .expect("release");
    let (begun, token) = claim_as(&recovered, "recovered", at(5)).await;
    assert!(matches!(begun, Begin::Acquired { recovered: true }), "{begun:?}");
    store
        .complete(&recovered, token, completion(b"ok", at(5), DAY, 7 * DAY))
        .await
        .expect("complete");
    // Its path starts like the route's, but is not under it.
    let stranger = Origin::new("POST", &format!("{route}-old/x"), None);
    store
        .begin(BeginRequest {
            origin: &stranger,
            ..claim(&outside, &fp, at(6), FencingToken::random())
        })
        .await
        .expect("begin");

    let now = at(10);
    let query = ListQuery {
        path: Some(route.clone()),
        ..ListQuery::all(now, 1000)
    };
    let ids = |listed: Vec<Listed>| listed.into_iter().map(|listed| listed.id).collect::<Vec<_>>();
    let list = |query: ListQuery| {
        let store = store.clone();
        async move { ids(store.list(&query).await.expect("list")) }
    };
    let everything = store.list(&query).await.expect("list");
    assert_eq!(
        everything
            .iter()
            .map(|listed| (listed.id.clone(), listed.state))
            .collect::<Vec<_>>(),
        [
            (recovered.clone(), ListedState::Completed),
            (tombstone.clone(), ListedState::Tombstone),
            (unknown.clone(), ListedState::Unknown),
            (completed.clone(), ListedState::Completed),
            (in_flight.clone(), ListedState::InFlight),
        ],
        "every record under {route}, newest first, judged at the query's now"
    );
    let first = &everything[0];
    assert_eq!(
        (first.origin.method.as_str(), first.origin.trace),
        ("POST", Some(run_trace(7)))
    );
    assert_eq!((first.status, first.recovered), (Some(201), true));
    assert_eq!(everything[4].status, None, "no answer yet");
    for (state, expected) in [
        (ListedState::InFlight, vec![in_flight.clone()]),
        (ListedState::Unknown, vec![unknown.clone()]),
        (ListedState::Completed, vec![recovered.clone(), completed.clone()]),
        (ListedState::Tombstone, vec![tombstone.clone()]),
    ] {
        assert_eq!(
            list(ListQuery {
                state: Some(state),
                ..query.clone()
            })
            .await,
            expected,
            "{state}"
        );
    }
    assert_eq!(
        list(ListQuery {
            recovered: true,
            ..query.clone()
        })
        .await,
        vec![recovered.clone()]
    );
    assert_eq!(
        list(ListQuery {
            since: Some(at(2)),
            ..query.clone()
        })
        .await,
        [recovered.clone(), tombstone.clone(), unknown.clone()]
    );
    assert_eq!(
        list(ListQuery {
            limit: 2,
            ..query.clone()
        })
        .await,
        [recovered.clone(), tombstone.clone()]
    );
    assert_eq!(
        list(ListQuery {
            path: Some(format!("{route}/unknown")),
            ..query.clone()
        })
        .await,
        vec![unknown.clone()]
    );
    assert_eq!(
        list(ListQuery {
            path: Some(format!("{route}-old")),
            ..query.clone()
        })
        .await,
        vec![outside.clone()]
    );
    // The same records a day later, on the store's clock: every answer and unknown outcome is past
    // its ttl.
    let later = ListQuery {
        now: base.plus(DAY + Duration::from_secs(1)),
        ..query.clone()
    };
    assert_eq!(
        list(ListQuery {
            state: Some(ListedState::Tombstone),
            ..later
        })
        .await,
        [recovered, tombstone, unknown, completed]
    );
}

/// A run trace (trace and span id) made of `n`.
pub fn run_trace(n: u8) -> crate::trace_context::RunTrace {
    crate::trace_context::RunTrace {
        trace_id: crate::trace_context::TraceId::from_bytes([n; 16]).expect("not all zero"),
        span_id: crate::trace_context::SpanId::from_bytes([n; 8]),
    }
}

/// Polls `condition` every 10 ms until it holds; panics with `what` if it does not within `limit`.
pub async fn eventually(limit: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !condition() {
        assert!(tokio::time::Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

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
        replays = there.get(&id).await.expect("get").expect("record").replays;
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

    operator
        .delete(&id)
        .await
        .expect("delete")
        .expect("the record was there");
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

/// Generates one `#[tokio::test]` per conformance case, each calling `$harness` for its store:
/// a store crate's test file holds its [`Harness`] and the line
/// `idem_core::conformance_tests!(MyHarness::new());`.
///
/// `conformance_tests!(in_sequence $harness)`, written inside an async test instead, runs every
/// case there, one after another, each on a harness `$harness` makes afresh: for stores whose
/// servers are costly to start (a replicated Redis the test starts itself), started once.
#[macro_export]
macro_rules! conformance_tests {
    (in_sequence $harness:expr) => {
        $crate::conformance_tests! { @list @sequence $harness }
    };
    ($harness:expr) => {
        $crate::conformance_tests! { @list @cases $harness }
    };
    (@list @$mode:ident $harness:expr) => {
        $crate::conformance_tests! { @$mode $harness;
            claims_a_new_key, one_claim_under_concurrency, completes_and_replays, fencing,
            takeover_needs_the_same_fingerprint, renewal_keeps_the_claim, wait_wakes_on_completion,
            wait_wakes_on_release, wait_wakes_on_delete, wait_checks_before_sleeping,
            release_forgets_or_remembers, delete_fences_the_holder, delete_frees_the_key_in_every_state,
            delete_of_a_missing_key_is_none, unknown_outcome_expires_at_its_ttl,
            abandoned_claim_expires_at_its_ttl, purge_keeps_unanswered_keys_until_purge_at,
            expiry_leaves_a_tombstone, purge_time_frees_the_key_without_purge, purge_in_batches,
            scopes_are_isolated, large_bodies, records_survive_reopen, tells_its_time,
            checkpoints_belong_to_the_current_claim, checkpoints_survive_a_takeover_and_end_with_the_run,
            a_new_claim_never_sees_old_checkpoints, scope_salt_is_one_per_store,
            scope_salt_tells_how_long_older_records_live, claims_check_the_stores_identity,
            claim_state_follows_the_claim,
            an_in_transaction_claim_that_died_is_taken_over_unflagged,
            replay_cache_forgets_what_any_instance_deletes, a_record_keeps_its_origin_status_and_recovery,
            lists_records_by_state_time_path_and_recovery }
    };
    (@cases $harness:expr; $($case:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::testkit::$case(&$harness).await;
            }
        )*
    };
    (@sequence $harness:expr; $($case:ident),* $(,)?) => {
        $(
            ::std::eprintln!("conformance case {}", ::std::stringify!($case));
            $crate::testkit::$case(&$harness).await;
        )*
    };
}

/// A store whose operations are counted, to prove how many round trips a request costs.
pub type CountingStore<S> = Observed<S, Counts>;

/// Counts the operations on `inner`.
pub fn counting<S: Store>(inner: S) -> CountingStore<S> {
    Observed::new(inner, Counts::default())
}

/// An [`Observer`] that counts each operation.
#[derive(Debug, Default)]
pub struct Counts {
    counts: [std::sync::atomic::AtomicU64; StoreOperation::ALL.len()],
}

impl Observer for Counts {
    fn observe(&self, operation: StoreOperation, _elapsed: Duration, _failed: bool) {
        self.counts[operation as usize].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl<S> Observed<S, Counts> {
    /// How many times `operation` ran.
    pub fn count(&self, operation: StoreOperation) -> u64 {
        self.observer().counts[operation as usize].load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many operations ran in all, the per-instance reads (clock, scope salt) aside.
    pub fn total(&self) -> u64 {
        StoreOperation::ALL
            .into_iter()
            .filter(|operation| !operation.per_instance())
            .map(|operation| self.count(operation))
            .sum()
    }

    /// Starts counting from zero again.
    pub fn reset(&self) {
        for count in &self.observer().counts {
            count.store(0, std::sync::atomic::Ordering::SeqCst);
        }
    }
}
