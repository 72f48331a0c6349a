//! What a store keeps, whoever asks: one record per scope, answers of several MiB byte for byte,
//! records across handles closed and opened again; and the time it tells.

use super::Harness;
use super::helpers::{
    acquire, answered, begin, existing, fingerprint, fresh_id, in_flight_token, stored_response, the_record,
};
use crate::store::RecordId;
use crate::{Scope, UnixMillis};

/// The same key in two scopes is two records.
pub async fn scopes_are_isolated(h: &impl Harness) {
    let store = h.open().await;
    let (alice, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let bob = RecordId {
        scope: Scope::application(uuid::Uuid::new_v4().to_string()),
        key: alice.key.clone(),
    };
    answered(&*store, &alice, &fp, now, b"alice's answer").await;
    let bob_token = acquire(&*store, &bob, &fp, now).await;
    let record = the_record(store.get(&bob).await, "record");
    assert_eq!(in_flight_token(&record), bob_token, "bob never sees alice's answer");
}

/// Answers of several MiB are stored and returned byte for byte.
pub async fn large_bodies(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let body: Vec<u8> = (0..6 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    answered(&*store, &id, &fp, now, &body).await;
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
        answered(&*store, &id, &fp, now, b"kept").await;
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
