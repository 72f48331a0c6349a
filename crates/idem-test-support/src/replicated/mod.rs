//! Redis with real replication, for tests of what a failover does to stored claims and answers:
//! a private primary with replicas, optionally watched by Sentinels ([`ReplicatedRedis`]), and a
//! private Redis Cluster of three primaries with a replica each ([`ReplicatedCluster`]).
//!
//! Nodes are numbered in the order they were started (`usize`). A test can freeze a node
//! (`SIGSTOP`, as a long pause would), thaw it, kill it (`SIGKILL`, as a crash would), restart a
//! killed cluster node ([`ReplicatedCluster::restart`]: it rejoins with its id), isolate a
//! replica from its primary, promote a replica by hand, and read replication offsets. What either
//! does to one node or asks it directly is [`Nodes`]'s, which both dereference to. Every process
//! is killed when its owner is dropped, frozen ones too. `redis-server` must be installed
//! (`apt-get install redis-server`); Sentinels run as `redis-server <conf> --sentinel`.
//!
//! Freezing a replica does not by itself make it lose what the primary writes meanwhile: the
//! primary's bytes wait in the frozen replica's socket buffer and are applied once it is thawed,
//! even after the primary was killed. To reproduce the loss of acknowledged writes, isolate the
//! replica ([`Nodes::isolate`]): it is frozen and its
//! replication link closed on the primary, so nothing written afterwards reaches it.
//!
//! Methods that talk to Redis or wait are `async` and never block the runtime (the relay of
//! [`ReplicatedRedis::relay`] runs on it); signals (`freeze`, `thaw`, `kill`) are sent at once.

mod cluster;
mod primary;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use cluster::ReplicatedCluster;
pub use primary::{MASTER_NAME, ReplicatedRedis};

/// How to install what these servers need.
const HOW_TO_INSTALL: &str =
    "apt-get install redis-server (redis-server 7 on PATH; Sentinels run as `redis-server <conf> --sentinel`)";

/// How long one command may take before the node is taken for frozen or dead.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a node may take to start, or a replica to connect to its primary.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// What a node says it is (`INFO replication`'s `role`, or a Sentinel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A primary (`role:master`).
    Primary,
    /// A replica (`role:slave`).
    Replica,
}

/// One `redis-server` process of a test's own, on a fixed port that survives a restart.
#[derive(Debug)]
struct Process {
    port: u16,
    child: Option<Child>,
    frozen: bool,
    log: PathBuf,
}

impl Process {
    /// Starts `redis-server` with `args` (port, bind and log file are added) and waits until it
    /// answers.
    async fn start(port: u16, log: PathBuf, args: Vec<String>) -> Self {
        let mut process = Self {
            port,
            child: None,
            frozen: false,
            log,
        };
        process.spawn(args).await;
        process
    }

    /// Starts the process (again) on its port, on a blocking thread.
    async fn spawn(&mut self, args: Vec<String>) {
        assert!(self.child.is_none(), "the node on port {} is running", self.port);
        let (port, log) = (self.port, self.log.clone());
        let child = tokio::task::spawn_blocking(move || spawn(port, &log, &args))
            .await
            .expect("start redis-server");
        self.child = Some(child);
        self.frozen = false;
    }

    fn alive(&self) -> bool {
        self.child.is_some()
    }

    fn signal(&self, signal: &str) {
        let Some(child) = &self.child else {
            panic!("the node on port {} was killed: it cannot be sent {signal}", self.port);
        };
        let status = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .expect("run kill(1)");
        assert!(status.success(), "kill {signal} {} failed", child.id());
    }

    fn freeze(&mut self) {
        self.signal("-STOP");
        self.frozen = true;
    }

    fn thaw(&mut self) {
        self.signal("-CONT");
        self.frozen = false;
    }

