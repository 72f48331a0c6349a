//! What the cases, and the store crates' own tests, build claims and read records with: fresh
//! ids in scopes of their own, one fingerprint, claims at a given time under one lease and ttl,
//! and the asserts that unwrap what a store returned.

use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http::Method;

use crate::store::{
    Begin, BeginRequest, Checkpoint, Completion, FencingToken, Origin, Record, RecordId, RecordState, Release,
};
use crate::{Fingerprint, IdempotencyKey, Scope, Store, StoreError, UnixMillis};

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

/// The step `name` recorded with `value`.
pub(super) fn step(name: &str, value: &str) -> Checkpoint {
    Checkpoint {
        name: name.to_owned(),
        value: Bytes::copy_from_slice(value.as_bytes()),
    }
}

/// Sleeps until `at` has really passed on this machine's clock (the cases on real time).
pub(super) async fn sleep_until(at: UnixMillis) {
    tokio::time::sleep(at.since(UnixMillis::now())).await;
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

/// Asserts that `token` (`whose` it is, for the message) writes nothing to `id` at `now`:
/// completing, releasing (forgotten or as unknown), renewing and recording a step are each
/// [`StoreError::Fenced`].
pub(super) async fn assert_fenced(store: &dyn Store, id: &RecordId, token: FencingToken, now: UnixMillis, whose: &str) {
    let attempts = [
        (
            "complete",
            store.complete(id, token, completion(b"x", now, DAY, 7 * DAY)).await,
        ),
        ("release as forgotten", store.release(id, token, Release::Forget).await),
        ("release as unknown", store.release(id, token, unknown_at(now)).await),
        ("renew", store.renew(id, token, now.plus(LEASE)).await),
        ("checkpoint", store.checkpoint(id, token, step("late", "x")).await),
    ];
    for (operation, result) in attempts {
        assert!(
            matches!(result, Err(StoreError::Fenced)),
            "{whose} cannot {operation}: {result:?}"
        );
    }
}

/// Asserts that a begin handed out a claim: a takeover (`recovered`) or a new one; `what` says
/// which claim the case expects.
pub(super) fn assert_claimed(begun: &Begin, recovered: bool, what: &str) {
    assert!(
        matches!(begun, Begin::Acquired { recovered: r } if *r == recovered),
        "{what}: expected a claim with recovered = {recovered}, got {begun:?}"
    );
}

/// Claims `id` at `at` and completes it with `body` as its answer, replayable for a [`DAY`], its
/// tombstone kept a week.
pub(super) async fn answered(store: &dyn Store, id: &RecordId, fp: &Fingerprint, at: UnixMillis, body: &[u8]) {
    let token = acquire(store, id, fp, at).await;
    store
        .complete(id, token, completion(body, at, DAY, 7 * DAY))
        .await
        .expect("complete");
}

/// Claims `id` at `at` and releases it as an unknown outcome ([`unknown_at`]).
pub(super) async fn unknown_outcome(store: &dyn Store, id: &RecordId, fp: &Fingerprint, at: UnixMillis) {
    let token = acquire(store, id, fp, at).await;
    store.release(id, token, unknown_at(at)).await.expect("release");
}

/// The record a `get` or a `delete` found, which must be there: `what` says why.
pub(super) fn the_record(answer: Result<Option<Record>, StoreError>, what: &str) -> Record {
    answer
        .expect("the store answers")
        .unwrap_or_else(|| panic!("no record: {what}"))
}

/// Asserts that only the same request takes over `id`'s unknown outcome at `at` (`what` says
/// whose): another request finds the record unknown and claims nothing, the same request gets a
/// recovered claim, whose token this returns.
pub(super) async fn taken_over_by_the_same_request_only(
    store: &dyn Store,
    id: &RecordId,
    fp: &Fingerprint,
    at: UnixMillis,
    what: &str,
) -> FencingToken {
    let other = existing(begin(store, id, &fingerprint("another request"), at).await.0);
    assert!(
        matches!(other.state, RecordState::Unknown { .. }),
        "{what}: another request does not claim the key: {other:?}"
    );
    let (claimed, token) = begin(store, id, fp, at).await;
    assert_claimed(
        &claimed,
        true,
        &format!("{what}: the same request runs again, marked recovered"),
    );
    token
}
