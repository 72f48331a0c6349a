//! A private primary with replicas, optionally watched by Sentinels, and a relay that plays a
//! managed endpoint's address (pointed at the primary, re-pointed after a failover).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::{
    Nodes, Process, Replication, Role, START_TIMEOUT, query, replicaof, replication, wait_for_link, with_diskless_sync,
};
use crate::relay::Relay;
use crate::servers::free_port;

/// The name the Sentinels monitor the primary under.
pub const MASTER_NAME: &str = "idem";

/// A primary (node 0 at start) and its replicas (nodes 1…), each a `redis-server` without
/// persistence on a free loopback port, maybe watched by Sentinels (`down-after-milliseconds`
/// 1000, `failover-timeout` 5000: a failover takes a few seconds), and a [`Relay`] in front of the
/// primary. Every process is killed when this is dropped.
#[derive(Debug)]
pub struct ReplicatedRedis {
    pub(super) nodes: Nodes,
    sentinels: Vec<Process>,
    primary: usize,
    relay: Relay,
    dir: tempfile::TempDir,
}

/// The options every node starts with: no persistence, fast diskless full syncs, and a replica
/// that notices a dead link (or a primary a frozen replica) within seconds.
fn node_args(dir: &std::path::Path) -> Vec<String> {
    with_diskless_sync(&[
        "--save",
        "",
        "--appendonly",
        "no",
        "--repl-timeout",
        "5",
        "--dir",
        &dir.display().to_string(),
    ])
}

impl ReplicatedRedis {
    /// Starts a primary and `replicas` replicas of it, and waits until every replica's link is up.
    ///
    /// # Panics
    /// If `redis-server` is not installed (`apt-get install redis-server`) or the replicas do not
    /// connect within 20 s.
    pub async fn start(replicas: usize) -> Self {
        Self::start_with_sentinels(replicas, 0).await
    }

