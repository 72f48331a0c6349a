//! A private three-node Redis Cluster whose every node sits behind a fault relay.
//!
//! A cluster cannot simply be put behind one relay: its nodes tell clients where each slot lives,
//! and clients then connect there. Here each node *announces* its relay's address
//! (`cluster-announce-port`), so clients reach every node, after every redirection, through the
//! relays, while the nodes talk to each other directly on their bus ports. Being private, the
//! cluster can be hurt without disturbing the tests that share the machine's cluster.

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::relay::Relay;
use crate::servers::HOW_TO_START;

/// The bus port of a node is its port plus this (Redis' rule), so node ports stay below 55536.
pub(crate) const BUS_OFFSET: u16 = 10_000;
/// How long the cluster may take to agree (`cluster_state:ok` on every node).
pub(crate) const FORMATION: Duration = Duration::from_secs(30);

/// The three nodes and their relays; the nodes are killed when this is dropped.
#[derive(Debug)]
pub struct RelayedCluster {
    relays: Vec<Relay>,
    ports: Vec<u16>,
    nodes: Vec<Child>,
    _dir: tempfile::TempDir,
}

impl RelayedCluster {
    /// Starts three `redis-server --cluster-enabled yes` on free ports, each announcing its
    /// relay, assigns the slots and waits until the cluster is up.
    ///
    /// # Panics
    /// If `redis-server` is not installed, or the cluster does not form within 30 s.
    pub async fn start() -> Self {
        let ports: Vec<u16> = (0..3).map(|_| node_port()).collect();
        let mut relays = Vec::with_capacity(ports.len());
        for &port in &ports {
            relays.push(Relay::start(SocketAddr::from(([127, 0, 0, 1], port))).await);
        }
        let announced: Vec<u16> = relays.iter().map(|relay| relay.addr().port()).collect();
        let dir = tempfile::tempdir().expect("a temp dir for the cluster's node files");
        let (ports, nodes, dir) = tokio::task::spawn_blocking(move || {
            let nodes = ports
                .iter()
                .zip(&announced)
                .map(|(&port, &relay)| start_node(port, relay, dir.path(), &[]))
                .collect::<Vec<_>>();
            form(&ports, &announced);
            (ports, nodes, dir)
        })
        .await
        .expect("start the cluster");
        Self {
            relays,
            ports,
            nodes,
            _dir: dir,
        }
    }

    /// The cluster's URL through the relays: `redis+cluster://127.0.0.1:R1,…`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.relays.iter().map(|relay| relay.addr().to_string()).collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// The relays, one per node.
    pub fn relays(&self) -> Vec<&Relay> {
        self.relays.iter().collect()
    }

    /// The nodes' own addresses, for direct connections that no fault touches.
    pub fn node_urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|port| format!("redis://127.0.0.1:{port}"))
            .collect()
    }
}

impl Drop for RelayedCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.kill();
            let _ = node.wait();
        }
    }
}

/// A free port whose bus port (port + 10 000) is free too, never handed out before in this
/// process: tests that start clusters at once each pick their ports before any node binds them,
/// so a port free when checked could otherwise go to two nodes of two clusters.
pub(crate) fn node_port() -> u16 {
    use std::collections::BTreeSet;
    use std::hash::{BuildHasher, RandomState};
    use std::sync::{Mutex, PoisonError};
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    // Below the kernel's ephemeral range (32768 and up on Linux), bus ports included: a port that
    // is free when checked cannot then be taken by some connection's local end before the node
    // binds it.
    const PORTS: std::ops::Range<u16> = 20_000..22_700;
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
    for attempt in 0..1000_u64 {
        let random = RandomState::new().hash_one(attempt);
        let port = PORTS.start + u16::try_from(random % u64::from(PORTS.end - PORTS.start)).expect("in range");
        if !handed_out.contains(&port)
            && TcpListener::bind(("127.0.0.1", port)).is_ok()
            && TcpListener::bind(("127.0.0.1", port + BUS_OFFSET)).is_ok()
        {
            handed_out.insert(port);
            return port;
        }
    }
    panic!("no free port pair (port, port + 10000) between 20000 and 32700 for a Redis Cluster node");
}

