//! Purging with several instances: one purger at a time per schema, nothing counted twice, and a
//! purger that finds the lock taken does nothing rather than wait.

use std::sync::Arc;
use std::time::Duration;

use idem_core::testkit::{DAY, acquire, completion, fingerprint, fresh_id};
use idem_core::{
    Store, UnixMillis,
    store::{Purged, RecordId},
};
use idem_postgres::PostgresStore;
use idem_test_support::postgres_store::TestSchema;

const DUE: usize = 120;

/// `DUE` records past their `purge_at` (completed 40 days ago) and a few live ones.
async fn records(store: &PostgresStore) -> (Vec<RecordId>, Vec<RecordId>) {
    let now = UnixMillis::now();
    (
        completed(store, DUE, now.minus(DAY * 40)).await,
        completed(store, 5, now).await,
    )
}

/// `n` records completed at `at`, kept a week after their day.
async fn completed(store: &PostgresStore, n: usize, at: UnixMillis) -> Vec<RecordId> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let id = fresh_id();
        let token = acquire(store, &id, &fingerprint("a"), at).await;
        store
            .complete(&id, token, completion(b"x", at, DAY, 7 * DAY))
            .await
            .expect("complete");
        ids.push(id);
    }
    ids
}

/// A transaction on `client` that holds its schema's purge lock, as another instance in the middle
/// of a purge does.
async fn purging(client: &mut tokio_postgres::Client) -> tokio_postgres::Transaction<'_> {
    let purging = client.transaction().await.unwrap();
    let locked: bool = purging
        .query_one(
            "SELECT pg_try_advisory_xact_lock(1768187245, hashtext(current_schema()))",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(locked);
    purging
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_purgers_at_once_delete_each_record_once() {
    let schema = TestSchema::new();
    let (a, b) = (schema.connect("").await, schema.connect("").await);
    let (due, live) = records(&a).await;
    for _ in 0..5 {
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let purges: Vec<_> = [a.clone(), b.clone()]
            .into_iter()
            .map(|store| {
                let barrier = Arc::clone(&barrier);
                tokio::spawn(async move {
                    barrier.wait().await;
                    store.purge(UnixMillis::now(), 1000).await
                })
            })
            .collect();
        let mut deleted = 0;
        for purge in purges {
            deleted += purge.await.expect("task").expect("purge").deleted;
        }
        if deleted > 0 {
            assert_eq!(deleted, DUE as u64, "every due record is deleted, and once");
            break;
        }
        // Both found the other holding the lock (possible only if something else purged): again.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for id in &due {
        assert!(a.get(id).await.expect("get").is_none(), "due records are gone");
    }
    for id in &live {
        assert!(a.get(id).await.expect("get").is_some(), "live records stay");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purger_does_not_wait_for_another() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let (due, _) = records(&store).await;

    // Another instance in the middle of a purge holds the schema's purge lock.
    let mut other = schema.client().await;
    let purging = purging(&mut other).await;
    let started = std::time::Instant::now();
    assert_eq!(
        store.purge(UnixMillis::now(), 1000).await.expect("purge"),
        Purged::default(),
        "the lock is taken: nothing to do"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "purge did not wait for the lock"
    );
    purging.rollback().await.unwrap();

    let purged = store.purge(UnixMillis::now(), 1000).await.expect("purge");
    assert_eq!(purged.deleted, DUE as u64);
    assert!(store.get(&due[0]).await.expect("get").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_locks_of_other_schemas_do_not_interfere() {
    let (mine, theirs) = (TestSchema::new(), TestSchema::new());
    let store = mine.connect("").await;
    drop(theirs.connect("").await);
    let (due, _) = records(&store).await;

    let mut other = theirs.client().await;
    let purging = purging(&mut other).await;
    let purged = store.purge(UnixMillis::now(), 1000).await.expect("purge");
    assert_eq!(
        purged.deleted,
        due.len() as u64,
        "another schema's purger does not block this one"
    );
    purging.rollback().await.unwrap();
}
