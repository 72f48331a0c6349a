//! Wake-ups for [`idem_core::Store::wait`]: pub/sub on a connection of its own, never on the
//! connection that runs commands.
//!
//! Waiters register their record's channel with a subscription task, which subscribes when the
//! first waiter of a channel arrives and unsubscribes when the last one leaves. The task does
//! this one request at a time, so a `SUBSCRIBE` and an `UNSUBSCRIBE` of the same channel can never
//! overtake each other. Messages arrive as RESP3 push messages; the connection hands them to
//! [`Registry::dispatch`], which wakes the channel's waiters at once, without going through the
//! task.
//!
//! On one server the task keeps its connection itself, and the redis crate's automatic
//! resubscription is not used: after a reconnection it sends one `SUBSCRIBE` for N channels and
//! expects one reply, so when that times out the N-1 other confirmations are taken for the
//! replies of later requests. Here every `SUBSCRIBE` names one channel and its confirmation must
//! name it too; a connection that fails, times out or answers out of step is dropped, and the next
//! one subscribes to every watched channel again, then wakes every waiter to look again (messages
//! published meanwhile are lost).
//!
//! On a cluster, sharded pub/sub (`SSUBSCRIBE`, the channel lives on its record's shard) on a
//! cluster connection of its own, which follows the slots and resubscribes after reconnecting.
//! That resubscription has the same flaw, but on this connection a misplaced confirmation can
//! only be taken for another subscription's, never for a command's reply: at worst a waiter
//! polls.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use idem_core::store::Invalidations;
use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, PushInfo, PushKind, Value};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;

use crate::sentinel;
use crate::timeouts::{CLUSTER_OVERALL_TIMEOUT, CONNECTION_TIMEOUT, RESPONSE_TIMEOUT};
use crate::url::{Config, SentinelTarget, Target};

/// The longest pause between two attempts to reconnect the pub/sub connection.
const MAX_RECONNECT_PAUSE: Duration = Duration::from_secs(2);

/// The channels waited on in this store, and how to wake their waiters; and the deletions
/// channel, whose messages go to the replay caches.
#[derive(Debug)]
pub(crate) struct Registry {
    channels: Mutex<HashMap<Vec<u8>, Arc<Notify>>>,
    deletions: Deletions,
}

/// The store's deletions channel (`PREFIX:deletions`, see `keys.rs`) and the replay caches it
/// tells. It is watched for as long as the store lives; while it is not subscribed the caches
/// answer nothing ([`Invalidations::lost`]).
#[derive(Debug, Clone)]
pub(crate) struct Deletions {
    pub(crate) channel: String,
    pub(crate) invalidations: Arc<Invalidations>,
}

impl Deletions {
    fn is(&self, channel: &str) -> bool {
        self.channel == channel
    }

    /// Tells the caches whether the channel is subscribed now.
    fn subscribed(&self, subscribed: bool) {
        if subscribed {
            self.invalidations.resumed();
        } else {
            self.invalidations.lost();
        }
    }
}

impl Registry {
    fn channels(&self) -> MutexGuard<'_, HashMap<Vec<u8>, Arc<Notify>>> {
        // Every critical section is one map call: the map stays consistent after a panic.
        self.channels.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes the waiters of the channel a message was published on. Called by the connection for
    /// every push message; must not block.
    fn dispatch(&self, push: &PushInfo) {
        if !matches!(push.kind, PushKind::Message | PushKind::SMessage) {
            return;
        }
        let Some(Value::BulkString(channel)) = push.data.first() else {
            return;
        };
        if channel.as_slice() == self.deletions.channel.as_bytes() {
            match push.data.get(1) {
                Some(Value::BulkString(digest)) if digest.len() == 16 => {
                    let mut record = [0; 16];
                    record.copy_from_slice(digest);
                    self.deletions.invalidations.deleted(&record);
                }
                // Not a digest (another version's message?): forget everything, to be safe.
                _ => self.deletions.invalidations.flush(),
            }
        } else if let Some(notify) = self.channels().get(channel.as_slice()) {
            notify.notify_waiters();
        }
    }

    /// Wakes every waiter, so that each looks at its record again.
    fn wake_all(&self) {
        for notify in self.channels().values() {
            notify.notify_waiters();
        }
    }
}

