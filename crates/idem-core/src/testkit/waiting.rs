//! Waiting for a copy in flight: a waiter on another handle is woken by every way a claim ends
//! (completion, release, delete), well before its poll would find out, and never sleeps on a
//! claim that is already gone.

use std::sync::Arc;
use std::time::Duration;

use super::Harness;
use super::helpers::{DAY, acquire, completion, fingerprint, fresh_id};
use crate::store::{FencingToken, RecordId, Release, WaitOutcome};
use crate::{Store, UnixMillis};

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
