//! What the conformance suite cannot see: that waiters are woken by notifications rather than by
//! polling, that a record's keys share one cluster slot, that expiry is native and relative to the
//! caller's clock, that checkpoints expire with their record, that waiters share one subscription,
//! that a store rides out an outage, that the scope salt counts the records on every node (and
//! only its prefix's), never expires and is checked when read, that replay counts are written
//! later, in batches, and that `list` leaves out the records it cannot name.
//!
//! The notification tests set `poll_interval=60s`: the first poll would come after 15 s, so a
//! waiter that returns within 10 s was woken by a message.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{RedisHarness, Server, connect, delete_keys, fresh_prefix};
use idem_core::testkit::{self, DAY, LEASE, fingerprint, fresh_id};
use idem_core::{
    Store, StoreError, UnixMillis,
    store::{
        Begin, BeginRequest, Checkpoint, Completion, FencingToken, ListQuery, Origin, RecordId, RecordState, Release,
        ScopeSalt, WaitOutcome,
    },
};
use idem_redis::{RecordKeys, RedisError, RedisStore};
use idem_test_support::private::PrivateRedis;
use idem_test_support::servers::free_port;

const HOUR: Duration = Duration::from_secs(3600);
const SLOW_POLLING: &str = "poll_interval=60s";

/// Deletes the prefix's keys when the test ends, whatever happens.
struct Cleanup(Server, String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        delete_keys(self.0, &self.1);
    }
}

async fn claim(store: &dyn Store, id: &RecordId, now: UnixMillis) -> FencingToken {
    let token = FencingToken::random();
    match store
        .begin(testkit::claim(id, &fingerprint("a"), now, token))
        .await
        .expect("begin")
    {
        Begin::Acquired { .. } => token,
        other => panic!("expected a claim, got {other:?}"),
    }
}

fn completion(at: UnixMillis, ttl: Duration, keep: Duration) -> Completion {
    testkit::completion(b"answer", at, ttl, keep)
}

/// Runs one command on the server (routed by key on a cluster).
fn query<T: redis::FromRedisValue>(server: Server, cmd: &redis::Cmd) -> T {
    let nodes = server.node_urls();
    match server {
        Server::Standalone => {
            let client = redis::Client::open(nodes[0].as_str()).expect("client");
            let mut conn = client.get_connection().expect("connection");
            cmd.query(&mut conn).expect("query")
        }
        Server::Cluster => {
            let client = redis::cluster::ClusterClient::new(nodes).expect("cluster client");
            let mut conn = client.get_connection().expect("cluster connection");
            cmd.query(&mut conn).expect("query")
        }
    }
}

fn pttl(server: Server, key: &str) -> i64 {
    query(server, redis::cmd("PTTL").arg(key))
}

fn assert_ttl_near(server: Server, key: &str, expected: Duration) {
    let actual = pttl(server, key);
    let expected = i64::try_from(expected.as_millis()).unwrap();
    assert!(
        (expected - 5_000..=expected).contains(&actual),
        "{key}: PTTL {actual} ms, expected about {expected} ms"
    );
}