/// Starts a cluster node on `port` that announces `announce` as its port to clients (its relay's,
/// or its own), with its node file in `dir` and `extra` options; returns once it answers.
pub(crate) fn start_node(port: u16, announce: u16, dir: &std::path::Path, extra: &[&str]) -> Child {
    let mut child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--cluster-enabled", "yes"])
        .arg("--cluster-config-file")
        .arg(dir.join(format!("nodes-{port}.conf")))
        .arg("--dir")
        .arg(dir)
        .args(["--save", "", "--appendonly", "no"])
        .args(["--cluster-announce-ip", "127.0.0.1"])
        .args(["--cluster-announce-port", &announce.to_string()])
        .args(["--cluster-announce-bus-port", &(port + BUS_OFFSET).to_string()])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|err| panic!("cannot run redis-server ({err}); {HOW_TO_START}"));
    let deadline = Instant::now() + FORMATION;
    let mut conn = loop {
        if let Ok(conn) = connect(port) {
            break conn;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "redis-server on port {port} exited as it started ({status}): was the port, or port + 10000, taken?"
            );
        }
        assert!(Instant::now() < deadline, "redis-server on port {port} did not start");
        std::thread::sleep(Duration::from_millis(20));
    };
    // The server that answers must be the one just started, not another that holds the port.
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query(&mut conn)
        .expect("INFO server of a new cluster node");
    let pid = info
        .lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .and_then(|pid| pid.trim().parse::<u32>().ok());
    if pid != Some(child.id()) {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "port {port} is held by another redis-server (process {pid:?}), not the node just started (process {})",
            child.id()
        );
    }
    child
}

/// A connection to the loopback `port`, checked with a `PING`.
pub(crate) fn connect(port: u16) -> redis::RedisResult<redis::Connection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let mut conn = client.get_connection_with_timeout(Duration::from_secs(1))?;
    redis::cmd("PING").query::<String>(&mut conn)?;
    Ok(conn)
}

/// Assigns an equal share of the slots to each node, introduces them, and waits until all agree.
pub(crate) fn form(ports: &[u16], announced: &[u16]) {
    let mut conns: Vec<redis::Connection> = ports
        .iter()
        .map(|&port| connect(port).expect("connect to a new cluster node"))
        .collect();
    let n = u32::try_from(ports.len()).expect("a few nodes");
    for (i, conn) in (0u32..).zip(conns.iter_mut()) {
        let (first, last) = (16384 * i / n, 16384 * (i + 1) / n - 1);
        redis::cmd("CLUSTER")
            .arg("ADDSLOTSRANGE")
            .arg(first)
            .arg(last)
            .query::<()>(conn)
            .expect("CLUSTER ADDSLOTSRANGE");
    }
    for (&port, &relay) in ports.iter().zip(announced).skip(1) {
        redis::cmd("CLUSTER")
            .arg("MEET")
            .arg("127.0.0.1")
            .arg(relay)
            .arg(port + BUS_OFFSET)
            .query::<()>(&mut conns[0])
            .expect("CLUSTER MEET");
    }
    let deadline = Instant::now() + FORMATION;
    loop {
        let agreed = conns.iter_mut().all(|conn| {
            let info: String = redis::cmd("CLUSTER").arg("INFO").query(conn).unwrap_or_default();
            let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(conn).unwrap_or_default();
            info.lines().any(|line| line.trim() == "cluster_state:ok")
                && announced
                    .iter()
                    .all(|relay| nodes.contains(&format!("127.0.0.1:{relay}@")))
        });
        if agreed {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the private Redis Cluster on ports {ports:?} did not reach cluster_state:ok within {FORMATION:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
