//! The replicated Redis helpers against real processes: replication, a replica falling behind, a
//! manual and a Sentinel failover, and the loss of writes a replica missed, standalone and in a
//! cluster.

use std::time::{Duration, Instant};

use idem_test_support::replicated::{Nodes, ReplicatedCluster, ReplicatedRedis, Role};

const ACKS: Duration = Duration::from_secs(5);

fn set(key: &str, value: &str) -> redis::Cmd {
    redis::cmd("SET").arg(key).arg(value).clone()
}

fn get(key: &str) -> redis::Cmd {
    redis::cmd("GET").arg(key).clone()
}

/// The value of `key` on `node`, read directly.
async fn read_value(nodes: &Nodes, node: usize, key: &str) -> Option<String> {
    nodes.command(node, &get(key)).await
}

#[tokio::test]
async fn a_write_on_the_primary_reaches_every_replica() {
    let redis = ReplicatedRedis::start(2).await;
    assert_eq!(redis.primary(), 0);
    assert_eq!(redis.replicas(), [1, 2]);
    assert_eq!(redis.role(0).await, Some(Role::Primary));
    assert_eq!(redis.role(1).await, Some(Role::Replica));
    redis.command::<()>(0, &set("k", "v")).await;
    redis.wait_until_replicated(2, ACKS).await;
    for replica in redis.replicas() {
        assert_eq!(read_value(&redis, replica, "k").await.as_deref(), Some("v"));
        assert!(redis.replication_offset(replica).await >= redis.replication_offset(0).await);
    }
    let through_endpoint = redis::Client::open(redis.endpoint_url()).unwrap();
    let mut conn = through_endpoint.get_multiplexed_async_connection().await.unwrap();
    let value: Option<String> = get("k").query_async(&mut conn).await.unwrap();
    assert_eq!(value.as_deref(), Some("v"), "the endpoint is the primary");
}

