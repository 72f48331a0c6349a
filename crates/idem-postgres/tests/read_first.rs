//! Replays read on the store's shared read connections (`read_first`): they are read there, and
//! losing that connection loses no replay: the store claims on its pool meanwhile and connects
//! again.

use std::time::Duration;

use idem_core::testkit::{DAY, acquire, begin, completion, fingerprint, fresh_id};
use idem_core::{Fingerprint, Store, UnixMillis, store::Begin, store::RecordId};
use idem_postgres::PostgresStore;
use idem_test_support::postgres_store::TestSchema;
use idem_test_support::relay::Relay;

/// The backend of the store's shared read connection (`<application_name> reads`; the newest, if
/// an old one lingers), and when it last changed state (ran a statement).
async fn reads_backend(client: &tokio_postgres::Client, name: &str) -> Option<(i32, std::time::SystemTime)> {
    client
        .query_opt(
            "SELECT pid, state_change FROM pg_stat_activity WHERE application_name = $1 AND state_change IS NOT NULL
             ORDER BY backend_start DESC LIMIT 1",
            &[&format!("{name} reads")],
        )
        .await
        .unwrap()
        .map(|row| (row.get(0), row.get(1)))
}

/// A store on a new schema with `options`, its connections named `<prefix><process id>` (the name,
/// returned), and a plain client to watch its backends with.
async fn named_store(prefix: &str, options: &str) -> (TestSchema, String, PostgresStore, tokio_postgres::Client) {
    let schema = TestSchema::new();
    let name = format!("{prefix}{}", std::process::id());
    let store = schema.connect(&format!("{options}&application_name={name}")).await;
    let client = schema.client().await;
    (schema, name, store, client)
}

/// A new record, completed with an answer.
async fn completed(store: &dyn Store, id: &RecordId, fp: &Fingerprint, now: UnixMillis) {
    let token = acquire(store, id, fp, now).await;
    store
        .complete(id, token, completion(b"paid", now, DAY, 2 * DAY))
        .await
        .expect("complete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_are_read_on_the_shared_connection_and_outlive_losing_it() {
    let (_schema, name, store, client) = named_store("rf", "read_first=always&read_connections=1").await;
    let (id, fp, now) = (fresh_id(), fingerprint("{}"), UnixMillis::now());
    completed(&store, &id, &fp, now).await;
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

/// With `read_first=auto` (the default) a store opens its read connections only once replays are
/// most of its recent `begin`s, and claims first again once new keys are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_connections_open_when_replays_are_most_of_the_traffic() {
    let (_schema, name, store, client) = named_store("rfa", "read_connections=1").await;
    let (fp, now) = (fingerprint("{}"), UnixMillis::now());
    let mut ids = Vec::new();
    for _ in 0..20 {
        let id = fresh_id();
        completed(&store, &id, &fp, now).await;
        ids.push(id);
    }
    assert_eq!(
        reads_backend(&client, &name).await,
        None,
        "new keys open no read connection"
    );

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut rounds = 0;
    let (pid, mut seen) = loop {
        for id in &ids {
            assert!(matches!(begin(&store, id, &fp, now).await.0, Begin::Existing(_)));
        }
        rounds += 1;
        if let Some(found) = reads_backend(&client, &name).await {
            break found;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no read connection after {rounds} rounds of replays"
        );
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    for id in &ids {
        assert!(matches!(begin(&store, id, &fp, now).await.0, Begin::Existing(_)));
    }
    let (same, after) = reads_backend(&client, &name).await.expect("still open");
    assert_eq!(same, pid);
    assert!(after > seen, "the replays were read on it");
    seen = after;

    // New keys again: once they are most of the recent begins, they are claimed first, and the
    // read connection sits idle.
    for _ in 0..20 {
        acquire(&store, &fresh_id(), &fp, now).await;
    }
    let (_, settled) = reads_backend(&client, &name).await.expect("still open");
    assert!(
        settled > seen,
        "the first new keys after the replays were still read first"
    );
    seen = settled;
    tokio::time::sleep(Duration::from_millis(20)).await;
    for _ in 0..5 {
        acquire(&store, &fresh_id(), &fp, now).await;
    }
    let (_, idle) = reads_backend(&client, &name).await.expect("still open");
    assert_eq!(idle, seen, "new keys are not read first");
}

/// A shared read connection that stops answering (a frozen backend, a flow dropped without a
/// word) holds a replay up for at most the read's timeout: it is then claimed on the pool, the
/// connection is closed and made again, and the requests after it are not held up at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_read_connection_holds_a_replay_up_for_a_second_at_most() {
    let schema = TestSchema::new();
    let name = format!("rfh{}", std::process::id());
    let options = &format!("read_first=always&read_connections=1&application_name={name}");
    let client = schema.client().await;
    let (upstream, _) = schema.through(0, options);
    let relay = Relay::start(upstream).await;
    let (_, url) = schema.through(relay.addr().port(), options);
    let store = PostgresStore::connect(&url).await.expect("connect through the relay");
    let (fp, now) = (fingerprint("{}"), UnixMillis::now());
    let (hung, other) = (fresh_id(), fresh_id());
    for id in [&hung, &other] {
        completed(&store, id, &fp, now).await;
    }

    let (first, _) = reads_backend(&client, &name).await.expect("the read connection");

    // The read of `hung` goes out on the shared connection (the pool's claim of the same key,
    // a second later, is outside the window): its replies are held for a minute.
    relay.hold_replies_after(
        hung.key.as_str().as_bytes(),
        Duration::from_secs(60),
        Duration::from_millis(500),
    );
    let started = tokio::time::Instant::now();
    let replay = begin(&store, &hung, &fp, now).await.0;
    assert!(matches!(replay, Begin::Existing(_)), "{replay:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "held up for the read's timeout, then claimed on the pool: {took:?}"
    );

    // The hung connection is out of use: the next replay and a new key do not wait for it.
    let started = tokio::time::Instant::now();
    assert!(matches!(begin(&store, &other, &fp, now).await.0, Begin::Existing(_)));
    assert!(matches!(
        begin(&store, &fresh_id(), &fp, now).await.0,
        Begin::Acquired { .. }
    ));
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );

    // And another read connection is made: it answers replays again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let (again, before) = loop {
        match reads_backend(&client, &name).await {
            Some((pid, at)) if pid != first => break (pid, at),
            _ => {}
        }
        assert!(tokio::time::Instant::now() < deadline, "no new read connection");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(matches!(begin(&store, &other, &fp, now).await.0, Begin::Existing(_)));
    let (pid, after) = reads_backend(&client, &name).await.expect("the new read connection");
    assert_eq!(pid, again);
    assert!(after > before, "the replay was read on the new connection");
}
