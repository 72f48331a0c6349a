//! The store's identity: one scope salt per store, made once by whoever asks first, checked in
//! the same atomic step as every claim, made anew after the store lost its data; and how long
//! records older than the salt live.

use std::sync::Arc;
use std::time::Duration;

use super::Harness;
use super::helpers::{DAY, LEASE, acquire, claim, completion, fingerprint, fresh_id};
use crate::store::{Begin, BeginRequest, FencingToken, ScopeSalt, StoreIdentity};
use crate::{Store, StoreError, UnixMillis};

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
