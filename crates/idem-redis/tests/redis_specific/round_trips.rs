//! What each call costs the server: a replay is one round trip that writes nothing (its count is
//! written later, in batches, for every instance to see), a new key deletes nothing, and calls
//! that find a script missing load it once between them.

use std::time::{Duration, Instant};

use idem_core::store::{Begin, FencingToken, RecordId, RecordState};
use idem_core::testkit::{self, DAY, Harness, fingerprint, fresh_id};
use idem_core::{Store, UnixMillis};
use idem_redis::{RecordKeys, RedisStore};
use idem_test_support::private::PrivateRedis;

use crate::common::{RedisHarness, Server, connect};
use crate::{claim, completed, completion, fresh_store, present, query};

/// A replay is one call to the store, and it brings the answer with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_one_round_trip_with_the_answer() {
    let harness = RedisHarness::standalone();
    let store = Harness::open(&harness).await;
    let (id, now) = (fresh_id(), UnixMillis::now());
    let token = claim(&*store, &id, now).await;
    store
        .complete(&id, token, completion(now, DAY, 7 * DAY))
        .await
        .expect("complete");
    let counting = testkit::counting(store);
    let fp = fingerprint("a");
    let request = testkit::claim(&id, &fp, now, FencingToken::random());
    let Begin::Existing(record) = counting.begin(request).await.expect("begin") else {
        panic!("expected the stored record")
    };
    assert_eq!(record.replays, 1);
    assert!(matches!(
        record.state,
        RecordState::Completed { response: Some(ref body), .. } if body.as_ref() == b"answer"
    ));
    assert_eq!(counting.total(), 1);
}

/// Replays `id` (the suite's request) at `now`; returns the replay count the store answered with.
async fn replay(store: &RedisStore, id: &RecordId, now: UnixMillis) -> u64 {
    let fp = fingerprint("a");
    let request = testkit::claim(id, &fp, now, FencingToken::random());
    match store.begin(request).await.expect("begin") {
        Begin::Existing(record) => record.replays,
        other => panic!("expected the stored answer, got {other:?}"),
    }
}

/// The stored `replays` field of a record, as another client reads it.
fn stored_replays(server: Server, keys: &RecordKeys) -> Option<u64> {
    query(server, redis::cmd("HGET").arg(&keys.record).arg("replays"))
}

/// Waits until the record's stored count is `expected` (10 s at most).
async fn until_stored_replays(server: Server, keys: &RecordKeys, expected: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let written = stored_replays(server, keys).expect("the record");
        if written == expected {
            return;
        }
        assert!(written < expected, "{written} replays written, {expected} made");
        assert!(
            Instant::now() < deadline,
            "only {written} of {expected} replays were written"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A replay writes nothing on its way: its count stays in the instance that answered it, which shows
/// it at once, and reaches the record a moment later in a batch, for every instance to see. A
/// dropped store writes what it counted last. A count for a record that is gone makes no key.
async fn replay_counts_reach_the_record_for_every_instance(server: Server) {
    let (one, cleanup) = fresh_store(server, "").await;
    let other = connect(server, &cleanup.1, "").await;
    let (id, now) = (fresh_id(), UnixMillis::now());
    let keys = one.record_keys(&id);
    let token = claim(&one, &id, now).await;
    one.complete(&id, token, completion(now, DAY, 7 * DAY))
        .await
        .expect("complete");
    for made in 1..=5 {
        assert_eq!(replay(&one, &id, now).await, made, "each replay sees its own count");
    }
    assert_eq!(replay(&other, &id, now).await, 1);
    assert_eq!(replay(&other, &id, now).await, 2);
    assert_eq!(one.get(&id).await.unwrap().unwrap().replays, 5, "its own, at once");

    until_stored_replays(server, &keys, 7).await;
    assert_eq!(other.get(&id).await.unwrap().unwrap().replays, 7);
    assert_eq!(one.get(&id).await.unwrap().unwrap().replays, 7);

    replay(&one, &id, now).await;
    drop(one);
    until_stored_replays(server, &keys, 8).await;

    // Counted, then the record is deleted behind the store's back: the count is dropped, and
    // makes no key without an expiry.
    replay(&other, &id, now).await;
    let deleted: i64 = query(server, redis::cmd("DEL").arg(&keys.record));
    assert_eq!(deleted, 1);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        present(server, &[&keys.record]),
        0,
        "a replay count made the record's key again"
    );
}

on_both_servers! {
    replay_counts_reach_the_record_for_every_instance =>
        standalone_replay_counts_reach_the_record_for_every_instance,
        cluster_replay_counts_reach_the_record_for_every_instance;
}

/// How many changes the server made to its data since it started (it never saves): every write
/// command, in a script or not, adds to it.
fn changes(url: &str) -> u64 {
    let client = redis::Client::open(url).expect("client");
    let mut conn = client.get_connection().expect("connection");
    let info: String = redis::cmd("INFO").arg("persistence").query(&mut conn).expect("INFO");
    info.lines()
        .find_map(|line| line.strip_prefix("rdb_changes_since_last_save:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no rdb_changes_since_last_save in {info}"))
}

/// A replay writes nothing: on a server of its own, where nothing else writes, replays leave the
/// server's count of changes where it was until the batch of counts is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_writes_nothing() {
    let redis = PrivateRedis::start();
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    let (id, now) = (fresh_id(), UnixMillis::now());
    completed(&store, &id, 7 * DAY).await;
    // Past the flush of anything counted so far.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let before = changes(&url);
    for made in 1..=20 {
        assert_eq!(replay(&store, &id, now).await, made);
    }
    let after = changes(&url);
    assert!(
        after <= before + 1,
        "20 replays made {} changes (one is allowed: a batch of counts written meanwhile)",
        after - before
    );
}

