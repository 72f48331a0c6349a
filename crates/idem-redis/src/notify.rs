//! Wake-ups for [`idem_core::Store::wait`] through pub/sub on the store's one connection.
//!
//! Waiters register their record's channel with a subscription task, which subscribes when the
//! first waiter of a channel arrives and unsubscribes when the last one leaves. The task does
//! this one request at a time, so a `SUBSCRIBE` and an `UNSUBSCRIBE` of the same channel can never
//! overtake each other. Messages arrive as RESP3 push messages; the connection hands them to
//! [`Registry::dispatch`], which wakes the channel's waiters at once, without going through the
//! task.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use redis::{PushInfo, PushKind, Value};
use tokio::sync::{Notify, mpsc, oneshot};

use crate::conn::Conn;

/// The channels waited on in this store, and how to wake their waiters.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    channels: Mutex<HashMap<Vec<u8>, Arc<Notify>>>,
}

impl Registry {
    fn channels(&self) -> MutexGuard<'_, HashMap<Vec<u8>, Arc<Notify>>> {
        // Every critical section is one map call: the map stays consistent after a panic.
        self.channels.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes the waiters of the channel a message was published on. Called by the connection for
    /// every push message; must not block.
    pub(crate) fn dispatch(&self, push: &PushInfo) {
        if !matches!(push.kind, PushKind::Message | PushKind::SMessage) {
            return;
        }
        if let Some(Value::BulkString(channel)) = push.data.first()
            && let Some(notify) = self.channels().get(channel.as_slice())
        {
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
    /// Starts the subscription task on the current runtime.
    pub(crate) fn start(conn: Conn, registry: Arc<Registry>) -> Self {
        let (requests, inbox) = mpsc::unbounded_channel();
        tokio::spawn(run(conn, registry, inbox));
        Self { requests }
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
    /// If subscribing failed, the notifier still comes, but only polling will find changes.
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

struct Watched {
    waiters: usize,
    subscribed: bool,
}

async fn run(mut conn: Conn, registry: Arc<Registry>, mut inbox: mpsc::UnboundedReceiver<Request>) {
    let mut watched: HashMap<String, Watched> = HashMap::new();
    while let Some(request) = inbox.recv().await {
        match request {
            Request::Watch { channel, subscribed } => {
                let entry = watched.entry(channel.clone()).or_insert(Watched {
                    waiters: 0,
                    subscribed: false,
                });
                entry.waiters += 1;
                // Registered before subscribing: a message that follows the confirmation at
                // once finds its waiters.
                let notify = Arc::clone(registry.channels().entry(channel.clone().into_bytes()).or_default());
                if !entry.subscribed {
                    // A failed subscription is retried by the channel's next waiter; until then
                    // polling finds the change.
                    match conn.subscribe(&channel).await {
                        Ok(()) => entry.subscribed = true,
                        Err(err) => tracing::debug!(%channel, error = %err, "cannot subscribe; polling instead"),
                    }
                }
                let _ = subscribed.send(notify);
            }
            Request::Unwatch { channel } => {
                let Some(entry) = watched.get_mut(&channel) else {
                    continue;
                };
                entry.waiters -= 1;
                if entry.waiters > 0 {
                    continue;
                }
                let subscribed = entry.subscribed;
                watched.remove(&channel);
                registry.channels().remove(channel.as_bytes());
                if subscribed && let Err(err) = conn.unsubscribe(&channel).await {
                    tracing::debug!(%channel, error = %err, "cannot unsubscribe");
                }
            }
        }
    }
}
