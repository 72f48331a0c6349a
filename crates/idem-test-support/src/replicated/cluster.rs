//! A private Redis Cluster of three primaries (nodes 0–2) with one replica each (nodes 3–5).

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use super::{Nodes, Process, Role, START_TIMEOUT, log_tail, must, query, replication, with_diskless_sync};
use crate::cluster::{BUS_OFFSET, FORMATION, form, node_port, start_node};

/// How many primaries, and replicas (one per primary).
const PRIMARIES: usize = 3;

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
struct NodeLine {
    port: u16,
    flags: Vec<String>,
    primary_id: Option<String>,
    has_slots: bool,
}

impl NodeLine {
    fn parse(line: &str) -> Option<Self> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let port = fields
            .get(1)?
            .split(['@', ','])
            .next()?
            .rsplit_once(':')?
            .1
            .parse()
            .ok()?;
        Some(Self {
            port,
            flags: fields.get(2)?.split(',').map(str::to_owned).collect(),
            primary_id: fields.get(3).filter(|&&id| id != "-").map(|&id| id.to_owned()),
            has_slots: fields.len() > 8,
        })
    }

    fn flagged(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }
}

/// Three primaries, each with a replica, without persistence, `cluster-node-timeout` 1000 ms (an
/// automatic failover takes a few seconds), on loopback ports below 55536. The nodes are killed
/// when this is dropped.
#[derive(Debug)]
pub struct ReplicatedCluster {
    pub(super) nodes: Nodes,
    ids: Vec<String>,
    dir: tempfile::TempDir,
}

/// The options every node starts with (besides those of [`start_node`]), again on a restart.
fn node_options(log: &Path) -> Vec<String> {
    with_diskless_sync(&[
        "--cluster-node-timeout",
        "1000",
        "--cluster-allow-replica-migration",
        "no",
        "--logfile",
        &log.display().to_string(),
    ])
}

fn as_strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

