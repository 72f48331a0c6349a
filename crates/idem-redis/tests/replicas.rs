//! Replicated Redis, started by the tests themselves (`idem_test_support::replicated`): a write
//! counts only once a replica acknowledged it, so a failover to a replica that fell behind loses
//! nothing that counted; a store behind Sentinel follows the primary through a failover; an
//! acknowledged write on a Cluster follows a slot's migration.
//!
//! A replica "falls behind" for real: it is frozen and its replication link closed on the primary
//! (`isolate`), so every write the primary takes meanwhile is lost when the primary is killed
//! with `kill -9` and the replica promoted. The servers are the tests' own, gone with them.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::testkit::{self, DAY, Harness, acquire, claim, completion, fingerprint, fresh_id, stored_response};
use idem_core::{
    Store, StoreError, UnixMillis,
    store::{Begin, Completion, FencingToken, RecordId, RecordState},
};
use idem_redis::RedisStore;
use idem_test_support::redis_store::{connect_url, fresh_prefix};
use idem_test_support::replicated::{ReplicatedCluster, ReplicatedRedis};
use idem_test_support::servers::with_options;
use tokio::time::Instant;

/// How long a store may take to work again after a failover.
const BACK_WITHIN: Duration = Duration::from_secs(20);

/// A store on `url` under `prefix`.
async fn connect(url: &str, prefix: &str) -> RedisStore {
    connect_url(&with_options(url, &format!("prefix={prefix}"))).await
}

/// A store on `url` under a fresh prefix of its own.
async fn connect_fresh(url: &str) -> RedisStore {
    connect(url, &fresh_prefix()).await
}

/// Opens stores on one URL, each case under a fresh prefix.
struct OnUrl {
    url: String,
    /// A plain URL of the primary, where keys are deleted.
    primary: String,
    prefix: String,
}

impl OnUrl {
    fn new(url: &str, primary: &str) -> Self {
        Self {
            url: url.to_owned(),
            primary: primary.to_owned(),
            prefix: fresh_prefix(),
        }
    }
}

#[async_trait]
impl Harness for OnUrl {
    async fn open(&self) -> Arc<dyn Store> {
        Arc::new(connect(&self.url, &self.prefix).await)
    }

    async fn lose_data(&self) {
        let (primary, prefix) = (self.primary.clone(), self.prefix.clone());
        tokio::task::spawn_blocking(move || idem_test_support::servers::delete_redis_keys(&primary, &prefix))
            .await
            .expect("deleting the prefix's keys");
    }
}

