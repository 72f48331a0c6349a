//! Replays read on the store's shared read connections (`read_first`): they are read there, and
//! losing that connection loses no replay: the store claims on its pool meanwhile and connects
//! again.

mod common;

use std::time::Duration;

use common::TestSchema;
use idem_core::testkit::{DAY, acquire, begin, completion, fingerprint, fresh_id};
use idem_core::{Store, UnixMillis, store::Begin};

/// The backend of the store's shared read connection (`<application_name> reads`), and when it
/// last changed state (ran a statement).
async fn reads_backend(client: &tokio_postgres::Client, name: &str) -> Option<(i32, std::time::SystemTime)> {
    client
        .query_opt(
            "SELECT pid, state_change FROM pg_stat_activity WHERE application_name = $1",
            &[&format!("{name} reads")],
        )
        .await
        .unwrap()
        .map(|row| (row.get(0), row.get(1)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_are_read_on_the_shared_connection_and_outlive_losing_it() {
    let schema = TestSchema::new();
    let name = format!("rf{}", std::process::id());
    let store = schema
        .connect(&format!("read_first=always&read_connections=1&application_name={name}"))
        .await;
    let client = schema.client().await;
    let (id, fp, now) = (fresh_id(), fingerprint("{}"), UnixMillis::now());
    let token = acquire(&store, &id, &fp, now).await;
    store
        .complete(&id, token, completion(b"paid", now, DAY, 2 * DAY))
        .await
        .expect("complete");
    let replay = || async {
        match begin(&store, &id, &fp, now).await.0 {
            Begin::Existing(record) => record,
            other => panic!("expected the stored answer, got {other:?}"),
        }
    };

    let (pid, before) = reads_backend(&client, &name)
        .await
        .expect("the store opened its read connection");
    tokio::time::sleep(Duration::from_millis(20)).await;
    for _ in 0..5 {
        replay().await;
    }
    let (same, after) = reads_backend(&client, &name).await.expect("still there");
    assert_eq!(same, pid);
    assert!(after > before, "the replays were read on the shared connection");

    // The connection is killed: every replay is still answered, from the pool, and the store
    // connects again.
    let killed: bool = client
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert!(killed);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut replays = 6;
    let again = loop {
        let record = replay().await;
        assert_eq!(record.replays, replays, "every replay is answered and counted");
        replays += 1;
        match reads_backend(&client, &name).await {
            Some((new_pid, _)) if new_pid != pid => break new_pid,
            _ => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the read connection did not come back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (_, before) = reads_backend(&client, &name).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    replay().await;
    let (pid, after) = reads_backend(&client, &name).await.unwrap();
    assert_eq!(pid, again);
    assert!(after > before, "replays are read on the new connection");

    // A new key is claimed as ever.
    let other = fresh_id();
    assert!(matches!(
        begin(&store, &other, &fp, now).await.0,
        Begin::Acquired { .. }
    ));

    // Dropping the store closes its read connection.
    drop(store);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while reads_backend(&client, &name).await.is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the read connection outlived its store"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
