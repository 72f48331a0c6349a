//! Wake-ups for [`idem_core::Store::wait`] through PostgreSQL `LISTEN`/`NOTIFY`.
//!
//! Every change that ends a claim (complete, release, takeover) sends `NOTIFY idem_records` with
//! a short digest of the record's id, in the transaction that makes the change, so that it is
//! delivered on commit. Each store keeps one dedicated connection (not from the pool) that
//! `LISTEN`s on the channel; a background task hands each notification to the waiters registered
//! for its payload. Notifications sent while that connection is down are lost, so the task
//! reconnects with backoff and, once it listens again, wakes every waiter to look for itself;
//! meanwhile waiters notice changes by polling.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use idem_core::store::Invalidations;
use idem_core::store::{RecordDigest, RecordId};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_postgres::tls::NoTlsStream;
use tokio_postgres::{AsyncMessage, Client, Connection, NoTls, Socket};

use crate::error::describe;

/// The notification channel of every store.
pub(crate) const CHANNEL: &str = "idem_records";

/// The first pause before reconnecting after a failed attempt; it doubles up to the maximum.
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(5);
/// A connection that broke sooner than this after it was made counts as a failed attempt, so
/// that a server that accepts and drops connections is not hammered.
const STABLE_AFTER: Duration = Duration::from_secs(5);
/// How often an idle listening connection is checked, so that a silently dead one (the server's
/// machine vanished) is noticed and replaced.
const HEALTH_INTERVAL: Duration = Duration::from_secs(30);
const HEALTH_TIMEOUT: Duration = Duration::from_secs(10);

/// The notification payload for a record: 32 hex digits of a SHA-256 of its scope and key.
/// Short (payloads are limited to 8000 bytes, and keys may be 255), and it reveals neither.
pub(crate) fn payload(id: &RecordId) -> String {
    id.digest().iter().map(|b| format!("{b:02x}")).collect()
}

/// What a delete announces to the replay caches of every instance: `deleted:` and the record's
/// [`payload`]. No waiter has such a payload.
const DELETED: &str = "deleted:";

/// The payload that announces the delete of `id`.
pub(crate) fn deleted_payload(id: &RecordId) -> String {
    format!("{DELETED}{}", payload(id))
}

/// The record digest a delete's payload names, if it is one.
fn deleted_digest(payload: &str) -> Option<RecordDigest> {
    let hex = payload.strip_prefix(DELETED)?;
    if hex.len() != 32 {
        return None;
    }
    let mut digest = [0; 16];
    for (byte, pair) in digest.iter_mut().zip(hex.as_bytes().chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(digest)
}

/// The waiters of one store, by notification payload, and the replay caches its deletes reach.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    waiters: Mutex<HashMap<String, Arc<Notify>>>,
    /// Whether the listening connection is up (shown by the store's `Debug`).
    listening: AtomicBool,
    /// Told of every delete, and of the connection's losses: replay caches answer only while it
    /// listens.
    invalidations: Arc<Invalidations>,
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        // Every critical section is one map call: the map stays consistent even after a panic.
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers interest in the record whose notifications carry `payload`.
    pub(crate) fn subscribe(self: &Arc<Self>, payload: String) -> Subscription {
        let notify = Arc::clone(self.lock().entry(payload.clone()).or_default());
        Subscription {
            registry: Arc::clone(self),
            payload,
            notify,
        }
    }

    fn wake(&self, payload: &str) {
        // Woken under the lock (it only schedules tasks), so that no reference outlives it and
        // `Subscription::drop` can count them.
        if let Some(notify) = self.lock().get(payload) {
            notify.notify_waiters();
        }
    }

    fn wake_all(&self) {
        for notify in self.lock().values() {
            notify.notify_waiters();
        }
    }

    pub(crate) fn is_listening(&self) -> bool {
        self.listening.load(Ordering::SeqCst)
    }

    pub(crate) fn invalidations(&self) -> &Arc<Invalidations> {
        &self.invalidations
    }

    /// The connection listens (again), or stopped: waiters and replay caches are told.
    fn set_listening(&self, listening: bool) {
        self.listening.store(listening, Ordering::SeqCst);
        if listening {
            self.invalidations.resumed();
        } else {
            self.invalidations.lost();
        }
    }

    fn dispatch(&self, payload: &str) {
        match deleted_digest(payload) {
            Some(digest) => self.invalidations.deleted(&digest),
            None => self.wake(payload),
        }
    }
}

/// Interest in one record's notifications; the registry entry goes with the last one.
#[derive(Debug)]
pub(crate) struct Subscription {
    registry: Arc<Registry>,
    payload: String,
    notify: Arc<Notify>,
}

impl Subscription {
    pub(crate) fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut map = self.registry.lock();
        // Counted under the lock, which every new subscriber also takes: the map's reference and
        // ours are the last two.
        if Arc::strong_count(&self.notify) == 2 {
            map.remove(&self.payload);
        }
    }
}

/// The listening connection's background task; stopped when the store is dropped.
#[derive(Debug)]
pub(crate) struct Listener {
    registry: Arc<Registry>,
    /// Held only to stop the task with the store.
    _task: AbortOnDrop,
}