    /// As [`ReplicatedRedis::start`], with `sentinels` Sentinels (3 is usual; quorum a majority)
    /// monitoring the primary as [`MASTER_NAME`], announcing 127.0.0.1; waits until each sees
    /// every replica and every other Sentinel, so that a failover can be authorised at once.
    ///
    /// # Panics
    /// As [`ReplicatedRedis::start`], or if the Sentinels do not agree within 20 s.
    pub async fn start_with_sentinels(replicas: usize, sentinels: usize) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir for the replicated Redis");
        let mut nodes = Vec::with_capacity(replicas + 1);
        for _ in 0..=replicas {
            let port = free_port();
            let log = dir.path().join(format!("node-{port}.log"));
            nodes.push(Process::start(port, log, node_args(dir.path())).await);
        }
        let primary_port = nodes[0].port;
        for node in &nodes[1..] {
            replicaof(node.port, Some(primary_port)).await;
        }
        for node in &nodes[1..] {
            wait_for_link(node.port, primary_port, START_TIMEOUT).await;
        }
        let mut started = Vec::with_capacity(sentinels);
        for _ in 0..sentinels {
            let port = free_port();
            let conf = dir.path().join(format!("sentinel-{port}.conf"));
            let quorum = sentinels / 2 + 1;
            let text = format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nsentinel announce-ip 127.0.0.1\n\
                 sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_port} {quorum}\n\
                 sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
                 sentinel failover-timeout {MASTER_NAME} 5000\n\
                 sentinel parallel-syncs {MASTER_NAME} {replicas}\n",
                dir = dir.path().display(),
                replicas = replicas.max(1),
            );
            std::fs::write(&conf, text).expect("write a Sentinel's configuration");
            let log = dir.path().join(format!("sentinel-{port}.log"));
            let args = vec![conf.display().to_string(), "--sentinel".to_owned()];
            started.push(Process::start(port, log, args).await);
        }
        let relay = Relay::start(SocketAddr::from(([127, 0, 0, 1], primary_port))).await;
        let this = Self {
            nodes: Nodes { list: nodes },
            sentinels: started,
            primary: 0,
            relay,
            dir,
        };
        this.wait_for_sentinels(replicas).await;
        this
    }

    /// Waits until every Sentinel sees `replicas` connected replicas and every other Sentinel.
    async fn wait_for_sentinels(&self, replicas: usize) {
        let deadline = Instant::now() + START_TIMEOUT;
        for sentinel in &self.sentinels {
            loop {
                let seen_replicas = sentinel_list(sentinel.port, "REPLICAS").await;
                let others = sentinel_list(sentinel.port, "SENTINELS").await;
                let connected = seen_replicas.as_ref().map_or(0, |seen| {
                    seen.iter()
                        .filter(|fields| field(fields, "flags").is_some_and(|flags| flags == "slave"))
                        .count()
                });
                let ready = connected == replicas
                    && others
                        .as_ref()
                        .is_ok_and(|others| others.len() + 1 == self.sentinels.len());
                if ready {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the Sentinel on port {} did not see {replicas} replicas and {} other Sentinels within {START_TIMEOUT:?}: {seen_replicas:?}, {others:?}; its log:\n{}",
                    sentinel.port,
                    self.sentinels.len() - 1,
                    super::log_tail(&sentinel.log)
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// The node taken for the primary: node 0 at start, then the one [`ReplicatedRedis::promote`]
    /// or [`ReplicatedRedis::wait_for_failover`] named.
    pub fn primary(&self) -> usize {
        self.primary
    }

    /// The other nodes (replicas, or nodes that were killed or lost their role).
    pub fn replicas(&self) -> Vec<usize> {
        (0..self.nodes.list.len())
            .filter(|&node| node != self.primary)
            .collect()
    }

    /// The primary's URL (`redis://127.0.0.1:P`), reached directly.
    pub fn primary_url(&self) -> String {
        self.node_url(self.primary)
    }

    /// A node's address.
    pub fn node_addr(&self, node: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.nodes.list[node].port))
    }

    /// The Sentinels' addresses (none unless started with Sentinels).
    pub fn sentinel_addrs(&self) -> Vec<SocketAddr> {
        self.sentinels
            .iter()
            .map(|sentinel| SocketAddr::from(([127, 0, 0, 1], sentinel.port)))
            .collect()
    }

    /// `redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/idem`: the store's URL of the
    /// primary through the Sentinels.
    pub fn sentinel_url(&self) -> String {
        self.sentinel_url_for(MASTER_NAME)
    }

    /// The Sentinels' URL naming another master name (one they do not monitor, for a test of
    /// that error).
    pub fn sentinel_url_for(&self, master: &str) -> String {
        let hosts: Vec<String> = self.sentinel_addrs().iter().map(SocketAddr::to_string).collect();
        format!("redis+sentinel://{}/{master}", hosts.join(","))
    }

    /// The relay that plays a managed endpoint: it forwards to the primary until
    /// [`ReplicatedRedis::point_endpoint_at`] moves it. Its faults are the [`Relay`]'s.
    pub fn relay(&self) -> &Relay {
        &self.relay
    }

    /// The endpoint's URL (`redis://` the relay).
    pub fn endpoint_url(&self) -> String {
        format!("redis://{}", self.relay.addr())
    }

    /// Moves the endpoint to `node`, as a managed service does after a failover: new connections
    /// go there, and the open ones are reset.
    pub fn point_endpoint_at(&self, node: usize) {
        self.relay.retarget(self.node_addr(node));
        self.relay.reset_all();
    }

    /// Kills a Sentinel.
    pub fn kill_sentinel(&mut self, sentinel: usize) {
        self.sentinels[sentinel].kill();
    }

    /// Starts a killed node again, empty, on its port, as a replica of `primary`, and waits until
    /// its link is up.
    pub async fn restart_as_replica_of(&mut self, node: usize, primary: usize) {
        let primary_port = self.nodes.list[primary].port;
        let mut args = node_args(self.dir.path());
        args.extend([
            "--replicaof".to_owned(),
            "127.0.0.1".to_owned(),
            primary_port.to_string(),
        ]);
        self.nodes.list[node].spawn(args).await;
        wait_for_link(self.nodes.list[node].port, primary_port, START_TIMEOUT).await;
    }

    /// Promotes a node by hand (`REPLICAOF NO ONE`) and takes it for the primary from now on.
    pub async fn promote(&mut self, node: usize) {
        replicaof(self.nodes.list[node].port, None).await;
        self.primary = node;
    }

    /// Makes `node` a replica of `primary` (`REPLICAOF`) and waits until its link is up.
    pub async fn follow(&self, node: usize, primary: usize) {
        let primary_port = self.nodes.list[primary].port;
        replicaof(self.nodes.list[node].port, Some(primary_port)).await;
        wait_for_link(self.nodes.list[node].port, primary_port, START_TIMEOUT).await;
    }

    /// Waits until a Sentinel names a primary other than the one taken so far
    /// (`SENTINEL GET-MASTER-ADDR-BY-NAME`) and that node says it is a primary; takes it for the
    /// primary and returns it.
    ///
    /// # Panics
    /// If there are no Sentinels, or no failover completes within `timeout`.
    pub async fn wait_for_failover(&mut self, timeout: Duration) -> usize {
        assert!(
            !self.sentinels.is_empty(),
            "start with Sentinels to wait for their failover"
        );
        let old = self.nodes.list[self.primary].port;
        let deadline = Instant::now() + timeout;
        let mut named = Vec::new();
        loop {
            named.clear();
            for sentinel in self.sentinels.iter().filter(|sentinel| sentinel.alive()) {
                let addr: redis::RedisResult<Option<(String, u16)>> = query(
                    sentinel.port,
                    redis::cmd("SENTINEL")
                        .arg("GET-MASTER-ADDR-BY-NAME")
                        .arg(MASTER_NAME)
                        .clone(),
                )
                .await;
                named.push(addr);
            }
            let new = named
                .iter()
                .filter_map(|addr| addr.as_ref().ok().and_then(Option::as_ref).map(|(_, port)| *port))
                .find(|&port| port != old)
                .and_then(|port| self.nodes.list.iter().position(|node| node.port == port));
            if let Some(new) = new
                && self.role(new).await == Some(Role::Primary)
            {
                self.primary = new;
                return new;
            }
            assert!(
                Instant::now() < deadline,
                "no Sentinel failover from port {old} within {timeout:?}; the Sentinels name {named:?}; \
                 the first Sentinel's log:\n{}",
                self.sentinels
                    .first()
                    .map(|s| super::log_tail(&s.log))
                    .unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What a node says it is, or `None` if it does not answer (frozen, killed).
    pub async fn role(&self, node: usize) -> Option<Role> {
        self.state(node).await.map(|state| state.role)
    }

    /// A node's replication offset (`master_repl_offset`: on a replica, how far it has applied
    /// its primary's stream), or `None` if it does not answer.
    pub async fn replication_offset(&self, node: usize) -> Option<u64> {
        self.state(node).await.map(|state| state.offset)
    }

    /// The offset a replica last acknowledged to the primary, as the primary reports it (readable
    /// while the replica is frozen; replicas acknowledge once a second), or `None` if the primary
    /// does not list it.
    pub async fn acked_offset(&self, replica: usize) -> Option<u64> {
        let primary = self.state(self.primary).await?;
        primary.acked.get(&self.nodes.list[replica].port).copied()
    }

    /// How many bytes of the primary's stream a replica has not acknowledged (the whole offset if
    /// the primary does not list it).
    ///
    /// # Panics
    /// If the primary does not answer.
    pub async fn lag(&self, replica: usize) -> u64 {
        let primary = self
            .state(self.primary)
            .await
            .expect("the primary answers INFO replication");
        primary
            .offset
            .saturating_sub(primary.acked.get(&self.nodes.list[replica].port).copied().unwrap_or(0))
    }

    /// Waits until `replicas` replicas have applied everything the primary had written when this
    /// was called (their own offsets, not their acknowledgements).
    ///
    /// # Panics
    /// If they have not within `timeout`.
    pub async fn wait_until_replicated(&self, replicas: usize, timeout: Duration) {
        super::wait_until_replicated(self.nodes.list[self.primary].port, replicas, timeout).await;
    }

    async fn state(&self, node: usize) -> Option<Replication> {
        let process = &self.nodes.list[node];
        if !process.alive() || process.frozen {
            return None;
        }
        replication(process.port).await.ok()
    }
}

/// `SENTINEL <what> <MASTER_NAME>` (`REPLICAS`, `SENTINELS`): a list of field-value lists.
async fn sentinel_list(port: u16, what: &str) -> redis::RedisResult<Vec<Vec<String>>> {
    query(port, redis::cmd("SENTINEL").arg(what).arg(MASTER_NAME).clone()).await
}

/// The value of `name` in a Sentinel's flat list of field names and values.
fn field<'a>(fields: &'a [String], name: &str) -> Option<&'a str> {
    fields
        .chunks(2)
        .find(|pair| pair[0] == name)
        .and_then(|pair| pair.get(1))
        .map(String::as_str)
}

impl Drop for ReplicatedRedis {
    fn drop(&mut self) {
        // Sentinels first, so that none reconfigures what is being torn down.
        for sentinel in &mut self.sentinels {
            sentinel.kill();
        }
        for node in &mut self.nodes.list {
            node.kill();
        }
    }
}