/// A waiter on one connection is woken by a completion on another, without polling.
async fn completion_wakes_a_waiter(server: Server) {
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let holder = connect(server, &prefix, SLOW_POLLING).await;
    let waiter = Arc::new(connect(server, &prefix, SLOW_POLLING).await);
    let (id, now) = (fresh_id(), UnixMillis::now());
    let token = claim(&holder, &id, now).await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let wait = {
        let (waiter, id) = (Arc::clone(&waiter), id.clone());
        tokio::spawn(async move { waiter.wait(&id, token, deadline).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!wait.is_finished(), "the waiter waits while the claim is held");
    let started = Instant::now();
    holder
        .complete(&id, token, completion(UnixMillis::now(), DAY, 7 * DAY))
        .await
        .expect("complete");
    let outcome = tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .expect("the waiter was not woken within 10 s: the notification was lost")
        .expect("task")
        .expect("wait");
    assert_eq!(outcome, WaitOutcome::Changed);
    eprintln!("{server:?}: woken {:?} after the completion", started.elapsed());
}

/// A takeover of an expired lease wakes the waiters of the old claim, without polling.
async fn takeover_wakes_a_waiter(server: Server) {
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let holder = connect(server, &prefix, SLOW_POLLING).await;
    let waiter = Arc::new(connect(server, &prefix, SLOW_POLLING).await);
    let (id, now) = (fresh_id(), UnixMillis::now());
    let first = claim(&holder, &id, now).await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let wait = {
        let (waiter, id) = (Arc::clone(&waiter), id.clone());
        tokio::spawn(async move { waiter.wait(&id, first, deadline).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!wait.is_finished());
    let later = now.plus(LEASE * 2);
    let token = FencingToken::random();
    let request = BeginRequest {
        id: &id,
        fingerprint: &fingerprint("a"),
        now: later,
        lease_until: later.plus(LEASE),
        expires_at: later.plus(std::time::Duration::from_secs(24 * 3600)),
        purge_at: later.plus(std::time::Duration::from_secs(7 * 24 * 3600)),
        token,
        origin: testkit::origin(),
        identity: None,
    };
    assert!(matches!(
        holder.begin(request).await.expect("begin"),
        Begin::Acquired { recovered: true }
    ));
    let outcome = tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .expect("the waiter was not woken within 10 s: the notification was lost")
        .expect("task")
        .expect("wait");
    assert_eq!(outcome, WaitOutcome::Changed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_completion_wakes_a_waiter_without_polling() {
    completion_wakes_a_waiter(Server::Standalone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_completion_wakes_a_waiter_without_polling() {
    completion_wakes_a_waiter(Server::Cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_takeover_wakes_a_waiter_without_polling() {
    takeover_wakes_a_waiter(Server::Standalone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_takeover_wakes_a_waiter_without_polling() {
    takeover_wakes_a_waiter(Server::Cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keys_of_a_record_share_one_slot() {
    let server = Server::Cluster;
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let store = connect(server, &prefix, "").await;
    assert!(store.is_cluster());
    let mut slots = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let (id, now) = (fresh_id(), UnixMillis::now());
        let token = claim(&store, &id, now).await;
        store
            .complete(&id, token, completion(now, DAY, 7 * DAY))
            .await
            .expect("complete");
        let keys = store.record_keys(&id);
        let slot = |key: &str| -> i64 { query(server, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key)) };
        let record_slot = slot(&keys.record);
        assert_eq!(record_slot, slot(&keys.body), "{keys:?}");
        assert_eq!(record_slot, slot(&keys.channel), "{keys:?}");
        let present: i64 = query(server, redis::cmd("EXISTS").arg(&keys.record).arg(&keys.body));
        assert_eq!(present, 2, "both keys are stored: {keys:?}");
        slots.insert(record_slot);
    }
    assert!(slots.len() > 1, "records spread over the cluster's slots: {slots:?}");
}

/// Expiry is native and follows the caller's clock, even a fake one 40 days in the past.
async fn expiry_is_native_and_relative(server: Server) {
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let store = connect(server, &prefix, "").await;
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
    let present: i64 = query(server, redis::cmd("EXISTS").arg(&keys.record).arg(&keys.body));
    assert_eq!(present, 0, "a forgotten record leaves no key");

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
    let present: i64 = query(server, redis::cmd("EXISTS").arg(&keys.body));
    assert_eq!(present, 0, "an answer past expires_at is not kept");
    assert_ttl_near(server, &keys.record, HOUR);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_expiry_is_native_and_relative_to_the_callers_clock() {
    expiry_is_native_and_relative(Server::Standalone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_expiry_is_native_and_relative_to_the_callers_clock() {
    expiry_is_native_and_relative(Server::Cluster).await;
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
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let store = connect(server, &prefix, "").await;
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
    let absent: i64 = query(server, redis::cmd("EXISTS").arg(&keys.checkpoints));
    assert_eq!(absent, 0, "no checkpoint, no key");
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
    let request = BeginRequest {
        id: &id,
        fingerprint: &fp,
        now: later,
        lease_until: later.plus(LEASE),
        expires_at: later.plus(std::time::Duration::from_secs(24 * 3600)),
        purge_at: later.plus(std::time::Duration::from_secs(7 * 24 * 3600)),
        token,
        origin: testkit::origin(),
        identity: None,
    };
    let taken = store.begin(request).await.expect("begin");
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
    let present: i64 = query(server, redis::cmd("EXISTS").arg(&keys.checkpoints));
    assert_eq!(present, 1, "a takeover keeps the checkpoints");
    store
        .complete(&id, token, completion(later, HOUR, 2 * HOUR))
        .await
        .expect("complete");
    let present: i64 = query(server, redis::cmd("EXISTS").arg(&keys.checkpoints));
    assert_eq!(present, 0, "completing deletes the checkpoints");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_checkpoints_share_the_records_tag_and_expire_with_it() {
    checkpoints_expire_with_their_record(Server::Standalone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_checkpoints_share_the_records_tag_and_expire_with_it() {
    checkpoints_expire_with_their_record(Server::Cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_one_store_share_one_subscription_and_leave_none() {
    let server = Server::Standalone;
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let holder = connect(server, &prefix, "").await;
    let waiter = Arc::new(connect(server, &prefix, SLOW_POLLING).await);
    let (id, now) = (fresh_id(), UnixMillis::now());
    let token = claim(&holder, &id, now).await;
    let channel = holder.record_keys(&id).channel;
    let subscribers = || -> i64 {
        let (_, count): (String, i64) = query(server, redis::cmd("PUBSUB").arg("NUMSUB").arg(&channel));
        count
    };

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let waits: Vec<_> = (0..5)
        .map(|_| {
            let (waiter, id) = (Arc::clone(&waiter), id.clone());
            tokio::spawn(async move { waiter.wait(&id, token, deadline).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(subscribers(), 1, "five waiters of one store, one subscription");
    holder
        .complete(&id, token, completion(UnixMillis::now(), DAY, 7 * DAY))
        .await
        .expect("complete");
    for wait in waits {
        let outcome = tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .expect("woken within 10 s")
            .expect("task")
            .expect("wait");
        assert_eq!(outcome, WaitOutcome::Changed);
    }
    let gone = Instant::now() + Duration::from_secs(5);
    while subscribers() != 0 {
        assert!(Instant::now() < gone, "the last waiter unsubscribes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A waiter that gives up (its future is dropped) unsubscribes too.
    let (id, now) = (fresh_id(), UnixMillis::now());
    let token = claim(&holder, &id, now).await;
    let channel = holder.record_keys(&id).channel;
    let far = tokio::time::Instant::now() + Duration::from_secs(30);
    let abandoned = tokio::time::timeout(Duration::from_millis(300), waiter.wait(&id, token, far)).await;
    assert!(abandoned.is_err(), "the wait was still waiting");
    let gone = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, count): (String, i64) = query(server, redis::cmd("PUBSUB").arg("NUMSUB").arg(&channel));
        if count == 0 {
            break;
        }
        assert!(Instant::now() < gone, "a cancelled waiter unsubscribes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_one_round_trip_with_the_answer() {
    let harness = RedisHarness::standalone();
    let store = idem_core::testkit::Harness::open(&harness).await;
    let (id, now) = (fresh_id(), UnixMillis::now());
    let token = claim(&*store, &id, now).await;
    store
        .complete(&id, token, completion(now, DAY, 7 * DAY))
        .await
        .expect("complete");
    let counting = idem_core::testkit::counting(store);
    let request = BeginRequest {
        id: &id,
        fingerprint: &fingerprint("a"),
        now,
        lease_until: now.plus(LEASE),
        expires_at: now.plus(std::time::Duration::from_secs(24 * 3600)),
        purge_at: now.plus(std::time::Duration::from_secs(7 * 24 * 3600)),
        token: FencingToken::random(),
        origin: testkit::origin(),
        identity: None,
    };
    let Begin::Existing(record) = counting.begin(request).await.expect("begin") else {
        panic!("expected the stored record")
    };
    assert_eq!(record.replays, 1);
    assert!(matches!(
        record.state,
        idem_core::store::RecordState::Completed { response: Some(ref body), .. } if body.as_ref() == b"answer"
    ));
    assert_eq!(counting.total(), 1);
}

#[tokio::test]
async fn connect_errors_say_what_is_wrong() {
    let port = free_port();
    let err = RedisStore::connect(&format!("redis://127.0.0.1:{port}"))
        .await
        .expect_err("nothing listens there");
    assert!(matches!(err, RedisError::Connect { .. }), "{err:?}");
    assert!(err.to_string().contains("refused"), "{err}");
    assert!(std::error::Error::source(&err).is_some(), "the cause is kept");

    let err = RedisStore::connect("redis://:hunter2@127.0.0.1:1?colour=blue")
        .await
        .expect_err("unknown option");
    assert!(matches!(err, RedisError::InvalidUrl { .. }), "{err:?}");
    assert!(!err.to_string().contains("hunter2"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_recovers_when_redis_comes_back() {
    let mut redis = PrivateRedis::start();
    let url = format!("{}?{SLOW_POLLING}", redis.url());
    let holder = RedisStore::connect(&url).await.expect("connect");
    let waiter = Arc::new(RedisStore::connect(&url).await.expect("connect"));
    let (id, now) = (fresh_id(), UnixMillis::now());
    claim(&holder, &id, now).await;

    redis.kill();
    // Down for a while: every operation fails, and fails fast, while the store keeps trying.
    let down = Instant::now();
    while down.elapsed() < Duration::from_secs(3) {
        let started = Instant::now();
        let err = holder.get(&id).await.expect_err("Redis is down");
        assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "fails fast: {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(waiter.ping().await.is_err());

    redis.restart();
    let back = Instant::now() + Duration::from_secs(20);
    for store in [&holder, &*waiter] {
        while let Err(err) = store.ping().await {
            assert!(Instant::now() < back, "the store did not reconnect: {err}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Nothing was persisted: the record is gone, and both stores work again, notifications
    // included.
    assert!(holder.get(&id).await.expect("get").is_none());
    let (id, now) = (fresh_id(), UnixMillis::now());
    let token = claim(&holder, &id, now).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let wait = {
        let (waiter, id) = (Arc::clone(&waiter), id.clone());
        tokio::spawn(async move { waiter.wait(&id, token, deadline).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    holder
        .complete(&id, token, completion(UnixMillis::now(), DAY, 7 * DAY))
        .await
        .expect("complete");
    let outcome = tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .expect("the waiter was not woken within 10 s after the reconnection")
        .expect("task")
        .expect("wait");
    assert_eq!(outcome, WaitOutcome::Changed);
    drop(redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_begin_gets_its_own_claim_back() {
    let harness = RedisHarness::standalone();
    let store = idem_core::testkit::Harness::open(&harness).await;
    let (id, now, fp) = (fresh_id(), UnixMillis::now(), fingerprint("a"));
    let request = |token, now: UnixMillis| BeginRequest {
        id: &id,
        fingerprint: &fp,
        now,
        lease_until: now.plus(LEASE),
        expires_at: now.plus(std::time::Duration::from_secs(24 * 3600)),
        purge_at: now.plus(std::time::Duration::from_secs(7 * 24 * 3600)),
        token,
        origin: testkit::origin(),
        identity: None,
    };
    let first = FencingToken::random();
    for _ in 0..2 {
        assert!(matches!(
            store.begin(request(first, now)).await.expect("begin"),
            Begin::Acquired { recovered: false }
        ));
    }
    let later = now.plus(LEASE * 2);
    let second = FencingToken::random();
    for _ in 0..2 {
        assert!(matches!(
            store.begin(request(second, later)).await.expect("begin"),
            Begin::Acquired { recovered: true }
        ));
    }
    assert!(matches!(
        store
            .begin(request(FencingToken::random(), later))
            .await
            .expect("begin"),
        Begin::Existing(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_records_are_reported_as_corrupt() {
    let server = Server::Standalone;
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let store = connect(server, &prefix, "").await;
    let id = fresh_id();
    let keys = store.record_keys(&id);
    let _: i64 = query(
        server,
        redis::cmd("HSET").arg(&keys.record).arg("state").arg("completed"),
    );
    let now = UnixMillis::now();
    let request = BeginRequest {
        id: &id,
        fingerprint: &fingerprint("a"),
        now,
        lease_until: now.plus(LEASE),
        expires_at: now.plus(std::time::Duration::from_secs(24 * 3600)),
        purge_at: now.plus(std::time::Duration::from_secs(7 * 24 * 3600)),
        token: FencingToken::random(),
        origin: testkit::origin(),
        identity: None,
    };
    let err = store.begin(request).await.expect_err("no purge_at");
    assert!(
        matches!(err, StoreError::Corrupt(ref why) if why.contains("purge_at")),
        "{err:?}"
    );
    let err = store.get(&id).await.expect_err("no fingerprint");
    assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");

    let err = store.delete(&id).await.expect_err("still unreadable");
    assert!(matches!(err, StoreError::Corrupt(_)), "{err:?}");
    let present: i64 = query(server, redis::cmd("EXISTS").arg(&keys.record));
    assert_eq!(present, 0, "an operator can clear a record the store cannot read");
    assert!(store.get(&id).await.expect("get").is_none());
}

/// A record damaged in ways a hash allows and the store never writes is corrupt too, never absent
/// and never the store being unavailable (which `fail-open` would run through): a hash without
/// `state` (whatever else it holds), a record key of another type than a hash, an answer's key of
/// another type than a string. `delete` clears each, and says the record was unreadable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_the_wrong_shape_are_corrupt_not_absent_or_unavailable() {
    let server = Server::Standalone;
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let store = connect(server, &prefix, "").await;
    let now = UnixMillis::now();
    // The commands that damage a record, given its keys.
    type Damage = fn(&RecordKeys) -> Vec<redis::Cmd>;
    let damages: [(&str, Damage); 3] = [
        ("no state", |keys| {
            vec![redis::cmd("HDEL").arg(&keys.record).arg("state").clone()]
        }),
        ("a string record", |keys| {
            vec![
                redis::cmd("DEL").arg(&keys.record).clone(),
                redis::cmd("SET").arg(&keys.record).arg("junk").clone(),
            ]
        }),
        ("a hash answer", |keys| {
            vec![
                redis::cmd("DEL").arg(&keys.body).clone(),
                redis::cmd("HSET").arg(&keys.body).arg("a").arg("b").clone(),
            ]
        }),
    ];
    for (damage, commands) in damages {
        let id = fresh_id();
        completed(&store, &id, DAY).await;
        let keys = store.record_keys(&id);
        for command in commands(&keys) {
            let _: redis::Value = query(server, &command);
        }
        let begun = store
            .begin(testkit::claim(&id, &fingerprint("a"), now, FencingToken::random()))
            .await;
        assert!(
            matches!(begun, Err(StoreError::Corrupt(_))),
            "{damage}: begin gave {begun:?}"
        );
        let read = store.get(&id).await;
        assert!(
            matches!(read, Err(StoreError::Corrupt(_))),
            "{damage}: get gave {read:?}"
        );
        if let Err(StoreError::Corrupt(why)) = &read {
            assert!(!why.contains("user_script"), "{damage}: no Lua internals: {why}");
        }
        let deleted = store.delete(&id).await;
        assert!(
            matches!(deleted, Err(StoreError::Corrupt(_))),
            "{damage}: delete gave {deleted:?}"
        );
        let left: i64 = query(server, redis::cmd("EXISTS").arg(&keys.record).arg(&keys.body));
        assert_eq!(left, 0, "{damage}: an operator can clear it");
        assert!(store.get(&id).await.expect("get").is_none(), "{damage}");
    }
}

/// Whether the node at `node_url` (one server, or one node of a cluster) holds `key` itself.
fn held_by(node_url: &str, key: &str) -> bool {
    let client = redis::Client::open(node_url).expect("client");
    let mut conn = client.get_connection().expect("connection");
    // A cluster node answers MOVED for a key of another node's slot.
    redis::cmd("EXISTS").arg(key).query::<i64>(&mut conn) == Ok(1)
}

/// A completed record under `store`, kept until `keep` from now; returns its `purge_at`.
async fn completed(store: &RedisStore, id: &RecordId, keep: Duration) -> UnixMillis {
    let now = UnixMillis::now();
    let token = claim(store, id, now).await;
    let done = completion(now, HOUR, keep);
    let purge_at = done.purge_at;
    store.complete(id, token, done).await.expect("complete");
    purge_at
}

/// A record written before records kept their scope, key and origin (no `origin`, `trace_id`,
/// `status` or `recovered` in its hash) still reads, with none of them; `list` cannot name it and
/// leaves it out, as it leaves out one whose `origin` does not read or names another record, and
/// lists the rest without failing.
async fn list_leaves_out_the_records_it_cannot_name(server: Server) {
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let store = connect(server, &prefix, "").await;
    let [named, old, garbled, impostor] = std::array::from_fn(|_| fresh_id());
    for id in [&named, &old, &garbled, &impostor] {
        completed(&store, id, 7 * DAY).await;
    }
    let record = |id: &RecordId| store.record_keys(id).record;
    let _: i64 = query(
        server,
        redis::cmd("HDEL")
            .arg(record(&old))
            .arg(&["origin", "trace_id", "status", "recovered"]),
    );
    let _: i64 = query(
        server,
        redis::cmd("HSET")
            .arg(record(&garbled))
            .arg("origin")
            .arg("not an origin"),
    );
    let named_origin: Vec<u8> = query(server, redis::cmd("HGET").arg(record(&named)).arg("origin"));
    let _: i64 = query(
        server,
        redis::cmd("HSET")
            .arg(record(&impostor))
            .arg("origin")
            .arg(named_origin),
    );

    let old_record = store
        .get(&old)
        .await
        .expect("an old record reads")
        .expect("it is there");
    assert_eq!(
        (&old_record.origin, old_record.recovered, old_record.status),
        (&Origin::default(), false, None)
    );
    assert!(
        matches!(old_record.state, RecordState::Completed { response: Some(_), .. }),
        "{old_record:?}"
    );
    let garbled_record = store
        .get(&garbled)
        .await
        .expect("a garbled origin reads")
        .expect("it is there");
    assert_eq!(
        (&garbled_record.origin, garbled_record.status),
        (&Origin::default(), Some(201)),
        "what does not read is left out, the rest is read"
    );

    let listed = store.list(&ListQuery::all(UnixMillis::now(), 100)).await.expect("list");
    let ids: Vec<_> = listed.into_iter().map(|listed| listed.id).collect();
    assert_eq!(ids, [named], "only the record the list can name, once");
}

/// A takeover names its own run: a request without a trace leaves none of the run before it, and
/// the record says the run was recovered after a release as unknown and a delete in flight too;
/// the request's method and path stay the first claim's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_names_its_own_run() {
    let harness = RedisHarness::standalone();
    let store = idem_core::testkit::Harness::open(&harness).await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let traced = Origin::new("PUT", "/orders/1", Some(testkit::run_trace(9)));
    let token = FencingToken::random();
    store
        .begin(BeginRequest {
            origin: &traced,
            ..testkit::claim(&id, &fp, now, token)
        })
        .await
        .expect("begin");
    store
        .release(&id, token, testkit::unknown_at(now))
        .await
        .expect("release");
    // `testkit::origin()` is another method and path, and no trace.
    let token = FencingToken::random();
    let taken = store.begin(testkit::claim(&id, &fp, now, token)).await.expect("begin");
    assert!(matches!(taken, Begin::Acquired { recovered: true }), "{taken:?}");
    let record = store.get(&id).await.expect("get").expect("the record");
    let untraced = Origin {
        trace: None,
        ..traced.clone()
    };
    assert_eq!((&record.origin, record.recovered), (&untraced, true));
    store
        .release(&id, token, testkit::unknown_at(now))
        .await
        .expect("release");
    let record = store.get(&id).await.expect("get").expect("the record");
    assert_eq!(
        (&record.origin, record.recovered),
        (&untraced, true),
        "a release keeps them"
    );
    let token = FencingToken::random();
    store
        .begin(BeginRequest {
            origin: &traced,
            ..testkit::claim(&id, &fp, now, token)
        })
        .await
        .expect("begin");
    store.delete(&id).await.expect("delete");
    let record = store.get(&id).await.expect("get").expect("unknown now");
    assert_eq!(
        (&record.origin, record.recovered),
        (&traced, true),
        "a delete in flight keeps them"
    );
}

/// An unknown outcome written before records kept their origin, taken over by a retry after the
/// upgrade, is named by that takeover: the recovered run an investigation looks for is listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_names_a_record_written_before_origins() {
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(Server::Standalone, prefix.clone());
    let store = connect(Server::Standalone, &prefix, "").await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let token = claim(&store, &id, now).await;
    store
        .release(&id, token, testkit::unknown_at(now))
        .await
        .expect("release");
    let record = store.record_keys(&id).record;
    let _: i64 = query(
        Server::Standalone,
        redis::cmd("HDEL")
            .arg(&record)
            .arg(&["origin", "trace_id", "recovered"]),
    );
    assert!(store.list(&ListQuery::all(now, 100)).await.expect("list").is_empty());

    let retry = Origin::new("POST", "/payments/7", Some(testkit::run_trace(4)));
    let token = FencingToken::random();
    let taken = store
        .begin(BeginRequest {
            origin: &retry,
            ..testkit::claim(&id, &fp, now, token)
        })
        .await
        .expect("begin");
    assert!(matches!(taken, Begin::Acquired { recovered: true }), "{taken:?}");
    let listed = store
        .list(&ListQuery {
            recovered: true,
            ..ListQuery::all(now, 100)
        })
        .await
        .expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        (&listed[0].id, &listed[0].origin, listed[0].recovered),
        (&id, &retry, true)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_list_leaves_out_the_records_it_cannot_name() {
    list_leaves_out_the_records_it_cannot_name(Server::Standalone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_list_leaves_out_the_records_it_cannot_name() {
    list_leaves_out_the_records_it_cannot_name(Server::Cluster).await;
}

/// The salt's `older_records_until` is exactly the latest `purge_at` of the store's records
/// wherever that record lives: one round per node (on a cluster, per primary), with the latest
/// record on that node. Records of neighbouring prefixes that a careless `SCAN MATCH` would take
/// for the store's own (a glob character in the prefix, a longer prefix starting with it) are not
/// counted. The salt's key has no expiry, and deleting records leaves it be.
async fn scope_salt_counts_every_node_and_only_its_prefix(server: Server) {
    for node in server.node_urls() {
        let prefix = format!("{}*", fresh_prefix());
        let _cleanup = Cleanup(server, prefix.clone());
        let neighbours = [prefix.replace('*', "x"), format!("{prefix}:sub")];
        let _cleanups: Vec<Cleanup> = neighbours.iter().map(|n| Cleanup(server, n.clone())).collect();
        for neighbour in &neighbours {
            let store = connect(server, neighbour, "").await;
            completed(&store, &fresh_id(), 90 * DAY).await;
        }

        let store = connect(server, &prefix, "").await;
        let (mut latest, mut written, mut on_node) = (None, 0, None);
        while on_node.is_none() || written < 6 {
            let id = fresh_id();
            let now = UnixMillis::now();
            let token = claim(&store, &id, now).await;
            written += 1;
            // The first record that lands on this node is kept longest; the others shorter.
            let the_latest = on_node.is_none() && held_by(&node, &store.record_keys(&id).record);
            let keep = if the_latest {
                30 * DAY
            } else {
                DAY + Duration::from_secs(60 * written)
            };
            let done = completion(now, HOUR, keep);
            if the_latest {
                (on_node, latest) = (Some(id.clone()), Some(done.purge_at));
            }
            store.complete(&id, token, done).await.expect("complete");
            assert!(written < 200, "no record landed on {node}");
        }

        let salt = store
            .scope_salt(ScopeSalt::random(UnixMillis::now()))
            .await
            .expect("scope_salt");
        assert_eq!(
            salt.older_records_until, latest,
            "{server:?}: the latest record is on {node}"
        );
        let key = format!("{prefix}:scope-salt");
        assert_eq!(pttl(server, &key), -1, "the salt never expires");
        let stored: Vec<u8> = query(server, redis::cmd("HGET").arg(&key).arg("salt"));
        assert_eq!(stored, salt.salt, "{key} holds the salt");

        store
            .delete(&on_node.expect("a record on the node"))
            .await
            .expect("delete");
        store
            .purge(UnixMillis::now().plus(365 * DAY), 1000)
            .await
            .expect("purge");
        let again = store
            .scope_salt(ScopeSalt::random(UnixMillis::now()))
            .await
            .expect("scope_salt");
        assert_eq!(again, salt, "the salt outlives the records it counted");
        assert_eq!(pttl(server, &key), -1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_scope_salt_counts_every_node_and_only_its_prefix() {
    scope_salt_counts_every_node_and_only_its_prefix(Server::Standalone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_scope_salt_counts_every_node_and_only_its_prefix() {
    scope_salt_counts_every_node_and_only_its_prefix(Server::Cluster).await;
}

/// A salt of the wrong length is reported as corrupt, never used. A record too corrupt to have a
/// `purge_at` (or not even a hash) is left out of `older_records_until` instead of keeping the
/// salt from being made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_scope_salt_is_reported_and_a_corrupt_record_left_out() {
    let server = Server::Standalone;
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let store = connect(server, &prefix, "").await;
    let key = format!("{prefix}:scope-salt");
    let _: i64 = query(
        server,
        redis::cmd("HSET")
            .arg(&key)
            .arg("salt")
            .arg("too short")
            .arg("created_at")
            .arg(1),
    );
    let err = store
        .scope_salt(ScopeSalt::random(UnixMillis::now()))
        .await
        .expect_err("a salt of 9 bytes");
    assert!(
        matches!(err, StoreError::Corrupt(ref why) if why.contains("9 bytes")),
        "{err:?}"
    );

    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let store = connect(server, &prefix, "").await;
    let broken = store.record_keys(&fresh_id());
    let _: i64 = query(
        server,
        redis::cmd("HSET")
            .arg(&broken.record)
            .arg("state")
            .arg("completed")
            .arg("purge_at")
            .arg("soon"),
    );
    let not_a_hash = store.record_keys(&fresh_id());
    let _: () = query(server, redis::cmd("SET").arg(&not_a_hash.record).arg("20991231"));
    let purge_at = completed(&store, &fresh_id(), 3 * DAY).await;
    let salt = store
        .scope_salt(ScopeSalt::random(UnixMillis::now()))
        .await
        .expect("scope_salt");
    assert_eq!(salt.older_records_until, Some(purge_at));
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

async fn replay(store: &RedisStore, id: &RecordId, now: UnixMillis) -> u64 {
    let request = BeginRequest {
        id,
        fingerprint: &fingerprint("a"),
        now,
        lease_until: now.plus(LEASE),
        expires_at: now.plus(std::time::Duration::from_secs(24 * 3600)),
        purge_at: now.plus(std::time::Duration::from_secs(7 * 24 * 3600)),
        token: FencingToken::random(),
        origin: testkit::origin(),
        identity: None,
    };
    match store.begin(request).await.expect("begin") {
        Begin::Existing(record) => record.replays,
        other => panic!("expected the stored answer, got {other:?}"),
    }
}

/// A replay writes nothing on its way: its count stays in the instance that answered it, which shows
/// it at once, and reaches the record a moment later in a batch, for every instance to see. A
/// dropped store writes what it counted last. A count for a record that is gone makes no key.
async fn replay_counts_reach_the_record_for_every_instance(server: Server) {
    let prefix = fresh_prefix();
    let _cleanup = Cleanup(server, prefix.clone());
    let (one, other) = (connect(server, &prefix, "").await, connect(server, &prefix, "").await);
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
    let exists: i64 = query(server, redis::cmd("EXISTS").arg(&keys.record));
    assert_eq!(exists, 0, "a replay count made the record's key again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_replay_counts_reach_the_record_for_every_instance() {
    replay_counts_reach_the_record_for_every_instance(Server::Standalone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_replay_counts_reach_the_record_for_every_instance() {
    replay_counts_reach_the_record_for_every_instance(Server::Cluster).await;
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
    let token = claim(&store, &id, now).await;
    store
        .complete(&id, token, completion(now, DAY, 7 * DAY))
        .await
        .expect("complete");
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

/// The pub/sub connection killed by the server (`CLIENT KILL TYPE pubsub`) and a delete made
/// before it is back: the replay cache does not keep the deleted answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_while_the_pubsub_connection_is_down_is_not_missed_by_the_replay_cache() {
    let redis = PrivateRedis::start();
    let here = RedisStore::connect(&redis.url()).await.expect("connect");
    let there = RedisStore::connect(&redis.url()).await.expect("connect");
    let url = redis.url();
    let cut = async move {
        let client = redis::Client::open(url.as_str()).expect("the private server's URL");
        let mut admin = client.get_multiplexed_async_connection().await.expect("connect");
        let killed: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("pubsub")
            .query_async(&mut admin)
            .await
            .expect("CLIENT KILL");
        assert!(killed >= 2, "both stores' pub/sub connections: {killed}");
    };
    testkit::a_delete_while_the_channel_is_down_is_not_missed(Arc::new(here), Arc::new(there), cut).await;
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