enum Request {
    Watch {
        channel: String,
        subscribed: oneshot::Sender<Arc<Notify>>,
    },
    Unwatch {
        channel: String,
    },
}

/// The handle on the subscription task; the task ends when the store (and every watch) is gone.
#[derive(Debug, Clone)]
pub(crate) struct Subscriptions {
    requests: mpsc::UnboundedSender<Request>,
}

impl Subscriptions {
    /// Opens the pub/sub connection and starts the subscription task on the current runtime.
    pub(crate) async fn connect(config: &Config, deletions: Deletions) -> redis::RedisResult<Self> {
        let registry = Arc::new(Registry {
            channels: Mutex::default(),
            deletions,
        });
        let link = Link::connect(config, Arc::clone(&registry)).await?;
        let (requests, inbox) = mpsc::unbounded_channel();
        tokio::spawn(run(link, registry, inbox));
        Ok(Self { requests })
    }

    /// Registers interest in `channel`. The channel is subscribed once
    /// [`Watch::subscribed`] returns its notifier.
    pub(crate) fn watch(&self, channel: &str) -> Watch {
        let (subscribed, ready) = oneshot::channel();
        let sent = self.requests.send(Request::Watch {
            channel: channel.to_owned(),
            subscribed,
        });
        Watch {
            channel: channel.to_owned(),
            requests: self.requests.clone(),
            ready: sent.is_ok().then_some(ready),
        }
    }
}

/// Interest in one channel; dropping it unregisters (and, for the last waiter, unsubscribes).
#[derive(Debug)]
pub(crate) struct Watch {
    channel: String,
    requests: mpsc::UnboundedSender<Request>,
    ready: Option<oneshot::Receiver<Arc<Notify>>>,
}

impl Watch {
    /// Waits until the subscription is in place and returns what wakes the channel's waiters.
    /// `None` if the task is gone (the runtime shuts down): the caller falls back to polling.
    /// If subscribing failed, the notifier still comes: polling finds changes until the channel
    /// is subscribed again, which wakes it.
    pub(crate) async fn subscribed(&mut self) -> Option<Arc<Notify>> {
        self.ready.take()?.await.ok()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Sent even if the watch never got its answer: the task counted the request anyway.
        let _ = self.requests.send(Request::Unwatch {
            channel: std::mem::take(&mut self.channel),
        });
    }
}

/// The pub/sub connection.
enum Link {
    Standalone(Box<Own>),
    Cluster(ClusterConnection),
}

/// What happened to the link while the task waited for requests.
enum LinkEvent {
    /// The connection is gone, and its subscriptions with it.
    Lost,
    /// It is time to try connecting again.
    Due,
}

impl Link {
    async fn connect(config: &Config, registry: Arc<Registry>) -> redis::RedisResult<Self> {
        let server = match &config.target {
            Target::Standalone(info) => Server::Fixed(redis::Client::open(info.clone())?),
            Target::Sentinel(target) => Server::Sentinel(target.clone()),
            Target::Cluster(nodes) => {
                let push = move |push: PushInfo| {
                    registry.dispatch(&push);
                    Ok::<(), Infallible>(())
                };
                let client = ClusterClientBuilder::new(nodes.clone())
                    .use_protocol(redis::ProtocolVersion::RESP3)
                    .push_sender(push)
                    .response_timeout(RESPONSE_TIMEOUT)
                    .overall_response_timeout(Some(RESPONSE_TIMEOUT + CLUSTER_OVERALL_TIMEOUT))
                    .connection_timeout(CONNECTION_TIMEOUT)
                    .retries(4)
                    .build()?;
                return Ok(Self::Cluster(client.get_async_connection().await?));
            }
        };
        let mut own = Own {
            server,
            registry,
            conn: None,
            generation: 0,
            lost: mpsc::unbounded_channel(),
            retry_at: Instant::now(),
            pause: Duration::ZERO,
        };
        own.connect().await?;
        Ok(Self::Standalone(Box::new(own)))
    }

    /// A cluster's subscription: sharded for a record's channel, plain for the deletions channel
    /// (published to every node).
    async fn cluster_subscribe(
        conn: &mut ClusterConnection,
        channel: &str,
        deletions: &Deletions,
    ) -> redis::RedisResult<()> {
        if deletions.is(channel) {
            conn.subscribe(channel).await
        } else {
            conn.ssubscribe(channel).await
        }
    }

