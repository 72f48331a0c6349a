//! Writes that count only once a replica has them.
//!
//! Redis replicates asynchronously: a primary answers a write before any replica has it, and a
//! failover to a replica that had not received it yet loses it. A lost claim lets a retry run the
//! key again unflagged; a lost answer turns a replay into a recovered run. So on a primary with
//! replicas, every write script is followed, in the same pipeline on the same connection, by
//! `WAIT n timeout`: the store reports the write done only when `n` replicas acknowledged
//! everything the connection wrote, and fails it as unavailable otherwise — exactly as if the
//! store could not be reached, so the upstream is never called on an unacknowledged claim and an
//! answer in hand is held and stored again.
//!
//! `WAIT` blocks the connection that sends it until the replicas answer, so acknowledged calls go
//! over a pool of their own connections, each lent to one call at a time (`ack_pool`): reads never
//! wait behind a `WAIT`, and no write waits behind another's. A replay is a `begin` too, whose
//! script writes nothing: it counts whatever its `WAIT` says (`acknowledged`).
//!
//! How many replicas to wait for is the URL's `replicas=`: a number, or `auto` (the default): one
//! from the moment the topology (`INFO replication`, or `CLUSTER NODES` on a cluster, read again
//! every second) shows a replica for every primary, and from then on — a replica that falls
//! behind or goes away makes writes fail, never makes them unprotected. "From then on" outlives
//! the process: the first instance that sees the replicas writes `PREFIX:replicated`, and every
//! instance or command that starts later reads it, so one started while the replica is cut off
//! (a pod restarted mid-failover, an operator's `idem delete`) waits for it too.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{PoisonError, RwLock, Weak};
use std::time::Duration;

use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{RedisResult, Value};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::ack_pool::{AckPool, Lent, NotLent};
use crate::conn::{Commands, Conn};
use crate::decode::{text, unexpected};
use crate::keys::replicated_key;
use crate::timeouts::RESPONSE_TIMEOUT;
use crate::url::{Config, Replicas};

/// How often `replicas=auto` reads the topology again.
const TOPOLOGY_EVERY: Duration = Duration::from_secs(1);

/// The acknowledgement rule of a store and the connections that carry acknowledged writes.
pub(crate) struct Acknowledgement {
    setting: Replicas,
    timeout: Duration,
    /// Under `replicas=auto`: every primary has been seen with a replica (by this process, or by
    /// an earlier one that wrote `PREFIX:replicated`).
    learned: AtomicBool,
    /// Whether this process has written (or read) `PREFIX:replicated`.
    marked: AtomicBool,
    config: Config,
    pool: OnceCell<AckPool>,
    /// The last topology read, for messages.
    seen: RwLock<Option<u32>>,
}

impl Acknowledgement {
    /// The rule of `config`; under `replicas=auto`, learns the topology once through `commands`
    /// before it returns (a topology that cannot be read is logged and waits for none until it
    /// can).
    pub(crate) async fn new(config: &Config, commands: &Commands) -> RedisResult<Arc<Self>> {
        let this = Arc::new(Self {
            setting: config.replicas,
            timeout: config.replica_timeout,
            learned: AtomicBool::new(false),
            marked: AtomicBool::new(false),
            config: config.clone(),
            pool: OnceCell::new(),
            seen: RwLock::new(None),
        });
        if this.setting == Replicas::Auto {
            // An earlier instance saw the replicas: wait for one even if none is connected now.
            let (mut conn, _) = commands.get();
            let marker: Option<String> = redis::cmd("GET")
                .arg(replicated_key(&config.prefix))
                .query_async(&mut conn)
                .await?;
            if marker.is_some() {
                this.marked.store(true, Ordering::Release);
                this.learned.store(true, Ordering::Release);
            }
            if let Err(err) = this.learn(commands).await {
                tracing::warn!(
                    url = %config.display, error = %err,
                    "cannot read the Redis replication topology; writes wait for no replica until it can be read \
                     (set replicas=N in the store URL to wait regardless)"
                );
            }
        }
        if this.wanted() > 0 {
            this.pool().await?;
        }
        match this.setting {
            Replicas::Exactly(0) => tracing::info!(url = %config.display, "writes wait for no replica (replicas=0)"),
            Replicas::Exactly(n) => tracing::info!(url = %config.display, replicas = n, "writes wait for replicas"),
            Replicas::Auto => tracing::info!(
                url = %config.display,
                replicas = this.wanted(),
                "writes wait for a replica once every primary has one (replicas=auto)"
            ),
        }
        Ok(this)
    }