/// Tries `begin` of a fresh key until the store takes it (it is back after a failover).
async fn until_back(store: &RedisStore) {
    let deadline = Instant::now() + BACK_WITHIN;
    loop {
        let (id, fp) = (fresh_id(), fingerprint("{}"));
        match store
            .begin(claim(&id, &fp, UnixMillis::now(), FencingToken::random()))
            .await
        {
            Ok(_) => return,
            Err(err) => assert!(
                Instant::now() < deadline,
                "the store is not back {BACK_WITHIN:?} after the failover: {err}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn is_unacknowledged(result: &Result<impl std::fmt::Debug, StoreError>) -> bool {
    matches!(result, Err(StoreError::Unavailable(err)) if err.to_string().contains("acknowledged"))
}

/// The answer `body` completed at `now`, kept a day (its key a week).
fn completion_of(body: &'static [u8], now: UnixMillis) -> Completion {
    completion(body, now, DAY, 7 * DAY)
}

/// Asserts that the store holds `id`'s record, answered with `body`.
async fn assert_answered(store: &RedisStore, id: &RecordId, body: &[u8]) {
    let record = store.get(id).await.expect("get").expect("the record");
    assert_eq!(stored_response(&record).as_deref(), Some(body), "{id:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conformance_suite_holds_through_sentinel_with_every_write_acknowledged() {
    let redis = ReplicatedRedis::start_with_sentinels(1, 3).await;
    let url = with_options(&redis.sentinel_url(), "replicas=1");
    idem_core::conformance_tests!(in_sequence OnUrl::new(&url, &redis.endpoint_url()));
}

/// `replicas=auto` on a primary with a replica: while the replica is cut off, a claim and an
/// answer fail as unavailable (the protocol never acts on them) even though the primary lists no
/// replica any more; after a failover to that replica, everything that was acknowledged is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_no_replica_acknowledges_fails_and_a_failover_loses_nothing_that_counted() {
    let mut redis = ReplicatedRedis::start(1).await;
    let store = connect_fresh(&redis.endpoint_url()).await;
    let (old, replica) = (redis.primary(), redis.replicas()[0]);
    let (now, fp) = (UnixMillis::now(), fingerprint("{}"));

    let (answered, in_flight, refused) = (fresh_id(), fresh_id(), fresh_id());
    let token = acquire(&store, &answered, &fp, now).await;
    store
        .complete(&answered, token, completion_of(b"acknowledged", now))
        .await
        .expect("a replica acknowledges the answer");
    let running = acquire(&store, &in_flight, &fp, now).await;

    redis.isolate(replica).await;
    let role: redis::Value = redis.command(old, &redis::cmd("ROLE")).await;
    assert!(
        matches!(&role, redis::Value::Array(parts) if matches!(parts.get(2), Some(redis::Value::Array(r)) if r.is_empty())),
        "the primary lists no replica once the link is closed: {role:?}"
    );
    // Past a re-read of the topology: auto still waits for the replica it has seen.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let begun = store.begin(claim(&refused, &fp, now, FencingToken::random())).await;
    assert!(is_unacknowledged(&begun), "a claim no replica has: {begun:?}");
    let answer = store.complete(&in_flight, running, completion_of(b"unseen", now)).await;
    assert!(is_unacknowledged(&answer), "an answer no replica has: {answer:?}");

    redis.kill(old);
    redis.thaw(replica);
    redis.promote(replica).await;
    redis.point_endpoint_at(replica);
    redis.restart_as_replica_of(old, replica).await;
    until_back(&store).await;

    assert_answered(&store, &answered, b"acknowledged").await;
    let record = store
        .get(&in_flight)
        .await
        .expect("get")
        .expect("the acknowledged claim");
    assert!(
        matches!(record.state, RecordState::InFlight { token, .. } if token == running),
        "its answer was never acknowledged, its claim was: {record:?}"
    );
    assert!(
        store.get(&refused).await.expect("get").is_none(),
        "the refused claim existed only on the lost primary"
    );
    // The holder stores its held answer again, on the new primary.
    store
        .complete(&in_flight, running, completion_of(b"held", now))
        .await
        .expect("the held answer is stored once a replica acknowledges");
    assert_answered(&store, &in_flight, b"held").await;
}

/// A `complete` that the primary took but no replica acknowledged, then tried again by its holder
/// once the replica is back: the second call finds the claim's own answer, has it acknowledged and
/// succeeds (it is not refused as fenced), and the answer is the first one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_whose_acknowledgement_was_missing_is_confirmed_by_the_next() {
    let mut redis = ReplicatedRedis::start(1).await;
    let store = connect_fresh(&redis.endpoint_url()).await;
    let (primary, replica) = (redis.primary(), redis.replicas()[0]);
    let (id, fp, now) = (fresh_id(), fingerprint("{}"), UnixMillis::now());
    let token = acquire(&store, &id, &fp, now).await;

    redis.isolate(replica).await;
    let first = store.complete(&id, token, completion_of(b"first", now)).await;
    assert!(is_unacknowledged(&first), "{first:?}");
    redis.thaw(replica);
    redis.follow(replica, primary).await;

    store
        .complete(&id, token, completion_of(b"again", now))
        .await
        .expect("the claim's own answer, acknowledged now");
    assert_answered(&store, &id, b"first").await;
    let stranger = store
        .complete(&id, FencingToken::random(), completion(b"x", now, DAY, DAY))
        .await;
    assert!(matches!(stranger, Err(StoreError::Fenced)), "{stranger:?}");
}

/// What `replicas=0` risks, and what the test above guards against: the same failover loses a
/// claim and an answer the store reported done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_acknowledgement_a_failover_loses_what_the_primary_took() {
    let mut redis = ReplicatedRedis::start(1).await;
    let store = connect_fresh(&with_options(&redis.endpoint_url(), "replicas=0")).await;
    let (old, replica) = (redis.primary(), redis.replicas()[0]);
    let (id, fp, now) = (fresh_id(), fingerprint("{}"), UnixMillis::now());

    redis.isolate(replica).await;
    let token = acquire(&store, &id, &fp, now).await;
    store
        .complete(&id, token, completion_of(b"lost", now))
        .await
        .expect("the primary alone takes it");
    redis.kill(old);
    redis.thaw(replica);
    redis.promote(replica).await;
    redis.point_endpoint_at(replica);
    until_back(&store).await;
    assert!(
        store.get(&id).await.expect("get").is_none(),
        "the answer reported stored is gone: a retry would run again"
    );
}

/// A store behind Sentinel: after the primary is killed and Sentinel promotes the replica, the
/// store finds the new primary by itself and every acknowledged record is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_sentinel_the_store_follows_a_failover() {
    let mut redis = ReplicatedRedis::start_with_sentinels(1, 3).await;
    let store = connect_fresh(&redis.sentinel_url()).await;
    let (id, fp, now) = (fresh_id(), fingerprint("{}"), UnixMillis::now());
    let token = acquire(&store, &id, &fp, now).await;
    store
        .complete(&id, token, completion_of(b"kept", now))
        .await
        .expect("complete");

    let old = redis.primary();
    redis.kill(old);
    let promoted = redis.wait_for_failover(Duration::from_secs(30)).await;
    redis.restart_as_replica_of(old, promoted).await;
    until_back(&store).await;
    let (begin, _) = testkit::begin(&store, &id, &fp, now).await;
    match begin {
        Begin::Existing(record) => assert_eq!(stored_response(&record).as_deref(), Some(b"kept".as_slice())),
        other => panic!("the acknowledged answer is on the new primary: {other:?}"),
    }
}

