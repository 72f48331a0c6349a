//! Where a record's keys live and when they expire: one cluster slot per record, native expiry
//! relative to the caller's clock (a fake one, 40 days in the past), and checkpoints that carry
//! their record's hash tag and expire with it.

use std::time::Duration;

use bytes::Bytes;
use idem_core::store::{Begin, Checkpoint, Completion, FencingToken, Release};
use idem_core::testkit::{self, DAY, LEASE, fingerprint, fresh_id};
use idem_core::{Store, UnixMillis};
use idem_redis::RecordKeys;

use crate::common::Server;
use crate::{HOUR, claim, completed, completion, fresh_store, present, pttl, query};

/// A record's keys (its hash, its answer, its channel) hash to one slot, and records spread over
/// the cluster's slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keys_of_a_record_share_one_slot() {
    let server = Server::Cluster;
    let (store, _cleanup) = fresh_store(server, "").await;
    assert!(store.is_cluster());
    let mut slots = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let id = fresh_id();
        completed(&store, &id, 7 * DAY).await;
        let keys = store.record_keys(&id);
        let slot = |key: &str| -> i64 { query(server, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key)) };
        let record_slot = slot(&keys.record);
        assert_eq!(record_slot, slot(&keys.body), "{keys:?}");
        assert_eq!(record_slot, slot(&keys.channel), "{keys:?}");
        assert_eq!(
            present(server, &[&keys.record, &keys.body]),
            2,
            "both keys are stored: {keys:?}"
        );
        slots.insert(record_slot);
    }
    assert!(slots.len() > 1, "records spread over the cluster's slots: {slots:?}");
}

/// Asserts that `key` expires in about `expected` (up to 5 s less: the time the test took).
fn assert_ttl_near(server: Server, key: &str, expected: Duration) {
    let actual = pttl(server, key);
    let expected = i64::try_from(expected.as_millis()).unwrap();
    assert!(
        (expected - 5_000..=expected).contains(&actual),
        "{key}: PTTL {actual} ms, expected about {expected} ms"
    );
}

/// Expiry is native and follows the caller's clock, even a fake one 40 days in the past.
async fn expiry_is_native_and_relative(server: Server) {
    let (store, _cleanup) = fresh_store(server, "").await;
    let base = UnixMillis::now().minus(DAY * 40);

    let id = fresh_id();
    let keys = store.record_keys(&id);
    let token = claim(&store, &id, base).await;
    assert_ttl_near(server, &keys.record, 7 * DAY);
    // A claim is kept until the purge_at it was made with: a renewal whose lease ends before it
    // leaves it where it is.
    store.renew(&id, token, base.plus(LEASE * 2)).await.expect("renew");
    assert_ttl_near(server, &keys.record, 7 * DAY);
    // A lease renewed past it (a handler running for days) moves it to the lease's end.
    store.renew(&id, token, base.plus(DAY * 8)).await.expect("renew");
    assert_ttl_near(server, &keys.record, 8 * DAY);
    let done = base.plus(Duration::from_secs(10));
    store
        .complete(&id, token, completion(done, HOUR, 2 * HOUR))
        .await
        .expect("complete");
    assert_ttl_near(server, &keys.body, HOUR);
    assert_ttl_near(server, &keys.record, 2 * HOUR);

    let id = fresh_id();
    let keys = store.record_keys(&id);
    let token = claim(&store, &id, base).await;
    store
        .release(
            &id,
            token,
            Release::Unknown {
                expires_at: base.plus(DAY),
                purge_at: base.plus(DAY),
            },
        )
        .await
        .expect("release");
    assert_ttl_near(server, &keys.record, DAY);

    let id = fresh_id();
    let keys = store.record_keys(&id);
    let token = claim(&store, &id, base).await;
    store.release(&id, token, Release::Forget).await.expect("release");
    assert_eq!(
        present(server, &[&keys.record, &keys.body]),
        0,
        "a forgotten record leaves no key"
    );

    // An answer that is already past its time is not stored at all.
    let id = fresh_id();
    let keys = store.record_keys(&id);
    let token = claim(&store, &id, base).await;
    let stale = Completion {
        response: Bytes::from_static(b"late"),
        completed_at: base,
        expires_at: base,
        purge_at: base.plus(HOUR),
        status: 200,
    };
    store.complete(&id, token, stale).await.expect("complete");
    assert_eq!(
        present(server, &[&keys.body]),
        0,
        "an answer past expires_at is not kept"
    );
    assert_ttl_near(server, &keys.record, HOUR);
}

/// The `{hash tag}` of a key: what Redis Cluster hashes.
fn hash_tag(key: &str) -> &str {
    let open = key.find('{').expect("a hash tag");
    let close = open + key[open..].find('}').expect("a closed hash tag");
    &key[open + 1..close]
}