impl ReplicatedCluster {
    /// Starts six `redis-server --cluster-enabled yes`, gives each of nodes 0–2 a third of the
    /// slots, makes node 3 + i a replica of node i, and waits until the cluster is up and every
    /// replica's link is.
    ///
    /// # Panics
    /// If `redis-server` is not installed (`apt-get install redis-server`) or the cluster does not
    /// form within 30 s.
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().expect("a temp dir for the cluster's node files");
        let path = dir.path().to_owned();
        let (nodes, ids) = tokio::task::spawn_blocking(move || {
            let ports: Vec<u16> = (0..2 * PRIMARIES).map(|_| node_port()).collect();
            let nodes: Vec<Process> = ports
                .iter()
                .map(|&port| {
                    let log = path.join(format!("node-{port}.log"));
                    let child = start_node(port, port, &path, &as_strs(&node_options(&log)));
                    Process {
                        port,
                        child: Some(child),
                        frozen: false,
                        log,
                    }
                })
                .collect();
            form(&ports[..PRIMARIES], &ports[..PRIMARIES]);
            let ids = join_replicas(&ports);
            (nodes, ids)
        })
        .await
        .expect("start the cluster");
        let cluster = Self {
            nodes: Nodes { list: nodes },
            ids,
            dir,
        };
        for replica in PRIMARIES..2 * PRIMARIES {
            super::wait_for_link(
                cluster.nodes.list[replica].port,
                cluster.nodes.list[replica - PRIMARIES].port,
                FORMATION,
            )
            .await;
        }
        cluster.wait_until_ok(FORMATION).await;
        cluster.wait_until_all_know_the_replicas().await;
        cluster
    }

    /// Waits until every node lists node `PRIMARIES + i` as the replica of node `i`: the role a
    /// replica took travels by gossip.
    async fn wait_until_all_know_the_replicas(&self) {
        let deadline = Instant::now() + FORMATION;
        for node in &self.nodes.list {
            loop {
                let nodes: redis::RedisResult<String> =
                    query(node.port, redis::cmd("CLUSTER").arg("NODES").clone()).await;
                let known = nodes.as_ref().is_ok_and(|nodes| {
                    let lines: Vec<NodeLine> = nodes.lines().filter_map(NodeLine::parse).collect();
                    (0..PRIMARIES).all(|i| {
                        lines.iter().any(|line| {
                            line.port == self.nodes.list[PRIMARIES + i].port
                                && line.flagged("slave")
                                && line.primary_id.as_deref() == Some(self.node_id(i))
                        })
                    })
                });
                if known {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the node on port {} did not learn the replicas within {FORMATION:?}: {nodes:?}",
                    node.port
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// The cluster's URL: `redis+cluster://127.0.0.1:A,…`, every node a seed.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .list
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// A node's cluster id.
    pub fn node_id(&self, node: usize) -> &str {
        &self.ids[node]
    }

    /// The nodes serving slots now, as the first node that answers sees them (not failed).
    ///
    /// # Panics
    /// If no node answers.
    pub async fn primaries(&self) -> Vec<usize> {
        let mut primaries: Vec<usize> = self
            .topology()
            .await
            .iter()
            .filter(|line| line.flagged("master") && !line.flagged("fail") && line.has_slots)
            .filter_map(|line| self.node_of_port(line.port))
            .collect();
        primaries.sort_unstable();
        primaries
    }

    /// The replica of `primary` (not failed), as the first node that answers sees it.
    pub async fn replica_of(&self, primary: usize) -> Option<usize> {
        self.topology()
            .await
            .iter()
            .find(|line| line.primary_id.as_deref() == Some(self.node_id(primary)) && !line.flagged("fail"))
            .and_then(|line| self.node_of_port(line.port))
    }

    /// The slot of `key` (`CLUSTER KEYSLOT`).
    pub async fn slot_of(&self, key: &str) -> u16 {
        must(self.any_node(), redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).clone()).await
    }

    /// The node serving `slot`, as the first node that answers sees it.
    pub async fn primary_of_slot(&self, slot: u16) -> usize {
        let shards: Vec<redis::Value> = must(self.any_node(), redis::cmd("CLUSTER").arg("SLOTS").clone()).await;
        for shard in &shards {
            let (first, last, port) = parse_shard(shard).expect("a CLUSTER SLOTS entry");
            if (first..=last).contains(&slot) {
                return self.node_of_port(port).expect("a node of this cluster");
            }
        }
        panic!("no node serves slot {slot}");
    }

    /// Starts a killed node again, on its port, with its node file (`nodes-<port>.conf`: it keeps
    /// its id, and the slots and epochs it knew) and its options, and waits until it has rejoined
    /// the cluster. Without persistence it comes back empty. A primary whose slots a replica took
    /// over meanwhile (a higher config epoch) learns so by gossip and becomes that replica's
    /// replica (Redis does this itself), and full-syncs from it.
    ///
    /// Rejoined means: the node says it is a replica whose link to its primary is up and every
    /// live node lists it (not failed) as that primary's replica, so that
    /// [`ReplicatedCluster::replica_of`] and [`ReplicatedCluster::primaries`] see the new
    /// topology; or, if it still owns slots, it says it is a primary with `cluster_state:ok` and
    /// every live node lists it (not failed) as a primary with slots.
    ///
    /// # Panics
    /// If the node is running, its port or bus port was taken while it was dead, it does not
    /// start, or it has not rejoined within 20 s.
    pub async fn restart(&mut self, node: usize) {
        let process = &self.nodes.list[node];
        assert!(
            !process.alive(),
            "node {node} (port {}) is running: only a killed node can be restarted",
            process.port
        );
        let (port, log, dir) = (process.port, process.log.clone(), self.dir.path().to_owned());
        for taken in [port, port + BUS_OFFSET] {
            // Another process may have bound it while the node was dead: fail at once, not in 30 s.
            if let Err(err) = std::net::TcpListener::bind(("127.0.0.1", taken)) {
                panic!("node {node} cannot be restarted: port {taken} was taken while it was dead ({err})");
            }
        }
        let child = tokio::task::spawn_blocking(move || start_node(port, port, &dir, &as_strs(&node_options(&log))))
            .await
            .expect("restart redis-server");
        self.nodes.list[node].child = Some(child);
        self.nodes.list[node].frozen = false;

        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let trouble = match self.rejoined(node).await {
                Ok(()) => return,
                Err(trouble) => trouble,
            };
            assert!(
                Instant::now() < deadline,
                "node {node} (port {port}) did not rejoin the cluster within {START_TIMEOUT:?}: {trouble}; its log:\n{}",
                log_tail(&self.nodes.list[node].log)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether a restarted node has rejoined (see [`ReplicatedCluster::restart`]), or what is
    /// still missing.
    async fn rejoined(&self, node: usize) -> Result<(), String> {
        let port = self.nodes.list[node].port;
        let id = self.node_id(node);
        let state = replication(port)
            .await
            .map_err(|err| format!("INFO replication: {err}"))?;
        let own = self.cluster_nodes(port).await?;
        let myself = own
            .iter()
            .find(|line| line.flagged("myself"))
            .ok_or_else(|| format!("no `myself` line in its CLUSTER NODES: {own:?}"))?;
        // The primary every node must list it under (`None`: it is a primary with slots).
        let expected: Option<String> = match state.role {
            Role::Replica => {
                if !state.link_up {
                    return Err(format!("its link to its primary is not up: {state:?}"));
                }
                let primary_id = myself
                    .primary_id
                    .clone()
                    .ok_or_else(|| format!("a replica without a primary in CLUSTER NODES: {myself:?}"))?;
                let primary = self.ids.iter().position(|other| *other == primary_id);
                let primary_port = primary.map(|primary| self.nodes.list[primary].port);
                if primary_port.is_none() || primary_port != state.primary_port {
                    return Err(format!(
                        "it follows port {:?} but CLUSTER NODES names primary {primary_id}",
                        state.primary_port
                    ));
                }
                Some(primary_id)
            }
            Role::Primary => {
                let info: String = query(port, redis::cmd("CLUSTER").arg("INFO").clone())
                    .await
                    .map_err(|err| format!("CLUSTER INFO: {err}"))?;
                if !info.lines().any(|line| line.trim() == "cluster_state:ok") {
                    return Err(format!("a primary, but not cluster_state:ok: {info:?}"));
                }
                None
            }
        };
        for other in self.live() {
            let lines = if other.port == port {
                own.clone()
            } else {
                self.cluster_nodes(other.port).await?
            };
            let line = lines
                .iter()
                .find(|line| line.port == port)
                .ok_or_else(|| format!("port {} does not list it", other.port))?;
            let as_expected = match &expected {
                Some(primary_id) => line.flagged("slave") && line.primary_id.as_ref() == Some(primary_id),
                None => line.flagged("master") && line.has_slots,
            };
            if !as_expected || line.flagged("fail") || line.flagged("fail?") {
                return Err(format!(
                    "port {} lists it as {line:?} (it is a {:?}, node id {id})",
                    other.port, state.role
                ));
            }
        }
        Ok(())
    }

    /// `CLUSTER NODES` on the node at `port`, parsed.
    async fn cluster_nodes(&self, port: u16) -> Result<Vec<NodeLine>, String> {
        let nodes: String = query(port, redis::cmd("CLUSTER").arg("NODES").clone())
            .await
            .map_err(|err| format!("CLUSTER NODES on port {port}: {err}"))?;
        Ok(nodes.lines().filter_map(NodeLine::parse).collect())
    }

    /// `CLUSTER FAILOVER TAKEOVER` on a replica: it takes its primary's slots without the
    /// primary's or the other primaries' agreement (the primary may be dead), with whatever data
    /// it has. Waits until it says it is a primary and serves slots.
    ///
    /// # Panics
    /// If it has not within 10 s.
    pub async fn failover_takeover(&self, replica: usize) {
        let port = self.nodes.list[replica].port;
        must::<()>(port, redis::cmd("CLUSTER").arg("FAILOVER").arg("TAKEOVER").clone()).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let role = replication(port).await.map(|state| state.role);
            let nodes: redis::RedisResult<String> = query(port, redis::cmd("CLUSTER").arg("NODES").clone()).await;
            let serves = nodes.as_ref().is_ok_and(|nodes| {
                nodes
                    .lines()
                    .filter_map(NodeLine::parse)
                    .any(|line| line.flagged("myself") && line.flagged("master") && line.has_slots)
            });
            if role.as_ref().is_ok_and(|&role| role == Role::Primary) && serves {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node {replica} (port {port}) did not take over within 10 s: {role:?}, {nodes:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every live node (not killed, not frozen) says `cluster_state:ok` and every slot
    /// is served by a live primary in every live node's view.
    ///
    /// # Panics
    /// If that has not happened within `timeout`.
    pub async fn wait_until_ok(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let mut trouble = None;
            for node in self.live() {
                let info: redis::RedisResult<String> =
                    query(node.port, redis::cmd("CLUSTER").arg("INFO").clone()).await;
                let slots: redis::RedisResult<Vec<redis::Value>> =
                    query(node.port, redis::cmd("CLUSTER").arg("SLOTS").clone()).await;
                let ok = info
                    .as_ref()
                    .is_ok_and(|info| info.lines().any(|line| line.trim() == "cluster_state:ok"));
                if !ok {
                    trouble = Some(format!("port {}: {info:?}", node.port));
                    break;
                }
                let served = slots.as_ref().map(|shards| self.served_by_live(shards));
                if served != Ok(16384) {
                    trouble = Some(format!("port {}: {served:?} slots served by live primaries", node.port));
                    break;
                }
            }
            let Some(trouble) = trouble else { return };
            assert!(
                Instant::now() < deadline,
                "the cluster was not ok within {timeout:?}: {trouble}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts moving `slot` from primary `from` to primary `to`: `CLUSTER SETSLOT IMPORTING` on
    /// `to`, then `MIGRATING` on `from`. Clients now get `ASK` redirections for keys not on `from`.
    pub async fn begin_slot_migration(&self, slot: u16, from: usize, to: usize) {
        let setslot = |state: &str, id: &str| {
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(state)
                .arg(id)
                .clone()
        };
        must::<()>(self.nodes.list[to].port, setslot("IMPORTING", self.node_id(from))).await;
        must::<()>(self.nodes.list[from].port, setslot("MIGRATING", self.node_id(to))).await;
    }

    /// Moves the keys of `slot` still on `from` to `to` (`CLUSTER GETKEYSINSLOT`, `MIGRATE`);
    /// returns how many it moved.
    pub async fn migrate_slot_keys(&self, slot: u16, from: usize, to: usize) -> usize {
        let (from_port, to_port) = (self.nodes.list[from].port, self.nodes.list[to].port);
        let mut moved = 0;
        loop {
            let keys: Vec<Vec<u8>> = must(
                from_port,
                redis::cmd("CLUSTER").arg("GETKEYSINSLOT").arg(slot).arg(100).clone(),
            )
            .await;
            if keys.is_empty() {
                return moved;
            }
            let mut migrate = redis::cmd("MIGRATE");
            migrate
                .arg("127.0.0.1")
                .arg(to_port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys);
            must::<String>(from_port, migrate).await;
            moved += keys.len();
        }
    }

    /// Ends a migration: `CLUSTER SETSLOT NODE` on `to`, `from` and every other live primary.
    pub async fn finish_slot_migration(&self, slot: u16, from: usize, to: usize) {
        let setslot = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("NODE")
            .arg(self.node_id(to))
            .clone();
        must::<()>(self.nodes.list[to].port, setslot.clone()).await;
        must::<()>(self.nodes.list[from].port, setslot.clone()).await;
        for primary in self.primaries().await {
            if primary != to && primary != from {
                must::<()>(self.nodes.list[primary].port, setslot.clone()).await;
            }
        }
    }

    /// Moves `slot` from `from` to `to`, all three steps.
    pub async fn migrate_slot(&self, slot: u16, from: usize, to: usize) {
        self.begin_slot_migration(slot, from, to).await;
        self.migrate_slot_keys(slot, from, to).await;
        self.finish_slot_migration(slot, from, to).await;
    }

    /// Waits until the replica of `primary` has applied everything `primary` had written when
    /// this was called.
    ///
    /// # Panics
    /// If it has not within `timeout`.
    pub async fn wait_until_replicated(&self, primary: usize, timeout: Duration) {
        super::wait_until_replicated(self.nodes.list[primary].port, 1, timeout).await;
    }

    fn live(&self) -> impl Iterator<Item = &Process> {
        self.nodes.list.iter().filter(|node| node.alive() && !node.frozen)
    }

    fn node_of_port(&self, port: u16) -> Option<usize> {
        self.nodes.list.iter().position(|node| node.port == port)
    }

    /// The port of a node that answers (the first live one).
    fn any_node(&self) -> u16 {
        self.live()
            .next()
            .map(|node| node.port)
            .expect("a live node in the cluster")
    }

    /// `CLUSTER NODES` from the first live node that answers.
    async fn topology(&self) -> Vec<NodeLine> {
        for node in self.live() {
            if let Ok(nodes) = query::<String>(node.port, redis::cmd("CLUSTER").arg("NODES").clone()).await {
                return nodes.lines().filter_map(NodeLine::parse).collect();
            }
        }
        panic!("no node of the cluster answers CLUSTER NODES");
    }

    /// How many slots `CLUSTER SLOTS` gives to a live node.
    fn served_by_live(&self, shards: &[redis::Value]) -> u32 {
        let live: HashMap<u16, ()> = self.live().map(|node| (node.port, ())).collect();
        shards
            .iter()
            .filter_map(parse_shard)
            .filter(|(_, _, port)| live.contains_key(port))
            .map(|(first, last, _)| u32::from(last - first) + 1)
            .sum()
    }
}

/// A `CLUSTER SLOTS` entry's first and last slot and its primary's port (each node is
/// `[ip, port, id, {hostname…}]`: Redis 7 adds fields, so it is not read as a tuple).
fn parse_shard(shard: &redis::Value) -> Option<(u16, u16, u16)> {
    let fields: Vec<redis::Value> = redis::from_redis_value(shard.clone()).ok()?;
    let first = redis::from_redis_value(fields.first()?.clone()).ok()?;
    let last = redis::from_redis_value(fields.get(1)?.clone()).ok()?;
    let node: Vec<redis::Value> = redis::from_redis_value(fields.get(2)?.clone()).ok()?;
    let port = redis::from_redis_value(node.get(1)?.clone()).ok()?;
    Some((first, last, port))
}

/// Introduces nodes `PRIMARIES..` to the formed primaries and makes node `PRIMARIES + i` a
/// replica of node `i`; returns every node's id.
fn join_replicas(ports: &[u16]) -> Vec<String> {
    let id_of = |port: u16| -> String {
        let mut conn = crate::cluster::connect(port).expect("connect to a cluster node");
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut conn)
            .expect("CLUSTER MYID")
    };
    let ids: Vec<String> = ports.iter().map(|&port| id_of(port)).collect();
    let mut first = crate::cluster::connect(ports[0]).expect("connect to a cluster node");
    for &port in &ports[PRIMARIES..] {
        redis::cmd("CLUSTER")
            .arg("MEET")
            .arg("127.0.0.1")
            .arg(port)
            .query::<()>(&mut first)
            .expect("CLUSTER MEET");
    }
    let deadline = Instant::now() + FORMATION;
    for (i, &port) in ports[PRIMARIES..].iter().enumerate() {
        let mut conn = crate::cluster::connect(port).expect("connect to a cluster node");
        loop {
            // The replica must know its primary before it can follow it.
            let done = redis::cmd("CLUSTER")
                .arg("REPLICATE")
                .arg(&ids[i])
                .query::<()>(&mut conn);
            if done.is_ok() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node on port {port} could not replicate node {} within {FORMATION:?}: {done:?}",
                ids[i]
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    ids
}
