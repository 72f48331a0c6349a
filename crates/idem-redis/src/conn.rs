//! The connection that runs the store's commands: one multiplexed connection to one server, or
//! one per node of a cluster. It never subscribes to anything (wake-ups have their own
//! connection, see `notify`), so the redis crate never resubscribes on it, and no subscription
//! confirmation can ever be taken for a command's reply. If a reply is found to belong to another
//! command anyway, the connection is replaced.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::url::{Config, Target};

/// How long one command may take before it fails (the store is then unavailable). Generous
/// enough for a stored answer of several MiB.
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a cluster command may take with its redirections and retries.
pub(crate) const CLUSTER_OVERALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one attempt to (re)connect may take.
pub(crate) const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);

/// Reconnection attempts per failed connection, standalone (each failed command starts a new
/// round; commands fail fast meanwhile instead of queueing for minutes).
const RECONNECT_ATTEMPTS: usize = 2;

/// The connection, cheap to clone (clones share it).
#[derive(Clone)]
pub(crate) enum Conn {
    /// One server, reconnected by the connection manager.
    Standalone(ConnectionManager),
    /// A cluster: one connection per node, following slot moves.
    Cluster(ClusterConnection),
}

impl Conn {
    /// Connects, without a push sender: this connection carries commands only.
    async fn connect(target: &Target) -> redis::RedisResult<Self> {
        match target {
            Target::Standalone(info) => {
                let client = redis::Client::open(info.clone())?;
                let manager_config = ConnectionManagerConfig::new()
                    .set_response_timeout(Some(RESPONSE_TIMEOUT))
                    .set_connection_timeout(Some(CONNECTION_TIMEOUT))
                    .set_number_of_retries(RECONNECT_ATTEMPTS)
                    .set_max_delay(Duration::from_millis(500));
                let manager = ConnectionManager::new_with_config(client, manager_config).await?;
                Ok(Self::Standalone(manager))
            }
            Target::Cluster(nodes) => {
                let client = ClusterClientBuilder::new(nodes.clone())
                    .use_protocol(redis::ProtocolVersion::RESP3)
                    .response_timeout(RESPONSE_TIMEOUT)
                    .overall_response_timeout(Some(CLUSTER_OVERALL_TIMEOUT))
                    .connection_timeout(CONNECTION_TIMEOUT)
                    .retries(4)
                    .build()?;
                Ok(Self::Cluster(client.get_async_connection().await?))
            }
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Standalone(conn) => conn.req_packed_command(cmd),
            Self::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Standalone(conn) => conn.req_packed_commands(pipeline, offset, count),
            Self::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Standalone(conn) => conn.get_db(),
            Self::Cluster(conn) => conn.get_db(),
        }
    }
}

/// The command connection of a store, replaced when it is found out of step.
pub(crate) struct Commands {
    target: Target,
    current: RwLock<Current>,
    replacing: AtomicBool,
}

struct Current {
    conn: Conn,
    /// Which connection this is, so that a late report about an old one replaces nothing.
    generation: u64,
}

impl Commands {
    pub(crate) async fn connect(config: &Config) -> redis::RedisResult<Arc<Self>> {
        let conn = Conn::connect(&config.target).await?;
        Ok(Arc::new(Self {
            target: config.target.clone(),
            current: RwLock::new(Current { conn, generation: 0 }),
            replacing: AtomicBool::new(false),
        }))
    }

    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.target, Target::Cluster(_))
    }

    /// The connection to send a command on, and its generation for [`Commands::out_of_step`].
    pub(crate) fn get(&self) -> (Conn, u64) {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        (current.conn.clone(), current.generation)
    }

    /// Reports that connection `generation` answered a command with another command's reply:
    /// every later reply on it may be shifted too. A new connection is made in the background and
    /// replaces it; commands already sent on the old one finish there (their replies are checked
    /// like any other).
    pub(crate) fn out_of_step(self: &Arc<Self>, generation: u64) {
        if self.get().1 != generation || self.replacing.swap(true, Ordering::SeqCst) {
            return;
        }
        let this = Arc::clone(self);
        tokio::spawn(async move {
            match Conn::connect(&this.target).await {
                Ok(conn) => {
                    let mut current = this.current.write().unwrap_or_else(PoisonError::into_inner);
                    if current.generation == generation {
                        *current = Current {
                            conn,
                            generation: generation + 1,
                        };
                        tracing::warn!("the Redis connection was out of step; replaced it");
                    }
                }
                // The next reply found out of step tries again.
                Err(err) => tracing::warn!(error = %err, "cannot replace the Redis connection that is out of step"),
            }
            this.replacing.store(false, Ordering::SeqCst);
        });
    }
}
