//! Replays read on a connection of their own, many at once.
//!
//! A claim is one statement on a pooled connection (`CLAIM`), which a new key needs: its insert
//! commits, and commits from many connections share the server's WAL flushes. A replay needs
//! only a read, and a read does not commit: many reads can share one connection, sent without
//! waiting for each other's answers (tokio-postgres pipelines the queries of concurrent callers
//! of one client), so that a burst of replays costs the client and the server a write and a wake-up
//! for many reads rather than for each. Measured in `bench/README.md`.
//!
//! Which to try first is decided by what came lately ([`ReadFirst::Auto`]): while replays are
//! most of the recent `begin`s (a client's retry storm after an outage, say) a `begin` reads the
//! record here first and claims on the pool only when it finds none; otherwise it claims first,
//! so that new keys, most of the traffic at other times, pay no extra round trip. Both paths
//! read the record and decide on it with the same rule (`StoredRow::on_begin`); this one never
//! writes, and anything it cannot decide (no record, a takeover, a replacement) is left to the
//! claim. A read here that fails (the connection lost, the server restarting) or does not answer
//! within [`READ_TIMEOUT`] (a hung connection) is not an error: the `begin` claims on the pool as
//! if this path were not there, and the connection is made again in the background.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls, Row, Statement};

use crate::sql;

/// Whether `begin` reads the record on the shared connections before it claims: the URL's
/// `read_first=auto|always|never`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadFirst {
    /// While replays are most of the recent `begin`s.
    Auto,
    /// Always (a service whose traffic is mostly retries).
    Always,
    /// Never, and no connection of its own (a pooler that cannot pipeline).
    Never,
}

impl ReadFirst {
    /// Whether to read first, `replays` being where the recent mix stands (0 to [`MEMORY`]).
    fn wanted(self, replays: u32) -> bool {
        match self {
            Self::Never => false,
            Self::Always => true,
            Self::Auto => replays > MEMORY / 2,
        }
    }
}

/// How many of the recent `begin`s [`ReadFirst::Auto`] weighs.
const MEMORY: u32 = 16;

/// How long a read on a shared connection may take before the connection is taken for hung
/// (a frozen backend, a flow a firewall dropped without a word): the request claims on the pool
/// instead, well within the store's operation timeout, and the connection is made again. A
/// plain read of one row by its key takes well under a millisecond on a healthy server.
const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// The longest pause between two attempts to connect.
const RECONNECT_AT_MOST: Duration = Duration::from_secs(5);

/// The shared connections and the recent mix of replays and new keys.
#[derive(Debug)]
pub(crate) struct Reads {
    mode: ReadFirst,
    slots: Arc<[Slot]>,
    /// The connections' settings (the store's, named `<application_name> reads`).
    config: tokio_postgres::Config,
    /// Whether the slots are kept connected yet.
    connecting: AtomicBool,
    next: AtomicUsize,
    /// From 0 (the recent `begin`s were new keys) to [`MEMORY`] (replays).
    replays: AtomicU32,
}

/// One shared connection, when it is up.
#[derive(Debug, Default)]
struct Slot {
    reader: RwLock<Option<Arc<Reader>>>,
    /// Tells the slot's task to drop its connection: it stopped answering.
    abandon: Arc<Notify>,
}

#[derive(Debug)]
struct Reader {
    client: Client,
    select: Statement,
}

impl Reads {
    /// `connections` shared connections to the server of `config` (none with
    /// [`ReadFirst::Never`]), remade in the background for as long as the returned value lives.
    /// With [`ReadFirst::Always`] they are made now; with [`ReadFirst::Auto`] when replays first
    /// become most of the traffic, so that a store that never sees a burst of them opens none.
    /// One that cannot be made is not an error: the store claims on the pool until it is.
    pub(crate) async fn start(mode: ReadFirst, connections: usize, config: &tokio_postgres::Config) -> Self {
        let count = if mode == ReadFirst::Never { 0 } else { connections };
        // Told apart from the pool's in `pg_stat_activity`.
        let mut config = config.clone();
        let name = format!("{} reads", config.get_application_name().unwrap_or("idem"));
        config.application_name(name);
        let reads = Self {
            mode,
            slots: (0..count).map(|_| Slot::default()).collect(),
            config,
            connecting: AtomicBool::new(false),
            next: AtomicUsize::new(0),
            replays: AtomicU32::new(0),
        };
        if mode == ReadFirst::Always {
            reads.connect(true).await;
        }
        reads
    }

    /// Starts keeping the slots connected (once), having made the first connections now if
    /// `now`.
    async fn connect(&self, now: bool) {
        if self.connecting.swap(true, Ordering::Relaxed) {
            return;
        }
        for (at, slot) in self.slots.iter().enumerate() {
            let mut running = None;
            if now && let Some((reader, connection)) = open(&self.config).await {
                slot.set(Some(reader));
                running = Some(connection);
            }
            tokio::spawn(keep_connected(
                Arc::downgrade(&self.slots),
                at,
                Arc::clone(&slot.abandon),
                self.config.clone(),
                running,
            ));
        }
    }

