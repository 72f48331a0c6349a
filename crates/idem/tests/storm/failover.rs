//! Failovers of replicated Redis stores: real `redis-server` processes with replicas, Sentinels and
//! clusters, real `kill -9`.
//!
//! Under the storm's load: a replica is cut off from its primary (frozen, its replication link
//! closed), so it falls behind while the primary keeps taking writes; then the primary is killed,
//! the lagging replica is promoted, and the old primary comes back empty as a replica of the new
//! one. Every write the primary took while the replica was cut off is lost with it. idem waits for
//! a replica's acknowledgement before a write counts (`replicas=auto`, the default), so none of the
//! lost writes was acted on: the storm's verdict must hold — every payment ends 2xx, no key runs
//! twice without `Idempotency-Recovered: true`, every copy of a key gets one answer, and the store
//! comes back by itself.
//!
//! * a primary with a replica behind one address (a managed endpoint that moves to the promoted
//!   replica, here a relay);
//! * a primary with a replica watched by three sentinels (`redis+sentinel://`), which promote it;
//! * a Redis Cluster of three primaries with a replica each, one of which takes its primary's
//!   slots over (`CLUSTER FAILOVER TAKEOVER`);
//! * a replica that flaps, two Sentinel failovers in a row, slots migrated key by key.
//!
//! Met by processes that start, stop and act during them (a breaker wrote these; the first two
//! failed then):
//!
//! * A gateway restarted while its primary's only replica is cut off: `replicas=auto` must still
//!   wait for the replica (the store remembers it has had one, `PREFIX:replicated`), so a claim
//!   only the primary took is never acted on, and the retry after the failover runs once.
//! * `idem delete` while the replica is cut off: it fails as unavailable rather than report a
//!   delete a failover could undo.
//! * A gateway killed mid-failover, whose claim is taken over only after its lease.

use std::ops::DerefMut;
use std::time::Duration;

use idem_test_support::replicated::{Nodes, ReplicatedCluster, ReplicatedRedis};
use tokio::time::Instant;

use super::scenario::scenario;
use crate::common::{self, Gateway, Upstream, count, describe, new_key, run_idem};

/// How long the payments are spread over.
const PAYMENTS_OVER: Duration = Duration::from_secs(20);
/// When the replica is cut off, and for how long before its primary is killed.
const CUT_OFF_AT: Duration = Duration::from_secs(4);
const CUT_OFF_FOR: Duration = Duration::from_secs(3);
/// How long Sentinel may take to promote the replica.
const SENTINEL_FAILOVER: Duration = Duration::from_secs(30);
/// How long an `idem` command may take.
const COMMAND_LIMIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Failovers under load
// ---------------------------------------------------------------------------------------------

/// A primary with one replica behind one address, and its store URL with `prefix`.
async fn behind_one_address(prefix: &str) -> (ReplicatedRedis, String) {
    let redis = ReplicatedRedis::start(1).await;
    let store = format!("{}/?prefix={prefix}", redis.endpoint_url());
    (redis, store)
}

/// A primary with one replica watched by three sentinels, and its store URL with `prefix`.
async fn with_sentinels(prefix: &str) -> (ReplicatedRedis, String) {
    let redis = ReplicatedRedis::start_with_sentinels(1, 3).await;
    let store = format!("{}?prefix={prefix}", redis.sentinel_url());
    (redis, store)
}

/// A cluster of three primaries with a replica each, and its store URL with `prefix`.
async fn cluster_with_replicas(prefix: &str) -> (ReplicatedCluster, String) {
    let cluster = ReplicatedCluster::start().await;
    let store = format!("{}/?prefix={prefix}", cluster.url());
    (cluster, store)
}

/// How a killed primary comes back, the one step the replicated stores' failovers take
/// differently; freezing, isolating and killing nodes are the nodes' own ([`Nodes`]).
trait Rejoin: DerefMut<Target = Nodes> {
    /// Restarts `old`, a killed primary, as a replica of `primary`.
    async fn rejoin(&mut self, old: usize, primary: usize);
}

impl Rejoin for ReplicatedRedis {
    async fn rejoin(&mut self, old: usize, primary: usize) {
        self.restart_as_replica_of(old, primary).await;
    }
}

impl Rejoin for ReplicatedCluster {
    /// Restarted, the old primary rejoins the cluster as a replica of the node that took its slots.
    async fn rejoin(&mut self, old: usize, _primary: usize) {
        self.restart(old).await;
    }
}

/// The storm's load for [`PAYMENTS_OVER`] on a store, given as its processes and its URL, while
/// `faults` acts on the processes.
async fn under_load<N>(
    name: &str,
    (mut nodes, store): (N, String),
    min_faults: usize,
    faults: impl AsyncFnOnce(&mut N) -> (usize, String),
) {
    scenario(name, &store, PAYMENTS_OVER, min_faults, |_| faults(&mut nodes)).await;
}