    /// `SIGKILL`, and waits until the process is gone (its port closed).
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            if self.frozen {
                let _ = Command::new("kill").args(["-CONT", &child.id().to_string()]).status();
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        self.frozen = false;
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The `redis-server` processes of a [`ReplicatedRedis`] or a [`ReplicatedCluster`] (each
/// dereferences to its own), by node number: what a test does to one node, or asks it directly
/// (no redirection followed).
#[derive(Debug)]
pub struct Nodes {
    list: Vec<Process>,
}

impl Nodes {
    /// A node's URL (`redis://127.0.0.1:P`), for a direct connection.
    pub fn node_url(&self, node: usize) -> String {
        self.list[node].url()
    }

    /// Every node's URL, in node order.
    pub fn node_urls(&self) -> Vec<String> {
        self.list.iter().map(Process::url).collect()
    }

    /// Stops a node (`SIGSTOP`): it holds its connections but answers nothing, as a long pause.
    ///
    /// # Panics
    /// If the node was killed.
    pub fn freeze(&mut self, node: usize) {
        self.list[node].freeze();
    }

    /// Lets a frozen node go on (`SIGCONT`).
    pub fn thaw(&mut self, node: usize) {
        self.list[node].thaw();
    }

    /// Kills a node (`SIGKILL`: a crash, nothing flushed) and waits until it is gone; it stays
    /// dead until restarted ([`ReplicatedCluster::restart`],
    /// [`ReplicatedRedis::restart_as_replica_of`]).
    pub fn kill(&mut self, node: usize) {
        self.list[node].kill();
    }

    /// Freezes a replica and closes its replication link on its primary: nothing written on the
    /// primary from now on reaches it, as a replica partitioned away. [`Nodes::thaw`] lets it go
    /// on; it reconnects if its primary is still up. (A replica that is only frozen still
    /// receives the primary's bytes into its socket buffer and applies them once thawed.)
    ///
    /// # Panics
    /// If the node is not a replica with a link to its primary.
    pub async fn isolate(&mut self, replica: usize) {
        isolate(&mut self.list[replica]).await;
    }

    /// A command on a node, directly; panics with the command and node if it fails.
    pub async fn command<T: redis::FromRedisValue + Send + 'static>(&self, node: usize, cmd: &redis::Cmd) -> T {
        must(self.list[node].port, cmd.clone()).await
    }

    /// A command on a node, directly, with its error (a cluster node's `MOVED` or `ASK`; a frozen
    /// node's is a timeout after 2 s).
    pub async fn try_command<T: redis::FromRedisValue + Send + 'static>(
        &self,
        node: usize,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<T> {
        query(self.list[node].port, cmd.clone()).await
    }
}

/// Makes each of these types, which keep their processes in a field `nodes`, dereference to them.
macro_rules! deref_to_nodes {
    ($($owner:ty),*) => {$(
        impl std::ops::Deref for $owner {
            type Target = Nodes;

            fn deref(&self) -> &Nodes {
                &self.nodes
            }
        }

        impl std::ops::DerefMut for $owner {
            fn deref_mut(&mut self) -> &mut Nodes {
                &mut self.nodes
            }
        }
    )*};
}

deref_to_nodes!(ReplicatedRedis, ReplicatedCluster);

/// `options` after the ones every replicated node starts with: fast diskless full syncs (a
/// primary streams its copy to a new replica at once, without writing it to disk first).
fn with_diskless_sync(options: &[&str]) -> Vec<String> {
    ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        .iter()
        .chain(options)
        .map(|option| (*option).to_owned())
        .collect()
}

/// Starts `redis-server` on `port` with `args` and waits until it answers.
fn spawn(port: u16, log: &Path, args: &[String]) -> Child {
    let mut child = Command::new("redis-server")
        .args(args)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .arg("--logfile")
        .arg(log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|err| panic!("cannot run redis-server ({err}); {HOW_TO_INSTALL}"));
    let deadline = Instant::now() + START_TIMEOUT;
    while crate::cluster::connect(port).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "redis-server on port {port} exited ({status}) at start; its log:\n{}",
                log_tail(log)
            );
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "redis-server on port {port} did not answer within {START_TIMEOUT:?}; its log:\n{}",
                log_tail(log)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// The last lines of a log file, for a failure message.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|err| format!("({} unreadable: {err})", path.display()));
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Runs `cmd` on the node at the loopback `port`, on its own connection, within
/// [`COMMAND_TIMEOUT`] (a frozen node answers with a timeout error). Asynchronous: a blocking
/// socket read can be cut short by a signal (`EINTR`: a test's child process exiting), which the
/// synchronous client reports as an error.
async fn query<T: redis::FromRedisValue + Send + 'static>(port: u16, cmd: redis::Cmd) -> redis::RedisResult<T> {
    on_own_connection(port, |mut conn| async move { cmd.query_async(&mut conn).await }).await
}

/// Runs `call` on a connection of its own to the node at `port`, within [`COMMAND_TIMEOUT`].
async fn on_own_connection<T, F>(
    port: u16,
    call: impl FnOnce(redis::aio::MultiplexedConnection) -> F,
) -> redis::RedisResult<T>
where
    F: Future<Output = redis::RedisResult<T>>,
{
    let attempt = async {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
        call(client.get_multiplexed_async_connection().await?).await
    };
    tokio::time::timeout(COMMAND_TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| Err((redis::ErrorKind::Io, "no answer in time (is the node frozen?)").into()))
}

/// [`query`], panicking with the command and the node on error.
async fn must<T: redis::FromRedisValue + Send + 'static>(port: u16, cmd: redis::Cmd) -> T {
    let shown = String::from_utf8_lossy(&cmd.get_packed_command()).replace("\r\n", " ");
    query(port, cmd)
        .await
        .unwrap_or_else(|err| panic!("`{shown}` on 127.0.0.1:{port} failed: {err}"))
}

