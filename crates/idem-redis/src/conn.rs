//! The connection that runs the store's commands: one multiplexed connection to one server, or
//! one per node of a cluster. It never subscribes to anything (wake-ups have their own
//! connection, see `notify`), so the redis crate never resubscribes on it, and no subscription
//! confirmation can ever be taken for a command's reply. If a reply is found to belong to another
//! command anyway, the connection is replaced. It also finds the nodes that hold the keys, for the
//! rare walks over all of them.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, Pipeline, RedisFuture, RedisResult, Value};

use crate::decode::{text, unexpected};
use crate::script_load::ScriptLoads;
use crate::sentinel::{self, named_primaries};
use crate::timeouts::{CLUSTER_OVERALL_TIMEOUT, CONNECTION_TIMEOUT};
use crate::url::{Config, SentinelTarget, Target};

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
    /// Connects, without a push sender: this connection carries commands only. A command may take
    /// `response_timeout` (a cluster command, with its redirections, `CLUSTER_OVERALL_TIMEOUT` more).
    /// Returns the server's address too when it was found through Sentinel.
    async fn connect(target: &Target, response_timeout: Duration) -> redis::RedisResult<(Self, Option<(String, u16)>)> {
        let manager = |info: ConnectionInfo| async move {
            let client = redis::Client::open(info)?;
            let manager_config = ConnectionManagerConfig::new()
                .set_response_timeout(Some(response_timeout))
                .set_connection_timeout(Some(CONNECTION_TIMEOUT))
                .set_number_of_retries(RECONNECT_ATTEMPTS)
                .set_max_delay(Duration::from_millis(500));
            ConnectionManager::new_with_config(client, manager_config).await
        };
        match target {
            Target::Standalone(info) => Ok((Self::Standalone(manager(info.clone()).await?), None)),
            Target::Sentinel(sentinel) => {
                let info = sentinel::primary(sentinel).await?;
                let address = match info.addr() {
                    ConnectionAddr::Tcp(host, port) => Some((host.clone(), *port)),
                    _ => None,
                };
                Ok((Self::Standalone(manager(info).await?), address))
            }
            Target::Cluster(nodes) => {
                let client = ClusterClientBuilder::new(nodes.clone())
                    .use_protocol(redis::ProtocolVersion::RESP3)
                    .response_timeout(response_timeout)
                    .overall_response_timeout(Some(response_timeout + CLUSTER_OVERALL_TIMEOUT))
                    .connection_timeout(CONNECTION_TIMEOUT)
                    .retries(4)
                    .build()?;
                Ok((Self::Cluster(client.get_async_connection().await?), None))
            }
        }
    }
}

/// A node that holds a share of the keys: the one server, or one primary of a cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Node {
    /// The server of a standalone store.
    Server,
    /// A primary of the cluster, at the address the cluster client knows it by.
    Primary {
        /// Its host, as the cluster announces it.
        host: String,
        /// Its port.
        port: u16,
    },
}

impl Conn {
    /// The nodes that together hold every key: the server, or every primary of the cluster
    /// (replicas only hold copies). On a cluster this fails rather than leave a primary out: the
    /// client's fan-out skips a primary it has no connection to yet, so the primaries that answer
    /// must be the ones that own the slots, by the cluster's own account (`CLUSTER SLOTS`).
    pub(crate) async fn primaries(&mut self) -> RedisResult<Vec<Node>> {
        let Self::Cluster(conn) = self else {
            return Ok(vec![Node::Server]);
        };
        // Without a response policy, the client answers a map of every node's address to its reply.
        let all_primaries = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
        let ids = conn
            .route_command(redis::cmd("CLUSTER").arg("MYID").clone(), all_primaries)
            .await?;
        let slots = conn
            .route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            )
            .await?;
        primaries_owning_slots(ids, &slots)
    }

    /// Sends `pipeline` to `node` (a standalone connection has only its server).
    pub(crate) async fn pipeline_on(&mut self, node: &Node, pipeline: &Pipeline) -> RedisResult<Vec<Value>> {
        match (self, node) {
            (Self::Standalone(conn), Node::Server) => conn.req_packed_commands(pipeline, 0, pipeline.len()).await,
            (Self::Cluster(conn), Node::Primary { host, port }) => {
                let route = SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                };
                conn.route_pipeline(pipeline.clone(), 0, pipeline.len(), route).await
            }
            (_, node) => Err((
                ErrorKind::Client,
                "no such node on this connection",
                format!("{node:?}"),
            )
                .into()),
        }
    }
}

