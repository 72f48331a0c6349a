//! Failovers of replicated Redis stores, under the storm's load: a replica is cut off from its
//! primary (frozen, its replication link closed), so it falls behind while the primary keeps
//! taking writes; then the primary is killed with `kill -9`, the lagging replica is promoted, and
//! the old primary comes back empty as a replica of the new one. Every write the primary took
//! while the replica was cut off is lost with it.
//!
//! idem waits for a replica's acknowledgement before a write counts (`replicas=auto`, the
//! default), so none of the lost writes was acted on: the storm's verdict must hold — every
//! payment ends 2xx, no key runs twice without `Idempotency-Recovered: true`, every copy of a key
//! gets one answer, and the store comes back by itself.
//!
//! * a primary with a replica behind one address (a managed endpoint that moves to the promoted
//!   replica, here a relay);
//! * a primary with a replica watched by three sentinels (`redis+sentinel://`), which promote it;
//! * a Redis Cluster of three primaries with a replica each, one of which takes its primary's
//!   slots over (`CLUSTER FAILOVER TAKEOVER`).

use std::time::Duration;

use idem_test_support::replicated::{ReplicatedCluster, ReplicatedRedis};
use tokio::time::Instant;

use super::scenario::scenario;

/// How long the payments are spread over.
const PAYMENTS_OVER: Duration = Duration::from_secs(20);
/// When the replica is cut off, and for how long before its primary is killed.
const CUT_OFF_AT: Duration = Duration::from_secs(4);
const CUT_OFF_FOR: Duration = Duration::from_secs(3);
/// How long Sentinel may take to promote the replica.
const SENTINEL_FAILOVER: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_of_a_primary_behind_one_address() {
    let mut redis = ReplicatedRedis::start(1).await;
    let store = format!("{}/?prefix=idem-failover", redis.endpoint_url());
    let redis = &mut redis;
    scenario("redis-endpoint-failover", &store, PAYMENTS_OVER, 1, |_| async move {
        let (old, replica) = (redis.primary(), redis.replicas()[0]);
        tokio::time::sleep(CUT_OFF_AT).await;
        redis.isolate(replica).await;
        tokio::time::sleep(CUT_OFF_FOR).await;
        redis.kill(old);
        let killed = Instant::now();
        redis.thaw(replica);
        redis.promote(replica).await;
        redis.point_endpoint_at(replica);
        redis.restart_as_replica_of(old, replica).await;
        (
            1,
            format!(
                "replica cut off for {CUT_OFF_FOR:?}, primary killed, the replica promoted and the endpoint moved to it, \
                 the old primary back as its replica {:.1} s later",
                killed.elapsed().as_secs_f64()
            ),
        )
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_through_sentinel() {
    let mut redis = ReplicatedRedis::start_with_sentinels(1, 3).await;
    let store = format!("{}?prefix=idem-failover", redis.sentinel_url());
    let redis = &mut redis;
    scenario("redis-sentinel-failover", &store, PAYMENTS_OVER, 1, |_| async move {
        let (old, replica) = (redis.primary(), redis.replicas()[0]);
        tokio::time::sleep(CUT_OFF_AT).await;
        redis.isolate(replica).await;
        tokio::time::sleep(CUT_OFF_FOR).await;
        redis.kill(old);
        let killed = Instant::now();
        redis.thaw(replica);
        let promoted = redis.wait_for_failover(SENTINEL_FAILOVER).await;
        assert_eq!(promoted, replica, "Sentinel promoted the only replica");
        let failed_over = killed.elapsed();
        redis.restart_as_replica_of(old, promoted).await;
        (
            1,
            format!(
                "replica cut off for {CUT_OFF_FOR:?}, primary killed, Sentinel promoted the replica in {:.1} s, \
                 the old primary back as its replica {:.1} s after the kill",
                failed_over.as_secs_f64(),
                killed.elapsed().as_secs_f64()
            ),
        )
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_in_a_cluster_with_replicas() {
    let mut cluster = ReplicatedCluster::start().await;
    let store = format!("{}/?prefix=idem-failover", cluster.url());
    let cluster = &mut cluster;
    scenario("redis-cluster-failover", &store, PAYMENTS_OVER, 1, |_| async move {
        let old = cluster.primaries().await[0];
        let replica = cluster.replica_of(old).await.expect("every primary has a replica");
        tokio::time::sleep(CUT_OFF_AT).await;
        cluster.isolate(replica).await;
        tokio::time::sleep(CUT_OFF_FOR).await;
        cluster.kill(old);
        let killed = Instant::now();
        cluster.thaw(replica);
        cluster.failover_takeover(replica).await;
        let failed_over = killed.elapsed();
        cluster.restart(old).await;
        (
            1,
            format!(
                "a replica cut off for {CUT_OFF_FOR:?}, its primary killed, the replica took its slots over in {:.1} s, \
                 the old primary back as its replica {:.1} s after the kill",
                failed_over.as_secs_f64(),
                killed.elapsed().as_secs_f64()
            ),
        )
    })
    .await;
}
