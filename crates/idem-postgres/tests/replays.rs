//! A replay is one read: it takes no row lock and writes nothing on its way, and its count reaches
//! the row a moment later, in a batch, for every instance to see.

use std::time::Duration;

use idem_core::testkit::{DAY, acquire, begin, completion, fingerprint, fresh_id};
use idem_core::{
    Fingerprint, Store, UnixMillis,
    store::{Begin, RecordId},
};
use idem_test_support::chain;
use idem_test_support::postgres_store::TestSchema;
use idem_test_support::relay::{Fault, Relay};

/// A new record, completed with an answer: its id, its fingerprint and the time of its claim.
async fn completed(store: &dyn Store) -> (RecordId, Fingerprint, UnixMillis) {
    let (id, fp, now) = (fresh_id(), fingerprint("{}"), UnixMillis::now());
    let token = acquire(store, &id, &fp, now).await;
    store
        .complete(&id, token, completion(b"paid", now, DAY, 2 * DAY))
        .await
        .expect("complete");
    (id, fp, now)
}

/// A transaction holding the record's row lock (a purge, an operator's `SELECT ... FOR UPDATE`, a
/// stuck migration) does not hold up its replays: they are answered while the lock is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_are_answered_while_another_transaction_holds_the_row() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let (id, fp, now) = completed(&store).await;

    let holder = schema.hold_row(&id, "FOR UPDATE").await;
    for replays in 1..=3 {
        // The lock is held until the end of the test: a replay that needed it would never come.
        let replay = tokio::time::timeout(Duration::from_secs(10), begin(&store, &id, &fp, now))
            .await
            .expect("a replay waited for the row lock");
        match replay.0 {
            Begin::Existing(record) => assert_eq!(record.replays, replays),
            other => panic!("expected the stored answer, got {other:?}"),
        }
    }
    holder.batch_execute("ROLLBACK").await.unwrap();
}

/// Replays counted by one instance reach the row, where another instance reads them; the counting
/// instance shows them at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_counts_reach_the_row_for_every_instance() {
    let schema = TestSchema::new();
    let (one, other) = (schema.connect("").await, schema.connect("").await);
    let (id, fp, now) = completed(&one).await;
    for _ in 0..5 {
        begin(&one, &id, &fp, now).await;
    }
    for _ in 0..2 {
        begin(&other, &id, &fp, now).await;
    }
    assert_eq!(one.get(&id).await.unwrap().unwrap().replays, 5, "its own, at once");

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let client = schema.client().await;
    loop {
        let written = written(&client, &id).await;
        if written == 7 {
            break;
        }
        assert!(written < 7, "{written} replays written, 7 made");
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {written} of 7 replays were written"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(other.get(&id).await.unwrap().unwrap().replays, 7);
    // A store that is dropped writes what it counted.
    begin(&one, &id, &fp, now).await;
    drop(one);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while other.get(&id).await.unwrap().unwrap().replays != 8 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the last replay was never written"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The replays written in the record's row.
async fn written(client: &tokio_postgres::Client, id: &RecordId) -> i64 {
    client
        .query_one(
            "SELECT replays FROM idem_records WHERE scope = $1 AND key = $2",
            &[&id.scope.as_str(), &id.key.as_str()],
        )
        .await
        .unwrap()
        .get(0)
}

/// A blip while counted replays are written loses none of them: the connection is reset as the
/// batch leaves for the server (the statement never reaches it), and the next round writes the
/// counts, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_counts_outlive_a_reset_while_they_are_written() {
    let schema = TestSchema::new();
    let options = "poll_interval=60s";
    let (upstream, _) = schema.through(0, options);
    let relay = Relay::start(upstream).await;
    let (_, url) = schema.through(relay.addr().port(), options);
    let store = idem_postgres::PostgresStore::connect(&url)
        .await
        .unwrap_or_else(|err| panic!("{}", chain(&err)));
    let (id, fp, now) = completed(&store).await;
    // The batch's statement is prepared on the connection that first runs it: the reset strikes
    // its text on its way to the server.
    relay.arm_on(b"unnest($1::text[]", Fault::ResetBeforeForward);
    for _ in 0..3 {
        let (replayed, _) = begin(&store, &id, &fp, now).await;
        assert!(matches!(replayed, Begin::Existing(_)), "{replayed:?}");
    }

    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while relay.faults().resets_before == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the batch of counts was never sent"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let client = schema.client().await;
    assert_eq!(written(&client, &id).await, 0, "the reset batch reached the server");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while written(&client, &id).await != 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the counts were lost: {} of 3 written",
            written(&client, &id).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Past two more rounds: written once, not again.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(written(&client, &id).await, 3);
    assert_eq!(store.get(&id).await.unwrap().unwrap().replays, 3);
}

/// Writing counted replays never queues on a record's row lock (a handler's transaction completing
/// a record of that key, an operator's delete): the row is skipped and its count kept for the next
/// round, so the other rows' counts are written meanwhile, and a pooled connection is not held
/// waiting. The store here has no statement bound: a write that waited would wait for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_row_holds_up_no_replay_count() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let (locked, locked_fp, now) = completed(&store).await;
    let (free, free_fp, _) = completed(&store).await;
    let holder = schema.hold_row(&locked, "FOR UPDATE").await;
    begin(&store, &locked, &locked_fp, now).await;
    begin(&store, &free, &free_fp, now).await;

    let client = schema.client().await;
    let written_at_last = async |id: &RecordId, what: &str| {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while written(&client, id).await != 1 {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    written_at_last(&free, "the count of a free row waited for another row's lock").await;
    assert_eq!(written(&client, &locked).await, 0, "the locked row was not written");
    holder.batch_execute("ROLLBACK").await.unwrap();
    written_at_last(&locked, "the locked row's count was lost").await;
}