/// The primaries of a cluster, from their answers to `CLUSTER MYID` (a map of address to node id),
/// if they are every node that `CLUSTER SLOTS` says owns slots.
fn primaries_owning_slots(ids: Value, slots: &Value) -> RedisResult<Vec<Node>> {
    let Value::Map(answers) = ids else {
        return Err(unexpected("CLUSTER MYID on every primary", &ids));
    };
    let mut primaries = Vec::with_capacity(answers.len());
    let mut answered = HashSet::new();
    for (address, id) in &answers {
        let node = text(address)
            .and_then(|address| {
                let (host, port) = address.rsplit_once(':')?;
                Some(Node::Primary {
                    host: host.to_owned(),
                    port: port.parse().ok()?,
                })
            })
            .ok_or_else(|| unexpected("a node's address", address))?;
        if let Value::ServerError(err) = id {
            return Err(err.clone().into());
        }
        answered.insert(text(id).ok_or_else(|| unexpected("CLUSTER MYID", id))?);
        primaries.push(node);
    }
    // CLUSTER SLOTS: one entry per slot range, [first, last, [host, port, id, ...], replicas...].
    let Value::Array(ranges) = slots else {
        return Err(unexpected("CLUSTER SLOTS", slots));
    };
    for range in ranges {
        let owner = match range {
            Value::Array(parts) => match parts.get(2) {
                Some(Value::Array(owner)) => owner.get(2).and_then(text),
                _ => None,
            },
            _ => None,
        }
        .ok_or_else(|| unexpected("a slot range of CLUSTER SLOTS", range))?;
        if !answered.contains(&owner) {
            return Err((
                ErrorKind::ClusterConnectionNotFound,
                "a primary that owns slots did not answer",
                owner,
            )
                .into());
        }
    }
    Ok(primaries)
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
    /// Whose turn it is to load a script the server is missing (see [`StoreScript::send`](crate::script_load::StoreScript::send)).
    pub(crate) loads: ScriptLoads,
    target: Target,
    response_timeout: Duration,
    current: RwLock<Current>,
    replacing: AtomicBool,
}

struct Current {
    conn: Conn,
    /// The server's address, when it was found through Sentinel.
    address: Option<(String, u16)>,
    /// Which connection this is, so that a late report about an old one replaces nothing.
    generation: u64,
}