#[tokio::test]
async fn a_frozen_replica_falls_behind_then_catches_up() {
    let mut redis = ReplicatedRedis::start(1).await;
    redis.command::<()>(0, &set("before", "1")).await;
    redis.wait_until_replicated(1, ACKS).await;
    redis.freeze(1);
    assert_eq!(redis.role(1).await, None, "a frozen node answers nothing");
    // Replicas acknowledge once a second: the last acknowledgement has arrived after this.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let acked = redis.acked_offset(1).await.expect("the primary lists its replica");
    for i in 0..10 {
        redis.command::<()>(0, &set(&format!("during{i}"), "1")).await;
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let primary_offset = redis.replication_offset(0).await.unwrap();
    assert!(
        primary_offset > acked,
        "the primary went on: {primary_offset} > {acked}"
    );
    assert_eq!(redis.acked_offset(1).await, Some(acked), "the frozen replica stopped");
    assert!(redis.lag(1).await >= primary_offset - acked);

    redis.thaw(1);
    redis.wait_until_replicated(1, ACKS).await;
    assert!(redis.replication_offset(1).await >= Some(primary_offset));
    let deadline = Instant::now() + ACKS;
    while redis.lag(1).await > 0 {
        assert!(Instant::now() < deadline, "the thawed replica acknowledged everything");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(read_value(&redis, 1, "during9").await.as_deref(), Some("1"));
}

#[tokio::test]
async fn a_manual_promotion_moves_the_primary_the_replicas_and_the_endpoint() {
    let mut redis = ReplicatedRedis::start(2).await;
    redis.command::<()>(0, &set("a", "1")).await;
    redis.wait_until_replicated(2, ACKS).await;

    redis.kill(0);
    assert_eq!(redis.role(0).await, None);
    redis.promote(1).await;
    redis.follow(2, 1).await;
    assert_eq!(redis.primary(), 1);
    assert_eq!(redis.primary_url(), redis.node_url(1));
    assert_eq!(redis.role(1).await, Some(Role::Primary));
    redis.command::<()>(1, &set("b", "2")).await;
    redis.wait_until_replicated(1, ACKS).await;
    assert_eq!(read_value(&redis, 2, "a").await.as_deref(), Some("1"));
    assert_eq!(read_value(&redis, 2, "b").await.as_deref(), Some("2"));

    redis.point_endpoint_at(1);
    let through_endpoint = redis::Client::open(redis.endpoint_url()).unwrap();
    let mut conn = through_endpoint.get_multiplexed_async_connection().await.unwrap();
    let () = set("c", "3").query_async(&mut conn).await.unwrap();

    redis.restart_as_replica_of(0, 1).await;
    redis.wait_until_replicated(2, ACKS).await;
    assert_eq!(redis.role(0).await, Some(Role::Replica));
    assert_eq!(read_value(&redis, 0, "c").await.as_deref(), Some("3"));
}

#[tokio::test]
async fn an_isolated_replica_promoted_after_its_primary_died_has_lost_what_it_missed() {
    let mut redis = ReplicatedRedis::start(1).await;
    redis.command::<()>(0, &set("before", "1")).await;
    redis.wait_until_replicated(1, ACKS).await;

    redis.isolate(1).await;
    redis.command::<()>(0, &set("during", "1")).await;
    redis.kill(0);
    redis.thaw(1);
    redis.promote(1).await;

    assert_eq!(read_value(&redis, 1, "before").await.as_deref(), Some("1"));
    assert_eq!(
        read_value(&redis, 1, "during").await,
        None,
        "the write the primary acknowledged while the replica was cut off is gone"
    );
}

#[tokio::test]
async fn sentinels_fail_over_a_killed_primary_within_seconds() {
    let mut redis = ReplicatedRedis::start_with_sentinels(2, 3).await;
    let addrs = redis.sentinel_addrs();
    assert_eq!(addrs.len(), 3);
    assert_eq!(
        redis.sentinel_url(),
        format!("redis+sentinel://{},{},{}/idem", addrs[0], addrs[1], addrs[2])
    );
    redis.command::<()>(0, &set("k", "v")).await;
    redis.wait_until_replicated(2, ACKS).await;

    redis.kill(0);
    let started = Instant::now();
    let new = redis.wait_for_failover(Duration::from_secs(15)).await;
    eprintln!("the Sentinels failed over to node {new} in {:?}", started.elapsed());
    assert_ne!(new, 0);
    assert_eq!(redis.primary(), new);
    assert_eq!(redis.role(new).await, Some(Role::Primary));
    assert_eq!(read_value(&redis, new, "k").await.as_deref(), Some("v"));
    redis.command::<()>(new, &set("after", "1")).await;

    redis.point_endpoint_at(new);
    let through_endpoint = redis::Client::open(redis.endpoint_url()).unwrap();
    let mut conn = through_endpoint.get_multiplexed_async_connection().await.unwrap();
    let value: Option<String> = get("after").query_async(&mut conn).await.unwrap();
    assert_eq!(value.as_deref(), Some("1"));
}

#[tokio::test]
async fn a_cluster_takeover_by_an_isolated_replica_loses_what_it_missed() {
    let mut cluster = ReplicatedCluster::start().await;
    assert_eq!(cluster.primaries().await, [0, 1, 2]);
    assert!(cluster.url().starts_with("redis+cluster://127.0.0.1:"));
    assert_eq!(cluster.url().matches(',').count(), 5, "six seeds");
    let slot = cluster.slot_of("{t}").await;
    let primary = cluster.primary_of_slot(slot).await;
    let replica = cluster.replica_of(primary).await.expect("a replica");
    assert_eq!(replica, primary + 3);

    cluster.command::<()>(primary, &set("{t}before", "1")).await;
    cluster.wait_until_replicated(primary, ACKS).await;
    cluster.isolate(replica).await;
    cluster.command::<()>(primary, &set("{t}during", "1")).await;
    cluster.kill(primary);
    cluster.thaw(replica);
    let started = Instant::now();
    cluster.failover_takeover(replica).await;
    cluster.wait_until_ok(Duration::from_secs(15)).await;
    eprintln!(
        "TAKEOVER with the primary dead: cluster ok after {:?}",
        started.elapsed()
    );

    assert_eq!(cluster.primary_of_slot(slot).await, replica);
    assert!(cluster.primaries().await.contains(&replica));
    assert!(!cluster.primaries().await.contains(&primary));
    assert_eq!(read_value(&cluster, replica, "{t}before").await.as_deref(), Some("1"));
    assert_eq!(
        read_value(&cluster, replica, "{t}during").await,
        None,
        "the write the old primary acknowledged while its replica was cut off is gone"
    );
}

#[tokio::test]
async fn a_cluster_slot_can_be_held_half_migrated() {
    let cluster = ReplicatedCluster::start().await;
    let slot = cluster.slot_of("{m}").await;
    let from = cluster.primary_of_slot(slot).await;
    let to = (from + 1) % 3;
    cluster.command::<()>(from, &set("{m}a", "1")).await;
    cluster.command::<()>(from, &set("{m}b", "2")).await;

    cluster.begin_slot_migration(slot, from, to).await;
    assert_eq!(
        read_value(&cluster, from, "{m}a").await.as_deref(),
        Some("1"),
        "a key not yet moved is still served where it was"
    );
    let missing = cluster.try_command::<Option<String>>(from, &get("{m}new")).await;
    let err = missing.expect_err("a key not on the old node is asked for on the new one");
    assert_eq!(err.code(), Some("ASK"), "{err}");

    assert_eq!(cluster.migrate_slot_keys(slot, from, to).await, 2);
    cluster.finish_slot_migration(slot, from, to).await;
    assert_eq!(cluster.primary_of_slot(slot).await, to);
    assert_eq!(read_value(&cluster, to, "{m}b").await.as_deref(), Some("2"));
    let moved = cluster.try_command::<Option<String>>(from, &get("{m}a")).await;
    assert_eq!(moved.expect_err("the slot moved").code(), Some("MOVED"));
    cluster.wait_until_ok(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn a_restarted_primary_whose_slots_were_taken_over_comes_back_as_a_replica() {
    let mut cluster = ReplicatedCluster::start().await;
    cluster.isolate(3).await;
    cluster.kill(0);
    cluster.thaw(3);
    cluster.failover_takeover(3).await;
    cluster.wait_until_ok(Duration::from_secs(15)).await;
    assert_eq!(cluster.replica_of(3).await, None, "node 0 is dead");

    let started = Instant::now();
    cluster.restart(0).await;
    eprintln!("node 0 rejoined as a replica of node 3 in {:?}", started.elapsed());

    assert_eq!(cluster.replica_of(3).await, Some(0));
    assert_eq!(cluster.primaries().await, [1, 2, 3]);
    let replication: String = cluster.command(0, redis::cmd("INFO").arg("replication")).await;
    assert!(replication.contains("role:slave"), "{replication}");
    assert!(replication.contains("master_link_status:up"), "{replication}");

    let mut key = None;
    for i in 0.. {
        let candidate = format!("{{r{i}}}after");
        if cluster.primary_of_slot(cluster.slot_of(&candidate).await).await == 3 {
            key = Some(candidate);
            break;
        }
    }
    let key = key.expect("a key node 3 serves");
    cluster.command::<()>(3, &set(&key, "1")).await;
    cluster.wait_until_replicated(3, ACKS).await;
    // A replica serves reads to a connection that said READONLY (else it answers MOVED).
    let node0 = redis::Client::open(cluster.node_url(0)).unwrap();
    let mut conn = node0.get_multiplexed_async_connection().await.unwrap();
    let () = redis::cmd("READONLY").query_async(&mut conn).await.unwrap();
    let value: Option<String> = get(&key).query_async(&mut conn).await.unwrap();
    assert_eq!(value.as_deref(), Some("1"), "the write on node 3 reached node 0");

    let id3 = cluster.node_id(3).to_owned();
    for node in 0..6 {
        let nodes: String = cluster.command(node, redis::cmd("CLUSTER").arg("NODES")).await;
        let line = nodes
            .lines()
            .find(|line| line.starts_with(cluster.node_id(0)))
            .unwrap_or_else(|| panic!("node {node} lists node 0: {nodes}"));
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert!(fields[2].split(',').any(|flag| flag == "slave"), "node {node}: {line}");
        assert_eq!(fields[3], id3, "node {node}: {line}");
    }
}