    /// Subscribes to `channel`; `false` if it is not subscribed now (polling finds changes).
    async fn subscribe(&mut self, channel: &str, deletions: &Deletions) -> bool {
        match self {
            Self::Standalone(own) => own.confirm(Change::Subscribe, channel).await == Ok(true),
            Self::Cluster(conn) => match Self::cluster_subscribe(conn, channel, deletions).await {
                Ok(()) => true,
                Err(err) => {
                    tracing::debug!(%channel, error = %err, "cannot subscribe; polling instead");
                    false
                }
            },
        }
    }

    async fn unsubscribe(&mut self, channel: &str) {
        match self {
            Self::Standalone(own) => {
                let _ = own.confirm(Change::Unsubscribe, channel).await;
            }
            Self::Cluster(conn) => {
                if let Err(err) = conn.sunsubscribe(channel).await {
                    tracing::debug!(%channel, error = %err, "cannot unsubscribe");
                }
            }
        }
    }

    /// Waits until the connection is lost or, when `wanted`, due to be made again.
    async fn event(&mut self, wanted: bool) -> LinkEvent {
        match self {
            Self::Standalone(own) => own.event(wanted).await,
            // The cluster connection reconnects and resubscribes by itself.
            Self::Cluster(_) => std::future::pending().await,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    Subscribe,
    Unsubscribe,
}

/// Where the pub/sub connection to one server goes.
enum Server {
    /// Always the same server.
    Fixed(redis::Client),
    /// The primary that Sentinel names when the connection is made.
    Sentinel(SentinelTarget),
}

/// The pub/sub connection to one server, kept by the subscription task.
struct Own {
    server: Server,
    registry: Arc<Registry>,
    conn: Option<MultiplexedConnection>,
    /// Counts connections, so that the loss of an old one is not taken for the current one's.
    generation: u64,
    /// The generations of the connections that went down.
    lost: (mpsc::UnboundedSender<u64>, mpsc::UnboundedReceiver<u64>),
    retry_at: Instant,
    pause: Duration,
}

impl Own {
    async fn connect(&mut self) -> redis::RedisResult<()> {
        self.generation += 1;
        let generation = self.generation;
        let registry = Arc::clone(&self.registry);
        let lost = self.lost.0.clone();
        let push = move |push: PushInfo| {
            if push.kind == PushKind::Disconnection {
                let _ = lost.send(generation);
            } else {
                registry.dispatch(&push);
            }
            Ok::<(), Infallible>(())
        };
        let config = AsyncConnectionConfig::new()
            .set_push_sender(push)
            .set_connection_timeout(Some(CONNECTION_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT));
        let client = match &self.server {
            Server::Fixed(client) => client.clone(),
            Server::Sentinel(target) => redis::Client::open(sentinel::primary(target).await?)?,
        };
        self.conn = Some(client.get_multiplexed_async_connection_with_config(&config).await?);
        Ok(())
    }

    /// Drops the connection (its subscriptions go with it) and schedules the next one, backing off.
    fn disconnect(&mut self) {
        self.conn = None;
        self.retry_at = Instant::now() + self.pause;
        self.pause = (self.pause * 2).clamp(Duration::from_millis(100), MAX_RECONNECT_PAUSE);
    }

    /// Subscribes or unsubscribes one channel. `Ok(true)`: confirmed; `Ok(false)`: the server
    /// refused; `Err`: the connection failed, timed out or answered with anything but this
    /// channel's confirmation, and is dropped.
    async fn confirm(&mut self, change: Change, channel: &str) -> Result<bool, ()> {
        let Some(conn) = &mut self.conn else {
            return Err(());
        };
        let (command, expected) = match change {
            Change::Subscribe => ("SUBSCRIBE", PushKind::Subscribe),
            Change::Unsubscribe => ("UNSUBSCRIBE", PushKind::Unsubscribe),
        };
        match redis::cmd(command).arg(channel).query_async::<Value>(conn).await {
            Ok(Value::Push { kind, data })
                if kind == expected
                    && matches!(data.first(), Some(Value::BulkString(name)) if name == channel.as_bytes()) =>
            {
                Ok(true)
            }
            Ok(other) => {
                tracing::warn!(%channel, reply = ?other, "the pub/sub connection answered {command} out of step; reconnecting");
                self.disconnect();
                Err(())
            }
            Err(err) if matches!(err.kind(), redis::ErrorKind::Server(_) | redis::ErrorKind::Extension) => {
                tracing::debug!(%channel, error = %err, "{command} refused");
                Ok(false)
            }
            Err(err) => {
                tracing::debug!(%channel, error = %err, "{command} failed; reconnecting");
                self.disconnect();
                Err(())
            }
        }
    }

    async fn event(&mut self, wanted: bool) -> LinkEvent {
        loop {
            if self.conn.is_some() {
                let current = self.generation;
                // Never `None`: `self.lost.0` is a sender.
                if self.lost.1.recv().await == Some(current) {
                    self.disconnect();
                    return LinkEvent::Lost;
                }
            } else if wanted {
                tokio::time::sleep_until(self.retry_at).await;
                return LinkEvent::Due;
            } else {
                // Nobody waits: connect again when somebody does.
                return std::future::pending().await;
            }
        }
    }

    /// Connects again and subscribes to every watched channel; wakes every waiter once done.
    async fn resubscribe(&mut self, watched: &mut HashMap<String, Watched>) {
        if let Err(err) = self.connect().await {
            tracing::debug!(error = %err, "cannot reconnect the pub/sub connection");
            self.disconnect();
            return;
        }
        for (channel, entry) in watched.iter_mut() {
            match self.confirm(Change::Subscribe, channel).await {
                Ok(subscribed) => entry.subscribed = subscribed,
                // Dropped again; the next attempt starts over.
                Err(()) => return,
            }
        }
        self.pause = Duration::ZERO;
        tracing::debug!(channels = watched.len(), "the pub/sub connection is back");
        // Whatever was published while the connection was down is lost: every waiter looks again,
        // and the replay caches start afresh.
        self.registry.wake_all();
        let deletions = &self.registry.deletions;
        deletions.subscribed(watched.get(&deletions.channel).is_some_and(|entry| entry.subscribed));
    }
}

struct Watched {
    waiters: usize,
    subscribed: bool,
}

async fn run(mut link: Link, registry: Arc<Registry>, mut inbox: mpsc::UnboundedReceiver<Request>) {
    let mut watched: HashMap<String, Watched> = HashMap::new();
    loop {
        let wanted = !watched.is_empty();
        tokio::select! {
            request = inbox.recv() => match request {
                Some(request) => handle(&mut link, &registry, &mut watched, request).await,
                None => return,
            },
            event = link.event(wanted) => match (event, &mut link) {
                (LinkEvent::Lost, _) => {
                    for entry in watched.values_mut() {
                        entry.subscribed = false;
                    }
                    registry.deletions.invalidations.lost();
                }
                (LinkEvent::Due, Link::Standalone(own)) => own.resubscribe(&mut watched).await,
                (LinkEvent::Due, Link::Cluster(_)) => {}
            },
        }
    }
}

async fn handle(link: &mut Link, registry: &Registry, watched: &mut HashMap<String, Watched>, request: Request) {
    match request {
        Request::Watch { channel, subscribed } => {
            let entry = watched.entry(channel.clone()).or_insert(Watched {
                waiters: 0,
                subscribed: false,
            });
            entry.waiters += 1;
            // Registered before subscribing: a message that follows the confirmation at once
            // finds its waiters.
            let notify = Arc::clone(registry.channels().entry(channel.clone().into_bytes()).or_default());
            if !entry.subscribed {
                // A failed subscription is retried by the channel's next waiter, or when the
                // connection is made again; until then polling finds the change.
                entry.subscribed = link.subscribe(&channel, &registry.deletions).await;
                if registry.deletions.is(&channel) {
                    registry.deletions.subscribed(entry.subscribed);
                }
            }
            let _ = subscribed.send(notify);
        }
        Request::Unwatch { channel } => {
            let Some(entry) = watched.get_mut(&channel) else {
                return;
            };
            entry.waiters -= 1;
            if entry.waiters > 0 {
                return;
            }
            let subscribed = entry.subscribed;
            watched.remove(&channel);
            registry.channels().remove(channel.as_bytes());
            if subscribed {
                link.unsubscribe(&channel).await;
            }
        }
    }
}