impl Commands {
    /// Connects to the store's server or cluster; a command may take `response_timeout`.
    pub(crate) async fn connect(config: &Config, response_timeout: Duration) -> redis::RedisResult<Arc<Self>> {
        let (conn, address) = Conn::connect(&config.target, response_timeout).await?;
        Ok(Arc::new(Self {
            loads: ScriptLoads::default(),
            target: config.target.clone(),
            response_timeout,
            current: RwLock::new(Current {
                conn,
                address,
                generation: 0,
            }),
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
        self.replace(generation, "the Redis connection was out of step; replaced it");
    }

    /// Reports that connection `generation` did not answer a ping: it is replaced, in the
    /// background, by a new one (one replacement at a time; while the server is down, each
    /// attempt fails and the next report tries again).
    pub(crate) fn unanswered(self: &Arc<Self>, generation: u64) {
        self.replace(generation, "the Redis connection did not answer a ping; replaced it");
    }

    /// Where the connection goes, when the server was found through Sentinel.
    pub(crate) fn primary_address(&self) -> Option<(String, u16)> {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        current.address.clone()
    }

    /// Sentinel names another primary: the connection moves there (in the background; until
    /// then, calls go where they went, and a demoted primary refuses writes).
    pub(crate) fn move_to_primary(self: &Arc<Self>) {
        self.replace(self.get().1, "Sentinel names a new Redis primary; moved there");
    }

    /// Replaces connection `generation` (if it is still the current one) by a new one, made in
    /// the background, and logs `done` once it is in place.
    fn replace(self: &Arc<Self>, generation: u64, done: &'static str) {
        if self.get().1 != generation || self.replacing.swap(true, Ordering::SeqCst) {
            return;
        }
        let this = Arc::clone(self);
        tokio::spawn(async move {
            match Conn::connect(&this.target, this.response_timeout).await {
                Ok((conn, address)) => {
                    let mut current = this.current.write().unwrap_or_else(PoisonError::into_inner);
                    if current.generation == generation {
                        *current = Current {
                            conn,
                            address,
                            generation: generation + 1,
                        };
                        tracing::warn!(address = ?current.address, "{done}");
                    }
                }
                // The next report tries again.
                Err(err) => tracing::warn!(error = %err, "cannot replace the Redis connection"),
            }
            this.replacing.store(false, Ordering::SeqCst);
        });
    }
}

/// How often the sentinels are asked where the primary is.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

/// Asks the sentinels every second where the primary is while `alive` lives, and moves every
/// connection that `connections` gives and that is elsewhere to it.
pub(crate) fn follow_sentinels<T: Send + Sync + 'static>(
    target: SentinelTarget,
    connections: impl Fn() -> Vec<Arc<Commands>> + Send + 'static,
    alive: Weak<T>,
) {
    tokio::spawn(async move {
        while alive.strong_count() > 0 {
            tokio::time::sleep(FOLLOW_EVERY).await;
            let named = match named_primaries(&target).await {
                Ok(named) => named.into_iter().next().expect("at least one"),
                Err(err) => {
                    tracing::debug!(error = %err, "no sentinel answered");
                    continue;
                }
            };
            for commands in connections() {
                if commands.primary_address().is_some_and(|current| current != named) {
                    commands.move_to_primary();
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(text: &str) -> Value {
        Value::BulkString(text.as_bytes().to_vec())
    }

    /// `CLUSTER SLOTS` of a cluster whose slot ranges are owned by these node ids.
    fn slots(owners: &[&str]) -> Value {
        let ranges = owners
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let first = i64::try_from(i).unwrap() * 100;
                let owner = Value::Array(vec![bulk("10.0.0.1"), Value::Int(7000), bulk(id)]);
                Value::Array(vec![Value::Int(first), Value::Int(first + 99), owner])
            })
            .collect();
        Value::Array(ranges)
    }

    #[test]
    fn every_primary_that_owns_slots_must_answer() {
        let answers =
            |pairs: &[(&str, &str)]| Value::Map(pairs.iter().map(|(address, id)| (bulk(address), bulk(id))).collect());
        let all = answers(&[("10.0.0.1:7001", "a"), ("::1:7002", "b")]);
        let nodes = primaries_owning_slots(all, &slots(&["a", "b", "a"])).expect("every owner answered");
        assert_eq!(
            nodes,
            vec![
                Node::Primary {
                    host: "10.0.0.1".to_owned(),
                    port: 7001
                },
                Node::Primary {
                    host: "::1".to_owned(),
                    port: 7002
                },
            ]
        );

        let one_missing = answers(&[("10.0.0.1:7001", "a")]);
        let err = primaries_owning_slots(one_missing, &slots(&["a", "b"])).expect_err("b owns slots");
        assert_eq!(err.kind(), ErrorKind::ClusterConnectionNotFound, "{err}");

        assert!(
            primaries_owning_slots(Value::Okay, &slots(&["a"])).is_err(),
            "not a map"
        );
    }
}