    /// The record at `(scope, key)`, read on a shared connection, if `begin` should read first
    /// now; `None` if it should claim (no record, or this path is off or down).
    pub(crate) async fn read(&self, scope: &str, key: &str) -> Option<Row> {
        if !self.mode.wanted(self.replays.load(Ordering::Relaxed)) || self.slots.is_empty() {
            return None;
        }
        self.connect(false).await;
        let slot = &self.slots[self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len()];
        let reader = slot
            .reader
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()?;
        match tokio::time::timeout(READ_TIMEOUT, reader.client.query_opt(&reader.select, &[&scope, &key])).await {
            Ok(Ok(row)) => row,
            Ok(Err(err)) => {
                tracing::debug!(error = %err, "a replay's read on the shared connection failed; claiming instead");
                None
            }
            Err(_) => {
                tracing::warn!(
                    limit = ?READ_TIMEOUT,
                    "a shared read connection did not answer in time: closed and made again; claiming on the pool meanwhile"
                );
                slot.abandon(&reader);
                None
            }
        }
    }

    /// A `begin` ended: as a replay (or another answer from a record that exists), or as a new
    /// claim.
    pub(crate) fn saw(&self, replay: bool) {
        let _ = self.replays.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            Some(if replay {
                (n + 1).min(MEMORY)
            } else {
                n.saturating_sub(1)
            })
        });
    }
}

impl Slot {
    fn set(&self, reader: Option<Reader>) {
        *self.reader.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = reader.map(Arc::new);
    }

    /// Takes `reader`'s connection out of use, if it is still the slot's, and has the slot's
    /// task close it (which ends the reads still waiting on it) and make another.
    fn abandon(&self, reader: &Arc<Reader>) {
        let mut current = self.reader.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        if current.as_ref().is_some_and(|current| Arc::ptr_eq(current, reader)) {
            *current = None;
            self.abandon.notify_one();
        }
    }
}

/// A connection's task: it ends when the server closes the connection, or once its client is
/// dropped (the store's, and every read in flight).
type Running = JoinHandle<Result<(), tokio_postgres::Error>>;

/// A shared connection with the read prepared, or `None` (said at `debug`: the pool serves).
async fn open(config: &tokio_postgres::Config) -> Option<(Reader, Running)> {
    let (client, connection) = match config.connect(NoTls).await {
        Ok(connected) => connected,
        Err(err) => {
            tracing::debug!(error = %err, "could not open a shared read connection");
            return None;
        }
    };
    let connection = tokio::spawn(connection);
    match client.prepare(sql::SELECT).await {
        Ok(select) => Some((Reader { client, select }, connection)),
        Err(err) => {
            tracing::debug!(error = %err, "could not prepare the shared read");
            drop(client);
            let _ = connection.await;
            None
        }
    }
}

/// Keeps slot `at` connected while the slots live: connects, waits for the connection to end (or
/// to be `abandon`ed, then closes it), clears the slot, and connects again, backing off while
/// that fails.
async fn keep_connected(
    slots: Weak<[Slot]>,
    at: usize,
    abandon: Arc<Notify>,
    config: tokio_postgres::Config,
    mut running: Option<Running>,
) {
    let mut pause = Duration::from_millis(100);
    loop {
        if let Some(mut connection) = running.take() {
            tokio::select! {
                _ = &mut connection => {}
                () = abandon.notified() => connection.abort(),
            }
            let Some(live) = slots.upgrade() else { return };
            live[at].set(None);
            pause = Duration::from_millis(100);
        }
        if slots.strong_count() == 0 {
            return;
        }
        match open(&config).await {
            Some((reader, connection)) => {
                let Some(live) = slots.upgrade() else { return };
                live[at].set(Some(reader));
                running = Some(connection);
            }
            None => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(RECONNECT_AT_MOST);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` reads first once replays are most of the recent `begin`s, and stops once new keys
    /// are: each ending moves the mix one step, within [0, MEMORY].
    #[test]
    fn auto_follows_the_recent_mix() {
        let reads = Reads {
            mode: ReadFirst::Auto,
            slots: Arc::new([]),
            config: tokio_postgres::Config::new(),
            connecting: AtomicBool::new(false),
            next: AtomicUsize::new(0),
            replays: AtomicU32::new(0),
        };
        let wanted = || reads.mode.wanted(reads.replays.load(Ordering::Relaxed));
        assert!(!wanted(), "new keys first: they pay no extra round trip");
        for _ in 0..MEMORY / 2 {
            reads.saw(true);
        }
        assert!(!wanted(), "half replays is not most");
        reads.saw(true);
        assert!(wanted());
        for _ in 0..100 {
            reads.saw(true);
        }
        assert_eq!(
            reads.replays.load(Ordering::Relaxed),
            MEMORY,
            "a long run of replays is remembered as MEMORY"
        );
        for _ in 0..MEMORY / 2 {
            reads.saw(false);
        }
        assert!(!wanted(), "back to claiming first after MEMORY / 2 new keys");
        for _ in 0..100 {
            reads.saw(false);
        }
        assert_eq!(reads.replays.load(Ordering::Relaxed), 0);
        assert!(ReadFirst::Always.wanted(0) && !ReadFirst::Never.wanted(MEMORY));
    }
}
