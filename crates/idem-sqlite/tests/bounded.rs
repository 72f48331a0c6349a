//! Another process's writing transaction holds the SQLite file's lock: claims fail within the store
//! timeout, each on its own, never queued behind each other's busy waits; once the lock is gone,
//! claims work again. The neighbour is a connection of this test, as another process's would be.

use std::sync::Arc;
use std::time::Duration;

use idem_core::store::FencingToken;
use idem_core::testkit::{acquire, claim, fingerprint, fresh_id};
use idem_core::{Store, StoreError, UnixMillis};
use idem_sqlite::SqliteStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_fail_within_the_bound_while_another_process_holds_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let store = Arc::new(SqliteStore::open(&path).await.unwrap());
    store.bound_operations(Duration::from_millis(300));
    let neighbour = rusqlite::Connection::open(&path).unwrap();
    neighbour.execute_batch("BEGIN IMMEDIATE").unwrap();

    let (fp, now) = (fingerprint("{}"), UnixMillis::now());
    let claims: Vec<_> = (0..8)
        .map(|_| {
            let (store, fp) = (Arc::clone(&store), fp.clone());
            tokio::spawn(async move {
                let id = fresh_id();
                store
                    .begin(claim(&id, &fp, now, FencingToken::random()))
                    .await
                    .map(drop)
            })
        })
        .collect();
    // Eight claims that each waited out a busy wait of its own after the others' would take 8
    // bounds (and, before the bound, 8 × 10 s): they fail together, within a few bounds.
    let failed = tokio::time::timeout(Duration::from_secs(3), async {
        let mut failed = Vec::new();
        for claim in claims {
            failed.push(claim.await.unwrap());
        }
        failed
    })
    .await
    .expect("the claims queued behind each other's busy waits");
    for claim in failed {
        // Locked: it waited out its busy wait; unavailable: its bound passed while it queued.
        assert!(
            matches!(claim, Err(StoreError::Locked | StoreError::Unavailable(_))),
            "{claim:?}"
        );
    }

    neighbour.execute_batch("ROLLBACK").unwrap();
    acquire(&*store, &fresh_id(), &fp, now).await;
}