/// The calls a new key's `begin` and `complete` make inside their scripts (`INFO commandstats`
/// of a private server): a key without checkpoints deletes nothing (a record's body and
/// checkpoints never outlive it, so a new one has none to clear, and `complete` deletes the
/// checkpoints only when the run recorded some). Every call costs the server's one thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_without_checkpoints_deletes_nothing() {
    let redis = PrivateRedis::start();
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    let client = redis::Client::open(url.as_str()).expect("the private server's URL");
    let mut admin = client.get_multiplexed_async_connection().await.expect("connect");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await
        .expect("CONFIG RESETSTAT");
    let now = UnixMillis::now();
    for _ in 0..10 {
        let id = fresh_id();
        let token = claim(&store, &id, now).await;
        store
            .complete(&id, token, completion(now, DAY, 7 * DAY))
            .await
            .expect("complete");
    }
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut admin)
        .await
        .expect("INFO");
    // Calls that ran: a script's first `EVALSHA` on a fresh server fails (`NOSCRIPT`) and is sent
    // again with the script.
    let calls = |command: &str| calls_that_ran(&stats, command);
    assert_eq!(calls("evalsha") + calls("eval"), 20, "two scripts per key:\n{stats}");
    assert_eq!(calls("del") + calls("unlink"), 0, "no DEL:\n{stats}");
    assert_eq!(calls("hset"), 20, "one HSET in each script:\n{stats}");
}

/// How many calls of `command` ran (not failed) in `stats`, `INFO commandstats`' text.
fn calls_that_ran(stats: &str, command: &str) -> u64 {
    let Some(line) = stats
        .lines()
        .find(|line| line.starts_with(&format!("cmdstat_{command}:")))
    else {
        return 0;
    };
    let field = |name: &str| -> u64 {
        line.split([':', ','])
            .find_map(|part| part.strip_prefix(&format!("{name}=")))
            .map_or(0, |n| n.parse().expect("a count"))
    };
    field("calls") - field("failed_calls")
}

/// A server that does not know the scripts (new, restarted, a promoted replica, or after
/// `SCRIPT FLUSH`) answers every call in flight `NOSCRIPT` at once: they load each script once
/// between them, not once each (which would make the server compile it thousands of times at
/// the moment it is busiest), and every call still gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_that_find_a_script_missing_load_it_once_between_them() {
    const CALLS: usize = 64;
    let redis = PrivateRedis::start();
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    let client = redis::Client::open(url.as_str()).expect("the private server's URL");
    let admin = client.get_multiplexed_async_connection().await.expect("connect");
    // `SCRIPT LOAD`s since the last call.
    let loads_since_reset = async || -> u64 {
        let mut admin = admin.clone();
        let stats: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut admin)
            .await
            .expect("INFO");
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut admin)
            .await
            .expect("CONFIG RESETSTAT");
        calls_that_ran(&stats, "script|load")
    };
    loads_since_reset().await;

    // New keys, all at once, on a server that has never seen the scripts.
    let now = UnixMillis::now();
    let ids: Vec<RecordId> = (0..CALLS).map(|_| fresh_id()).collect();
    let tokens = futures_util::future::join_all(ids.iter().map(|id| claim(&store, id, now))).await;
    futures_util::future::join_all(ids.iter().zip(tokens).map(|(id, token)| {
        let store = &store;
        async move {
            store
                .complete(id, token, completion(now, DAY, 7 * DAY))
                .await
                .expect("complete")
        }
    }))
    .await;
    let loads = loads_since_reset().await;
    assert_eq!(
        loads, 2,
        "{CALLS} claims and {CALLS} completions loaded their two scripts {loads} times"
    );

    // The server forgets its scripts; the same keys are replayed, all at once.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut admin.clone())
        .await
        .expect("SCRIPT FLUSH");
    let digest = fingerprint("a");
    let replays = futures_util::future::join_all(
        ids.iter()
            .map(|id| store.begin(testkit::claim(id, &digest, now, FencingToken::random()))),
    )
    .await;
    for replay in replays {
        match replay.expect("begin") {
            Begin::Existing(record) => assert!(
                matches!(&record.state, RecordState::Completed { response: Some(answer), .. } if answer[..] == b"answer"[..]),
                "{record:?}"
            ),
            other => panic!("expected the stored answer, got {other:?}"),
        }
    }
    let loads = loads_since_reset().await;
    assert!(
        (1..=2).contains(&loads),
        "{CALLS} replays loaded `begin` (and the replay counts their script) {loads} times"
    );
}