impl Listener {
    /// Connects and `LISTEN`s, then keeps listening in the background. Fails if the first
    /// connection cannot be made, so that a misconfiguration is reported at start.
    pub(crate) async fn start(config: tokio_postgres::Config, target: String) -> Result<Self, tokio_postgres::Error> {
        let registry = Arc::new(Registry::default());
        let session = Session::open(&config, &registry).await?;
        registry.set_listening(true);
        let task = tokio::spawn(run(config, target, Arc::clone(&registry), session));
        Ok(Self {
            registry,
            _task: AbortOnDrop(task),
        })
    }

    pub(crate) fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }
}

/// Aborts a task when dropped (a dropped `JoinHandle` would detach it instead).
#[derive(Debug)]
struct AbortOnDrop<T = ()>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One listening connection: the client, and the task that drives the connection and dispatches
/// its notifications.
struct Session {
    client: Client,
    driver: AbortOnDrop<String>,
}

impl Session {
    async fn open(config: &tokio_postgres::Config, registry: &Arc<Registry>) -> Result<Self, tokio_postgres::Error> {
        let (client, connection) = config.connect(NoTls).await?;
        let driver = AbortOnDrop(tokio::spawn(drive(connection, Arc::clone(registry))));
        // Returns once the LISTEN is committed: from then on every commit that notifies reaches us.
        client.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
        Ok(Self { client, driver })
    }

    /// Runs until the connection breaks; says why.
    async fn serve(self) -> String {
        let Self { client, mut driver } = self;
        loop {
            tokio::select! {
                ended = &mut driver.0 => {
                    return ended.unwrap_or_else(|err| format!("the connection task failed: {err}"));
                }
                () = tokio::time::sleep(HEALTH_INTERVAL) => {
                    match tokio::time::timeout(HEALTH_TIMEOUT, client.simple_query("SELECT 1")).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(err)) => return describe(&err),
                        Err(_) => return format!("the server did not answer a health check within {HEALTH_TIMEOUT:?}"),
                    }
                }
            }
        }
    }
}

/// Drives the connection (which also carries the client's queries) and hands notifications to
/// the registry; returns why the connection ended.
async fn drive(mut connection: Connection<Socket, NoTlsStream>, registry: Arc<Registry>) -> String {
    loop {
        match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            Some(Ok(AsyncMessage::Notification(note))) => {
                if note.channel() == CHANNEL {
                    registry.dispatch(note.payload());
                }
            }
            Some(Ok(AsyncMessage::Notice(notice))) => {
                tracing::debug!(notice = %notice, "notice on the LISTEN connection");
            }
            Some(Ok(_)) => {}
            Some(Err(err)) => return describe(&err),
            None => return "the connection was closed".to_owned(),
        }
    }
}

/// Listens for as long as the store lives: serves the connection, and when it breaks, reconnects
/// with backoff. Waiters fall back to polling in the meantime, and are all woken once listening
/// resumes, since what happened in between was not notified.
async fn run(config: tokio_postgres::Config, target: String, registry: Arc<Registry>, first: Session) {
    let mut session = Some(first);
    let mut backoff = RECONNECT_FIRST;
    loop {
        if let Some(current) = session.take() {
            let since = Instant::now();
            let why = current.serve().await;
            registry.set_listening(false);
            tracing::warn!(server = %target, reason = %why, "lost the PostgreSQL LISTEN connection; waiters poll until it is back");
            if since.elapsed() >= STABLE_AFTER {
                backoff = RECONNECT_FIRST;
            } else {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RECONNECT_MAX);
            }
        }
        match Session::open(&config, &registry).await {
            Ok(reopened) => {
                registry.set_listening(true);
                tracing::info!(server = %target, "listening for PostgreSQL notifications again");
                registry.wake_all();
                session = Some(reopened);
            }
            Err(err) => {
                tracing::warn!(server = %target, error = %describe(&err), retry_in = ?backoff, "cannot reconnect the PostgreSQL LISTEN connection");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RECONNECT_MAX);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{IdempotencyKey, Scope};

    fn id(scope: &str, key: &str) -> RecordId {
        RecordId {
            scope: Scope::application(scope),
            key: IdempotencyKey::new(key).unwrap(),
        }
    }

    #[test]
    fn payloads_are_short_stable_and_unambiguous() {
        let a = payload(&id("ab", "c"));
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(a, payload(&id("ab", "c")));
        assert_ne!(a, payload(&id("a", "bc")), "the scope's length is part of the digest");
    }

    #[tokio::test]
    async fn registry_entries_go_with_the_last_subscription() {
        let registry = Arc::new(Registry::default());
        let first = registry.subscribe("p".to_owned());
        let second = registry.subscribe("p".to_owned());
        drop(first);
        assert!(registry.lock().contains_key("p"));
        {
            let mut woken = std::pin::pin!(second.notify().notified());
            woken.as_mut().enable();
            registry.wake("p");
            tokio::time::timeout(Duration::from_secs(1), woken).await.unwrap();
        }
        drop(second);
        assert!(registry.lock().is_empty());
    }
}