/// `INFO <section>` as a map of its `field:value` lines.
async fn info(port: u16, section: &str) -> redis::RedisResult<HashMap<String, String>> {
    let text: String = query(port, redis::cmd("INFO").arg(section).clone()).await?;
    Ok(text
        .lines()
        .filter_map(|line| line.split_once(':'))
        .map(|(field, value)| (field.to_owned(), value.trim().to_owned()))
        .collect())
}

/// What `INFO replication` says of a node: its role, its replication offset, its primary's port
/// and whether its link to it is up (for a replica), and the offset each of its replicas
/// acknowledged, by their listening port (for a primary).
#[derive(Debug, Clone)]
struct Replication {
    role: Role,
    offset: u64,
    primary_port: Option<u16>,
    link_up: bool,
    acked: HashMap<u16, u64>,
    /// The replicas (by listening port) that the primary counts as online: only those
    /// acknowledge writes (`WAIT`).
    online: Vec<u16>,
}

async fn replication(port: u16) -> redis::RedisResult<Replication> {
    let fields = info(port, "replication").await?;
    let role = match fields.get("role").map(String::as_str) {
        Some("master") => Role::Primary,
        _ => Role::Replica,
    };
    let replicas: Vec<HashMap<&str, &str>> = fields
        .iter()
        .filter(|(field, _)| field.starts_with("slave") && field[5..].parse::<u32>().is_ok())
        .map(|(_, value)| value.split(',').filter_map(|pair| pair.split_once('=')).collect())
        .collect();
    let acked = replicas
        .iter()
        .filter_map(|pairs| Some((pairs.get("port")?.parse().ok()?, pairs.get("offset")?.parse().ok()?)))
        .collect();
    let online = replicas
        .iter()
        .filter(|pairs| pairs.get("state") == Some(&"online"))
        .filter_map(|pairs| pairs.get("port")?.parse().ok())
        .collect();
    Ok(Replication {
        role,
        offset: fields
            .get("master_repl_offset")
            .and_then(|offset| offset.parse().ok())
            .unwrap_or(0),
        primary_port: fields.get("master_port").and_then(|port| port.parse().ok()),
        link_up: fields.get("master_link_status").is_some_and(|status| status == "up"),
        acked,
        online,
    })
}

/// Makes the node at `port` a replica of `primary` (`REPLICAOF`), or a primary (`None`).
async fn replicaof(port: u16, primary: Option<u16>) {
    let mut cmd = redis::cmd("REPLICAOF");
    match primary {
        Some(primary) => cmd.arg("127.0.0.1").arg(primary),
        None => cmd.arg("NO").arg("ONE"),
    };
    must::<()>(port, cmd).await;
}

