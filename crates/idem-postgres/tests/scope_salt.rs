//! The scope salt as PostgreSQL holds it: one per schema, the one a concurrent caller committed
//! when two make it at once, untouched by purging, and reported as a corrupt store when it cannot
//! be used. (Many instances asking at once are in the conformance suite, and the salt of an
//! upgraded database in `setup.rs`.)

use std::time::Duration;

use idem_core::testkit::{DAY, acquire, completion, fingerprint, fresh_id};
use idem_core::{Store, StoreError, UnixMillis, store::ScopeSalt};
use idem_test_support::postgres_store::TestSchema;

/// Two stores in two schemas of one database: each makes its own salt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_schema_has_a_salt_of_its_own() {
    let (one, two) = (TestSchema::new(), TestSchema::new());
    let (a, b) = (one.connect("").await, two.connect("").await);
    let now = UnixMillis::now();
    let (first, second) = (ScopeSalt::random(now), ScopeSalt::random(now));
    let made = a.scope_salt(first).await.expect("scope_salt");
    assert_eq!(made.salt, first.salt);
    let made = b.scope_salt(second).await.expect("scope_salt");
    assert_eq!(made.salt, second.salt, "the other schema's salt is not this one's");
    assert_eq!(a.scope_salt(second).await.expect("scope_salt").salt, first.salt);
}

/// A caller whose insert finds another's uncommitted salt waits for it, and once it is committed
/// returns it: the row is read by a statement that sees the commit, not with the insert's
/// snapshot, in which there was no row. Made deterministic by holding the other insert open until
/// the store's statement is seen waiting on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salt_committed_while_waiting_for_it_is_the_one_returned() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let now = UnixMillis::now();
    let theirs = ScopeSalt::random(now);
    let mut other = schema.client().await;
    let tx = other.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO idem_scope_salt (id, salt, created_at, identity) VALUES (1, $1, $2, $3)",
        &[
            &&theirs.salt[..],
            &theirs.created_at.as_i64(),
            &&theirs.identity.as_bytes()[..],
        ],
    )
    .await
    .unwrap();
    let holder: i32 = tx.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    let asking = tokio::spawn({
        let store = store.clone();
        async move { store.scope_salt(ScopeSalt::random(now)).await }
    });
    // Another connection: statistics read inside the open transaction would be its snapshot's.
    let watcher = schema.client().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: bool = watcher
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid)))",
                &[&holder],
            )
            .await
            .unwrap()
            .get(0);
        if waiting {
            break;
        }
        assert!(
            !asking.is_finished(),
            "scope_salt did not wait for the uncommitted salt"
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "scope_salt never waited for the other insert"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx.commit().await.unwrap();
    let salt = asking.await.expect("task").expect("scope_salt");
    assert_eq!(
        salt,
        ScopeSalt {
            older_records_until: None,
            ..theirs
        }
    );
}

/// Purging every record, and deleting one, leaves the salt as it was made, including when the
/// records written before it live until.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purging_keeps_the_salt() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let (fp, long_ago) = (fingerprint("a"), UnixMillis::now().minus(DAY * 40));
    let mut ids = Vec::new();
    for keep in [2, 7] {
        let id = fresh_id();
        let token = acquire(&store, &id, &fp, long_ago).await;
        store
            .complete(&id, token, completion(b"x", long_ago, DAY, DAY * keep))
            .await
            .expect("complete");
        ids.push(id);
    }
    let salt = store
        .scope_salt(ScopeSalt::random(UnixMillis::now()))
        .await
        .expect("scope_salt");
    assert_eq!(salt.older_records_until, Some(long_ago.plus(DAY * 7)));

    store.delete(&ids[0]).await.expect("delete");
    let far_future = UnixMillis::now().plus(Duration::from_secs(365 * 24 * 3600));
    while store.purge(far_future, 1000).await.expect("purge").total() > 0 {}
    assert!(
        store.get(&ids[1]).await.expect("get").is_none(),
        "the records are purged"
    );

    let again = schema.connect("").await;
    assert_eq!(
        again
            .scope_salt(ScopeSalt::random(UnixMillis::now()))
            .await
            .expect("scope_salt"),
        salt
    );
}

/// A salt of a length the hash cannot use is a corrupt store, not a salt to use or replace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salt_of_the_wrong_length_is_corrupt() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    schema
        .client()
        .await
        .batch_execute("INSERT INTO idem_scope_salt VALUES (1, '\\x00112233', 1, NULL)")
        .await
        .unwrap();
    let err = store
        .scope_salt(ScopeSalt::random(UnixMillis::now()))
        .await
        .expect_err("a 4-byte salt");
    match &err {
        StoreError::Corrupt(detail) => assert!(detail.contains("4 bytes"), "{detail}"),
        other => panic!("expected a corrupt store, got {other:?}"),
    }
}