/// The checkpoints key exists and expires with the record: a positive PTTL, never after the
/// record's expiry. Returns its PTTL.
fn assert_checkpoints_expire_with_the_record(server: Server, keys: &RecordKeys) -> i64 {
    let expire_time = |key: &str| -> i64 { query(server, redis::cmd("PEXPIRETIME").arg(key)) };
    let record_pttl = pttl(server, &keys.record);
    let checkpoints_pttl = pttl(server, &keys.checkpoints);
    assert!(record_pttl > 0, "{}: PTTL {record_pttl}", keys.record);
    assert!(
        checkpoints_pttl > 0,
        "{}: PTTL {checkpoints_pttl}, expected an expiry",
        keys.checkpoints
    );
    assert!(
        checkpoints_pttl <= record_pttl,
        "the checkpoints (PTTL {checkpoints_pttl}) outlive the record (PTTL {record_pttl})"
    );
    let (record_at, checkpoints_at) = (expire_time(&keys.record), expire_time(&keys.checkpoints));
    assert!(
        checkpoints_at <= record_at,
        "the checkpoints expire at {checkpoints_at}, after the record at {record_at}"
    );
    checkpoints_pttl
}

/// The checkpoints key carries the record's hash tag (one slot on a cluster) and expires with the
/// record whenever the record's expiry is set or moved: written, renewed, taken over, released
/// as unknown. Completing deletes it. The clock is a fake one, 40 days in the past.
async fn checkpoints_expire_with_their_record(server: Server) {
    let (store, _cleanup) = fresh_store(server, "").await;
    let base = UnixMillis::now().minus(DAY * 40);
    let (id, fp) = (fresh_id(), fingerprint("a"));
    let keys = store.record_keys(&id);
    assert_eq!(hash_tag(&keys.checkpoints), hash_tag(&keys.record), "{keys:?}");
    if server == Server::Cluster {
        let slot = |key: &str| -> i64 { query(server, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key)) };
        assert_eq!(slot(&keys.checkpoints), slot(&keys.record), "{keys:?}");
    }
    let step = |name: &str| Checkpoint {
        name: name.to_owned(),
        value: Bytes::from_static(b"\x00\xffdone"),
    };

    let token = claim(&store, &id, base).await;
    assert_eq!(present(server, &[&keys.checkpoints]), 0, "no checkpoint, no key");
    store
        .checkpoint(&id, token, step("reserved"))
        .await
        .expect("checkpoint");
    assert_checkpoints_expire_with_the_record(server, &keys);
    assert_ttl_near(server, &keys.checkpoints, 7 * DAY);

    store.renew(&id, token, base.plus(LEASE * 2)).await.expect("renew");
    assert_checkpoints_expire_with_the_record(server, &keys);
    assert_ttl_near(server, &keys.checkpoints, 7 * DAY);

    let later = base.plus(LEASE * 3);
    let token = FencingToken::random();
    let taken = store
        .begin(testkit::claim(&id, &fp, later, token))
        .await
        .expect("begin");
    assert!(matches!(taken, Begin::Acquired { recovered: true }), "{taken:?}");
    assert_checkpoints_expire_with_the_record(server, &keys);
    assert_ttl_near(server, &keys.checkpoints, 7 * DAY);

    // Released as unknown: the record's expiry moves a week closer, the checkpoints' with it.
    store.checkpoint(&id, token, step("charged")).await.expect("checkpoint");
    let unknown = Release::Unknown {
        expires_at: later.plus(DAY),
        purge_at: later.plus(DAY),
    };
    store.release(&id, token, unknown).await.expect("release");
    assert_checkpoints_expire_with_the_record(server, &keys);
    assert_ttl_near(server, &keys.checkpoints, DAY);

    // Taken over again (not read back: at the server's clock this record of 40 days ago is past
    // its purge_at, and `checkpoints` judges it as `get` does), then completed.
    let token = claim(&store, &id, later).await;
    assert_eq!(
        present(server, &[&keys.checkpoints]),
        1,
        "a takeover keeps the checkpoints"
    );
    store
        .complete(&id, token, completion(later, HOUR, 2 * HOUR))
        .await
        .expect("complete");
    assert_eq!(
        present(server, &[&keys.checkpoints]),
        0,
        "completing deletes the checkpoints"
    );
}

on_both_servers! {
    expiry_is_native_and_relative =>
        standalone_expiry_is_native_and_relative_to_the_callers_clock,
        cluster_expiry_is_native_and_relative_to_the_callers_clock;
    checkpoints_expire_with_their_record =>
        standalone_checkpoints_share_the_records_tag_and_expire_with_it,
        cluster_checkpoints_share_the_records_tag_and_expire_with_it;
}
