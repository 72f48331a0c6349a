//! The one multiplexed connection of a store, to one server or to a cluster. Both reconnect by
//! themselves after an outage, and both carry pub/sub push messages (RESP3) next to commands.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, PushInfo, RedisFuture, Value};

use crate::url::{Config, Target};

/// How long one command may take before it fails (the store is then unavailable). Generous
/// enough for a stored answer of several MiB.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a cluster command may take with its redirections and retries.
const CLUSTER_OVERALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one attempt to (re)connect may take.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);

/// Reconnection attempts per failed connection, standalone (each failed command starts a new
/// round; commands fail fast meanwhile instead of queueing for minutes).
const RECONNECT_ATTEMPTS: usize = 2;

/// The connection, cheap to clone (clones share it).
#[derive(Clone)]
pub(crate) enum Conn {
    /// One server, reconnected by the connection manager, which also resubscribes.
    Standalone(ConnectionManager),
    /// A cluster: one connection per node, following slot moves; subscriptions follow their slot.
    Cluster(ClusterConnection),
}

impl Conn {
    /// Connects; `push` receives every pub/sub message.
    pub(crate) async fn connect(
        config: &Config,
        push: impl Fn(PushInfo) -> Result<(), std::convert::Infallible> + Send + Sync + 'static,
    ) -> redis::RedisResult<Self> {
        match &config.target {
            Target::Standalone(info) => {
                let client = redis::Client::open(info.clone())?;
                let manager_config = ConnectionManagerConfig::new()
                    .set_push_sender(push)
                    .set_automatic_resubscription()
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
                    .push_sender(push)
                    .response_timeout(RESPONSE_TIMEOUT)
                    .overall_response_timeout(Some(CLUSTER_OVERALL_TIMEOUT))
                    .connection_timeout(CONNECTION_TIMEOUT)
                    .retries(4)
                    .build()?;
                Ok(Self::Cluster(client.get_async_connection().await?))
            }
        }
    }

    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }

    /// Subscribes to a record's channel: `SSUBSCRIBE` on a cluster (sharded pub/sub, the channel
    /// lives on the record's shard), `SUBSCRIBE` on one server.
    pub(crate) async fn subscribe(&mut self, channel: &str) -> redis::RedisResult<()> {
        match self {
            Self::Standalone(conn) => conn.subscribe(channel).await,
            Self::Cluster(conn) => conn.ssubscribe(channel).await,
        }
    }

    pub(crate) async fn unsubscribe(&mut self, channel: &str) -> redis::RedisResult<()> {
        match self {
            Self::Standalone(conn) => conn.unsubscribe(channel).await,
            Self::Cluster(conn) => conn.sunsubscribe(channel).await,
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