/// One failover under the load: [`CUT_OFF_AT`] into it, `replica` is cut off; [`CUT_OFF_FOR`]
/// later its primary `old` is killed and the replica goes on, lagging; `take_over` makes it the
/// primary (and names the node it promoted), and the old primary comes back as its replica. The
/// figures say `how` the replica took over.
async fn failover<N: Rejoin>(
    nodes: &mut N,
    old: usize,
    replica: usize,
    how: &str,
    take_over: impl AsyncFnOnce(&mut N) -> usize,
) -> (usize, String) {
    tokio::time::sleep(CUT_OFF_AT).await;
    nodes.isolate(replica).await;
    tokio::time::sleep(CUT_OFF_FOR).await;
    nodes.kill(old);
    let killed = Instant::now();
    nodes.thaw(replica);
    let promoted = take_over(nodes).await;
    let failed_over = killed.elapsed();
    nodes.rejoin(old, promoted).await;
    (
        1,
        format!(
            "a replica cut off for {CUT_OFF_FOR:?}, its primary killed, {how} in {:.1} s, \
             the old primary back as its replica {:.1} s after the kill",
            failed_over.as_secs_f64(),
            killed.elapsed().as_secs_f64()
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_of_a_primary_behind_one_address() {
    under_load(
        "redis-endpoint-failover",
        behind_one_address("idem-failover").await,
        1,
        async |redis| {
            let (old, replica) = (redis.primary(), redis.replicas()[0]);
            let how = "the replica promoted and the endpoint moved to it";
            failover(redis, old, replica, how, async |redis| {
                redis.promote(replica).await;
                redis.point_endpoint_at(replica);
                replica
            })
            .await
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_through_sentinel() {
    under_load(
        "redis-sentinel-failover",
        with_sentinels("idem-failover").await,
        1,
        async |redis| {
            let (old, replica) = (redis.primary(), redis.replicas()[0]);
            failover(redis, old, replica, "Sentinel promoted the replica", async |redis| {
                let promoted = redis.wait_for_failover(SENTINEL_FAILOVER).await;
                assert_eq!(promoted, replica, "Sentinel promoted the only replica");
                promoted
            })
            .await
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_in_a_cluster_with_replicas() {
    under_load(
        "redis-cluster-failover",
        cluster_with_replicas("idem-failover").await,
        1,
        async |cluster| {
            let old = cluster.primaries().await[0];
            let replica = cluster.replica_of(old).await.expect("every primary has a replica");
            failover(
                cluster,
                old,
                replica,
                "the replica took its slots over",
                async |cluster| {
                    cluster.failover_takeover(replica).await;
                    replica
                },
            )
            .await
        },
    )
    .await;
}

/// A replica that flaps under load: cut off, then back (thawed and following again), every ~1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_replica_under_load() {
    under_load(
        "redis-flapping-replica",
        behind_one_address("idem-flap").await,
        1,
        async |redis| {
            let (primary, replica) = (redis.primary(), redis.replicas()[0]);
            tokio::time::sleep(Duration::from_secs(2)).await;
            let mut flaps = 0;
            let until = Instant::now() + Duration::from_secs(14);
            while Instant::now() < until {
                redis.isolate(replica).await;
                tokio::time::sleep(Duration::from_millis(800)).await;
                redis.thaw(replica);
                redis.follow(replica, primary).await;
                tokio::time::sleep(Duration::from_millis(600)).await;
                flaps += 1;
            }
            (flaps, format!("the replica cut off and back {flaps} times"))
        },
    )
    .await;
}

/// Two Sentinel failovers in a row under load: the primary killed, Sentinel promotes the replica,
/// the old primary back as its replica; then the new primary killed, and Sentinel promotes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sentinel_failovers_in_a_row_under_load() {
    under_load(
        "redis-two-failovers",
        with_sentinels("idem-twice").await,
        2,
        async |redis| {
            let mut text = Vec::new();
            tokio::time::sleep(Duration::from_secs(3)).await;
            for round in 0..2 {
                let (old, replica) = (redis.primary(), redis.replicas()[0]);
                redis.isolate(replica).await;
                tokio::time::sleep(Duration::from_millis(1500)).await;
                redis.kill(old);
                let killed = Instant::now();
                redis.thaw(replica);
                let promoted = redis.wait_for_failover(SENTINEL_FAILOVER).await;
                assert_eq!(promoted, replica, "round {round}");
                redis.restart_as_replica_of(old, promoted).await;
                text.push(format!("failover {round} in {:.1} s", killed.elapsed().as_secs_f64()));
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            (2, text.join(", "))
        },
    )
    .await;
}

/// A slot of the cluster migrated step by step (IMPORTING/MIGRATING, one key at a time, then the
/// slot handed over) while two gateways take payments whose records live in it and around it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_migrations_under_load() {
    under_load(
        "redis-cluster-migration",
        cluster_with_replicas("idem-migrate").await,
        1,
        async |cluster| {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let mut moved = 0;
            let mut slots = 0;
            let until = Instant::now() + Duration::from_secs(15);
            while Instant::now() < until {
                // A slot that holds records now: move it to another primary, key by key.
                let primaries = cluster.primaries().await;
                let mut found = None;
                for &from in &primaries {
                    let port = port_of(&cluster.node_url(from));
                    let keys = redis_cli(port, &["--scan", "--pattern", "idem-migrate:{*}:rec"]);
                    if let Some(key) = keys.lines().next() {
                        found = Some((from, cluster.slot_of(key).await));
                        break;
                    }
                }
                let Some((from, slot)) = found else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                };
                let to = *primaries.iter().find(|&&p| p != from).expect("three primaries");
                let (from_port, to_port) = (port_of(&cluster.node_url(from)), port_of(&cluster.node_url(to)));
                cluster.begin_slot_migration(slot, from, to).await;
                loop {
                    let keys = redis_cli(from_port, &["CLUSTER", "GETKEYSINSLOT", &slot.to_string(), "1"]);
                    let Some(key) = keys.lines().next().map(str::to_owned) else {
                        break;
                    };
                    if key.is_empty() {
                        break;
                    }
                    redis_cli(
                        from_port,
                        &["MIGRATE", "127.0.0.1", &to_port.to_string(), &key, "0", "5000"],
                    );
                    moved += 1;
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                cluster.finish_slot_migration(slot, from, to).await;
                slots += 1;
            }
            (
                slots.min(1),
                format!("{slots} slots migrated key by key ({moved} keys moved)"),
            )
        },
    )
    .await;
}

/// `redis-cli -p PORT ARGS`, its output.
fn redis_cli(port: u16, args: &[&str]) -> String {
    let output = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .expect("a port")
}

// ---------------------------------------------------------------------------------------------
// Processes that start and act during a failover
// ---------------------------------------------------------------------------------------------

/// A primary with one replica behind a managed endpoint. Gateway A runs (it has seen the replica,
/// so its writes wait for it). The replica is cut off; A is killed with `kill -9` and restarted —
/// mid-failover, as an orchestrator restarts crashed pods. The restarted A sees no replica right
/// now, but the store says it has had one: a payment through it is refused (503), never run on a
/// claim only the primary has. The primary dies, the lagging replica is promoted, the old primary
/// comes back as its replica. The client's retry of the same key runs once (or replays).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_restarted_while_its_replica_is_cut_off_acts_on_no_claim_a_failover_could_lose() {
    let (mut redis, store) = behind_one_address("idem-restart").await;
    let upstream = Upstream::start().await;
    let args = ["--lease", "5s", "--wait", "2s"];
    let mut gateway = Gateway::start_on_store(&upstream.url(), &store, &args).await;
    let warm = gateway.post_json("/pay", Some(&new_key()), r#"{"amount":1}"#).await;
    assert_eq!(warm.status, 201, "before any fault: {warm}");

    let (old, replica) = (redis.primary(), redis.replicas()[0]);
    redis.isolate(replica).await;
    // The instance crashes and is restarted while the replica is cut off.
    gateway.kill().await;
    let gateway = Gateway::start_on_store(&upstream.url(), &store, &args).await;

    let key = new_key();
    let body = r#"{"amount":4200,"currency":"EUR"}"#;
    let first = gateway.post_json("/pay", Some(&key), body).await;
    eprintln!("the payment while the replica is cut off: {first}");

    // The failover: the primary dies, the lagging replica is promoted.
    redis.kill(old);
    redis.thaw(replica);
    redis.promote(replica).await;
    redis.point_endpoint_at(replica);
    redis.restart_as_replica_of(old, replica).await;

    let again = pay_until_not_503(&gateway, &key, body, Duration::from_secs(20)).await;
    let (runs, flagged) = runs_of(&upstream, &key);
    eprintln!("the retry after the failover: {again}; upstream runs of the key: {runs} ({flagged} flagged)");
    assert!(
        runs - flagged <= 1,
        "the key ran {runs} times at the upstream, only {flagged} flagged recovered: the restarted gateway \
         (replicas=auto, started while the replica was cut off) acted on a claim only the primary had \
         (first answer: {first}; the retry after the failover: {again})"
    );
    if first.status == 201 {
        assert_eq!(
            again.text(),
            first.text(),
            "the client was answered 201, then the same key got another answer after the failover"
        );
    }
}

/// `idem delete` through Sentinel while the replica is cut off: the CLI process sees no replica,
/// but the store says it has had one, so the delete waits for it and fails (exit non-zero) rather
/// than report done a delete the failover would undo. Had it reported done, the record must not be
/// back after the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_while_the_replica_is_cut_off_fails_rather_than_be_undone_by_the_failover() {
    let (mut redis, store) = with_sentinels("idem-delete").await;
    let upstream = Upstream::start().await;
    let gateway = Gateway::start_on_store(&upstream.url(), &store, &["--lease", "5s"]).await;
    let key = new_key();
    let body = r#"{"amount":77}"#;
    let first = gateway.post_json("/pay", Some(&key), body).await;
    assert_eq!(first.status, 201, "{first}");

    let (old, replica) = (redis.primary(), redis.replicas()[0]);
    redis.isolate(replica).await;
    let delete = run_idem(&["delete", "--store", &store, &key], COMMAND_LIMIT).await;
    eprintln!("idem delete while the replica is cut off:\n{}", describe(&delete));
    let reported_done = delete.status.success();
    assert!(
        !reported_done && describe(&delete).contains("acknowledged"),
        "a delete no replica acknowledged must fail, saying why:\n{}",
        describe(&delete)
    );

    redis.kill(old);
    redis.thaw(replica);
    let promoted = redis.wait_for_failover(SENTINEL_FAILOVER).await;
    redis.restart_as_replica_of(old, promoted).await;

    let inspect = run_idem(&["inspect", "--store", &store, &key], COMMAND_LIMIT).await;
    eprintln!("idem inspect after the failover:\n{}", describe(&inspect));
    let again = pay_until_not_503(&gateway, &key, body, Duration::from_secs(20)).await;
    eprintln!("the same key after the failover: {again}");
    if reported_done {
        assert!(
            !again.replayed(),
            "idem delete reported the completed record deleted; after the failover it is back and replays \
             (inspect exit {:?}): {again}",
            inspect.status.code()
        );
    }
}

/// A gateway killed with kill -9 while its run is in flight, during a Sentinel failover, and
/// restarted: its claim is taken over only after the lease, flagged recovered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_failover_has_its_claim_taken_over_after_the_lease() {
    let (mut redis, store) = with_sentinels("idem-kill9").await;
    let upstream = Upstream::start().await;
    let args = ["--lease", "6s", "--wait", "1s"];
    let mut a = Gateway::start_on_store(&upstream.url(), &store, &args).await;
    let b = Gateway::start_on_store(&upstream.url(), &store, &args).await;
    let key = new_key();
    let body = r#"{"amount":9}"#;
    // A claims and runs a slow payment; it is killed while the upstream works.
    let slow = {
        let request = a.keyed("/pay?delay=3000", key.as_str(), body.to_owned());
        tokio::spawn(async move { common::try_send(request).await })
    };
    common::wait_for_count(&upstream.state.pay, 1, Duration::from_secs(10)).await;
    let claimed = Instant::now();
    let (old, _replica) = (redis.primary(), redis.replicas()[0]);
    redis.kill(old);
    a.kill().await;
    let _ = slow.await;
    let promoted = redis.wait_for_failover(SENTINEL_FAILOVER).await;
    redis.restart_as_replica_of(old, promoted).await;
    let a = Gateway::start_on_store(&upstream.url(), &store, &args).await;
    // Until the lease ends: in flight, never run again.
    loop {
        let reply = b.post_json("/pay?delay=3000", Some(&key), body).await;
        let (runs, flagged) = runs_of(&upstream, &key);
        if runs > 1 {
            assert!(
                claimed.elapsed() >= Duration::from_secs(6),
                "taken over {:?} after the claim, before the 6 s lease",
                claimed.elapsed()
            );
            assert_eq!(flagged, runs - 1, "the takeover is flagged: {reply}");
            break;
        }
        assert!(claimed.elapsed() < Duration::from_secs(40), "never taken over: {reply}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let replay = a.post_json("/pay?delay=3000", Some(&key), body).await;
    assert_eq!(replay.status, 201, "{replay}");
    assert_eq!(count(&upstream.state.pay), runs_of(&upstream, &key).0);
}

/// Sends `key` to `gateway` until the answer is not `503` (the store is moving), for `limit`.
async fn pay_until_not_503(gateway: &Gateway, key: &str, body: &str, limit: Duration) -> common::Reply {
    let deadline = Instant::now() + limit;
    loop {
        let reply = gateway.post_json("/pay", Some(key), body).await;
        if reply.status != 503 || Instant::now() >= deadline {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The upstream's runs of `key`: (all, flagged recovered).
fn runs_of(upstream: &Upstream, key: &str) -> (usize, usize) {
    let seen: Vec<_> = upstream
        .state
        .seen("pay")
        .into_iter()
        .filter(|seen| seen.key.as_deref() == Some(key))
        .collect();
    let flagged = seen.iter().filter(|s| s.recovered.as_deref() == Some("true")).count();
    (seen.len(), flagged)
}