    /// How many replicas a write waits for now.
    pub(crate) fn wanted(&self) -> u32 {
        match self.setting {
            Replicas::Exactly(n) => n,
            Replicas::Auto => u32::from(self.learned.load(Ordering::Acquire)),
        }
    }

    /// How long a write waits for them.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A connection for one acknowledged write, lent to it alone, by `deadline`.
    pub(crate) async fn lend(&self, deadline: Instant) -> Result<Lent<'_>, NotLent> {
        let pool = self.pool().await.map_err(|err| NotLent::Open(Some(err)))?;
        pool.lend(deadline).await
    }

    /// The connections of the pool, if it is open.
    pub(crate) fn connections(&self) -> Vec<Arc<Commands>> {
        self.pool.get().map(AckPool::connections).unwrap_or_default()
    }

    /// The setting, for messages: `replicas=1`, or `replicas=auto (1 now)`.
    pub(crate) fn setting(&self) -> Setting {
        Setting::new(self.setting, self.wanted())
    }

    async fn pool(&self) -> RedisResult<&AckPool> {
        if let Some(pool) = self.pool.get() {
            return Ok(pool);
        }
        // Boxed: connecting is a future of several kilobytes, made once per process, and every
        // acknowledged write's future would otherwise carry (and move) room for it.
        Box::pin(self.pool.get_or_try_init(|| async {
            // A command on these connections may wait `timeout` for the replicas first.
            AckPool::open(&self.config, RESPONSE_TIMEOUT + self.timeout).await
        }))
        .await
    }

    /// Reads the topology once: under `replicas=auto`, a replica for every primary makes every
    /// later write wait for one (the pool is opened first).
    async fn learn(&self, commands: &Commands) -> RedisResult<()> {
        let (mut conn, _) = commands.get();
        let fewest = fewest_replicas(&mut conn).await?;
        let before = self
            .seen
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(fewest);
        if before != Some(fewest) {
            tracing::info!(url = %self.config.display, replicas = fewest, "Redis replicas per primary (the fewest)");
        }
        if fewest > 0 && !self.learned.load(Ordering::Acquire) {
            self.pool().await?;
            self.learned.store(true, Ordering::Release);
            tracing::info!(url = %self.config.display, "every primary has a replica: writes now wait for one");
        }
        if fewest > 0 && !self.marked.load(Ordering::Acquire) {
            redis::cmd("SET")
                .arg(replicated_key(&self.config.prefix))
                .arg(1)
                .query_async::<()>(&mut conn)
                .await?;
            self.marked.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Under `replicas=auto`, reads the topology every second while `alive` lives.
    pub(crate) fn watch<T: Send + Sync + 'static>(self: &Arc<Self>, commands: Arc<Commands>, alive: Weak<T>) {
        if self.setting != Replicas::Auto {
            return;
        }
        let this = Arc::clone(self);
        tokio::spawn(async move {
            while alive.strong_count() > 0 {
                tokio::time::sleep(TOPOLOGY_EVERY).await;
                if let Err(err) = this.learn(&commands).await {
                    tracing::debug!(error = %err, "cannot read the Redis replication topology");
                }
            }
        });
    }
}

/// The acknowledgement setting as a message names it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Setting {
    replicas: Replicas,
    wanted: u32,
}

impl Setting {
    pub(crate) fn new(replicas: Replicas, wanted: u32) -> Self {
        Self { replicas, wanted }
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.replicas {
            Replicas::Exactly(n) => write!(f, "replicas={n}"),
            Replicas::Auto => write!(f, "replicas=auto, {} now", self.wanted),
        }
    }
}