/// Waits until the replica at `port` follows `primary` with its link up, the primary counts it
/// online, and its replicas acknowledge a write (see [`acknowledged`]).
async fn wait_for_link(port: u16, primary: u16, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let state = replication(port).await;
        let primary_state = replication(primary).await;
        let mut acknowledges = false;
        if let Ok(state) = &state
            && state.role == Role::Replica
            && state.primary_port == Some(primary)
            && state.link_up
            && let Ok(primary_state) = &primary_state
            && primary_state.online.contains(&port)
        {
            acknowledges = acknowledged(primary, primary_state.online.len()).await;
            if acknowledges {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the replica on port {port} did not connect to its primary on port {primary} within {timeout:?}: \
             the replica {state:?}, the primary {primary_state:?}, a write acknowledged: {acknowledges}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `replicas` replicas of the primary at `port` acknowledge a write at once (`WAIT`, on
/// the connection that wrote). A replica that has just loaded its copy is online before the primary
/// streams it writes (Redis starts the stream at its first acknowledgement, up to a second later):
/// until then, `WAIT` times out.
async fn acknowledged(port: u16, replicas: usize) -> bool {
    let mut write = redis::pipe();
    write
        .cmd("SET")
        .arg("idem-test-support:acknowledged")
        .arg(1)
        .ignore()
        .cmd("WAIT")
        .arg(replicas)
        .arg(200);
    let written = on_own_connection(port, |mut conn| async move {
        write.query_async::<(usize,)>(&mut conn).await
    })
    .await;
    match written {
        Ok((acknowledged,)) => acknowledged >= replicas,
        // A cluster node that does not own the key's slot (or not yet, while the cluster forms)
        // refuses the write: not checked there (a cluster test's first writes may then still
        // wait up to a second for the stream).
        Err(err)
            if matches!(
                err.kind(),
                redis::ErrorKind::Server(
                    redis::ServerErrorKind::Moved | redis::ServerErrorKind::Ask | redis::ServerErrorKind::ClusterDown
                )
            ) =>
        {
            true
        }
        Err(_) => false,
    }
}

/// Cuts the replica at `port` off its primary: freezes it, then closes its replication link on
/// the primary, so that nothing the primary executes afterwards reaches it (not even into its
/// socket buffer). Returns the primary's port.
async fn isolate(process: &mut Process) -> u16 {
    let port = process.port;
    let state = replication(port)
        .await
        .unwrap_or_else(|err| panic!("INFO replication on {port}: {err}"));
    let primary = match (state.role, state.primary_port) {
        (Role::Replica, Some(primary)) => primary,
        _ => panic!("only a replica can be isolated; the node on port {port} is {state:?}"),
    };
    let link: String = must(port, redis::cmd("CLIENT").arg("LIST").arg("TYPE").arg("master").clone()).await;
    let laddr = link
        .split_whitespace()
        .find_map(|field| field.strip_prefix("laddr="))
        .unwrap_or_else(|| panic!("the replica on port {port} has no link to its primary: {link:?}"))
        .to_owned();
    process.freeze();
    let closed: i64 = must(
        primary,
        redis::cmd("CLIENT").arg("KILL").arg("ADDR").arg(&laddr).clone(),
    )
    .await;
    assert_eq!(
        closed, 1,
        "the primary on port {primary} had no connection from {laddr}"
    );
    primary
}

/// Waits until `replicas` of the replicas the primary at `port` lists have applied everything it
/// had written when this was called (their own `master_repl_offset` reached the primary's). (Not
/// `WAIT`: it counts the writes of its own connection only, and each command here has its own.)
async fn wait_until_replicated(port: u16, replicas: usize, timeout: Duration) {
    let target = replication(port)
        .await
        .unwrap_or_else(|err| panic!("INFO replication on the primary on port {port}: {err}"))
        .offset;
    let deadline = Instant::now() + timeout;
    loop {
        let listed: Vec<u16> = replication(port)
            .await
            .map(|state| state.acked.into_keys().collect())
            .unwrap_or_default();
        let mut caught_up = 0;
        for replica in &listed {
            if replication(*replica).await.is_ok_and(|state| state.offset >= target) {
                caught_up += 1;
            }
        }
        if caught_up >= replicas {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{replicas} replicas did not reach offset {target} of the primary on port {port} within {timeout:?} \
             ({caught_up} of the listed {listed:?} did)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