/// An acknowledged write to a record whose slot is half migrated: Redis refuses a script whose keys
/// are not all on one side (`TRYAGAIN`), or sends it to the other side (`ASK`). Either way the
/// store answers the write or fails it as unavailable — never fenced, never another answer — and
/// once the slot has moved, the holder's retry stores the answer on the new owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_write_to_a_migrating_slot_is_answered_or_unavailable() {
    let cluster = ReplicatedCluster::start().await;
    let store = connect_fresh(&with_options(&cluster.url(), "replicas=1")).await;
    let (id, fp, now) = (fresh_id(), fingerprint("{}"), UnixMillis::now());
    let keys = store.record_keys(&id);
    let slot = cluster.slot_of(&keys.record).await;
    let from = cluster.primary_of_slot(slot).await;
    let to = cluster
        .primaries()
        .await
        .into_iter()
        .find(|&primary| primary != from)
        .expect("another primary");

    let token = acquire(&store, &id, &fp, now).await;
    cluster.begin_slot_migration(slot, from, to).await;
    assert!(cluster.migrate_slot_keys(slot, from, to).await > 0, "the record moved");
    let during = store.complete(&id, token, completion_of(b"migrated", now)).await;
    assert!(
        matches!(during, Ok(()) | Err(StoreError::Unavailable(_))),
        "a write during the migration: {during:?}"
    );
    cluster.finish_slot_migration(slot, from, to).await;
    store
        .complete(&id, token, completion_of(b"migrated", now))
        .await
        .expect("the holder's retry, on the slot's new owner");
    assert_answered(&store, &id, b"migrated").await;
    assert_eq!(cluster.primary_of_slot(slot).await, to);
}