/// The fewest replicas any primary has: `INFO replication` of the one server (every replica it
/// has, online or still syncing: `ROLE` lists only those online), or `CLUSTER NODES` of a cluster
/// (every primary that owns slots).
async fn fewest_replicas(conn: &mut Conn) -> RedisResult<u32> {
    match conn {
        Conn::Standalone(manager) => {
            let info: Value = redis::cmd("INFO").arg("replication").query_async(manager).await?;
            replicas_of_info(&text(&info).ok_or_else(|| unexpected("INFO replication", &info))?)
        }
        Conn::Cluster(cluster) => {
            let nodes = cluster
                .route_command(
                    redis::cmd("CLUSTER").arg("NODES").clone(),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                )
                .await?;
            fewest_replicas_of_cluster(&text(&nodes).ok_or_else(|| unexpected("CLUSTER NODES", &nodes))?)
        }
    }
}

/// The replicas `INFO replication` counts (`connected_slaves`); a server that is not a primary has
/// none of its own.
fn replicas_of_info(info: &str) -> RedisResult<u32> {
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
    };
    match field("role") {
        Some("master") => field("connected_slaves")
            .and_then(|count| count.parse().ok())
            .ok_or_else(|| unexpected("INFO replication without connected_slaves", &info)),
        Some(_) => Ok(0),
        None => Err(unexpected("INFO replication without a role", &info)),
    }
}

/// The fewest replicas of any primary that owns slots, from `CLUSTER NODES`: one line per node,
/// `id address flags primary-id ping pong epoch link slot...`.
fn fewest_replicas_of_cluster(nodes: &str) -> RedisResult<u32> {
    let lines: Vec<Vec<&str>> = nodes
        .lines()
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .filter(|fields| fields.len() >= 8)
        .collect();
    let is = |fields: &[&str], flag: &str| fields[2].split(',').any(|f| f == flag);
    let owners = lines.iter().filter(|fields| is(fields, "master") && fields.len() > 8);
    let fewest = owners
        .map(|primary| {
            lines
                .iter()
                .filter(|fields| is(fields, "slave") && fields[3] == primary[0])
                .count()
        })
        .min()
        .ok_or_else(|| unexpected("CLUSTER NODES without a primary that owns slots", &nodes))?;
    Ok(u32::try_from(fewest).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_primary_counts_its_replicas_and_a_replica_has_none() {
        let primary = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\n\
                       slave0:ip=127.0.0.1,port=7,state=online,offset=1,lag=0\r\n\
                       slave1:ip=127.0.0.1,port=8,state=wait_bgsave,offset=0,lag=0\r\nmaster_repl_offset:1\r\n";
        assert_eq!(replicas_of_info(primary).unwrap(), 2, "syncing replicas count");
        assert_eq!(replicas_of_info("role:master\r\nconnected_slaves:0\r\n").unwrap(), 0);
        assert_eq!(replicas_of_info("role:slave\r\nmaster_port:6379\r\n").unwrap(), 0);
        assert!(replicas_of_info("role:master\r\n").is_err());
        assert!(replicas_of_info("").is_err());
    }

    #[test]
    fn a_cluster_counts_the_replicas_of_its_poorest_primary() {
        let nodes = "\
a 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460
b 127.0.0.1:7002@17002 master - 0 0 2 connected 5461-10922
c 127.0.0.1:7003@17003 master - 0 0 3 connected 10923-16383
d 127.0.0.1:7004@17004 slave a 0 0 1 connected
e 127.0.0.1:7005@17005 slave b 0 0 2 connected
";
        assert_eq!(fewest_replicas_of_cluster(nodes).unwrap(), 0, "c has none");
        let with_f = format!("{nodes}f 127.0.0.1:7006@17006 slave,fail c 0 0 3 disconnected\n");
        assert_eq!(fewest_replicas_of_cluster(&with_f).unwrap(), 1);
        // A failed primary that lost its slots to its replica no longer counts.
        let failed_over = "\
a 127.0.0.1:7001@17001 master,fail - 0 0 1 disconnected
d 127.0.0.1:7004@17004 myself,master - 0 0 4 connected 0-16383
";
        assert_eq!(fewest_replicas_of_cluster(failed_over).unwrap(), 0);
        assert!(fewest_replicas_of_cluster("").is_err());
    }
}
