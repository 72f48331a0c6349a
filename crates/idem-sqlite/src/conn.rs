//! The connections of one store: opening the file (WAL, busy timeout, durability), the writer and
//! the reader, retrying setup while another process holds the file, and running their blocking
//! work off the async runtime. Knows nothing of records; the store and the schema build on it.

use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use idem_core::StoreError;
use rusqlite::{Connection, Transaction, TransactionBehavior};

use crate::SqliteError;

/// How long setup waits for another connection's write lock before it fails.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an operation waits for another connection's write lock on the file (at most its
/// bound, [`Connections::bound_by`]). idem's own writes hold it for milliseconds; a lock held
/// longer is a writing transaction still open (a handler's own, completing its run in the same
/// file), which claims must not queue behind: they fail with [`StoreError::Locked`] instead.
const BUSY_WAIT: Duration = Duration::from_secs(1);

/// The open connections to one database file.
pub(crate) struct Connections {
    /// The path as given, for messages.
    path: PathBuf,
    /// The database's identity for wake-ups: the canonical path.
    database: Arc<Path>,
    /// All writes go through this connection; SQLite allows one writer at a time anyway.
    writer: Mutex<Connection>,
    /// Reads (`get`, the checks of `wait`, `ping`) do not queue behind writes. `None` for an
    /// in-memory database, which exists only in its one connection.
    reader: Option<Mutex<Connection>>,
    /// The longest `store_timeout` given, in milliseconds (0: none given, [`BUSY_TIMEOUT`]).
    bound: AtomicU64,
}

impl Connections {
    /// Opens the database at `path`, creating the file if it is absent, off the async runtime.
    /// `":memory:"` opens a private in-memory database.
    pub(crate) async fn open(path: PathBuf) -> Result<Self, SqliteError> {
        let task_path = path.clone();
        tokio::task::spawn_blocking(move || Self::open_blocking(task_path))
            .await
            .map_err(|source| cancelled(&path, source))?
    }

    fn open_blocking(path: PathBuf) -> Result<Self, SqliteError> {
        let memory = path.as_os_str() == ":memory:";
        let database: Arc<Path> = if memory {
            // Never shared: a relative name no canonical path can equal.
            static MEMORY: AtomicU64 = AtomicU64::new(0);
            PathBuf::from(format!(":memory:{}", MEMORY.fetch_add(1, Ordering::Relaxed))).into()
        } else {
            if path.as_os_str().is_empty() {
                let empty = io::Error::new(io::ErrorKind::InvalidInput, "empty path");
                return Err(SqliteError::open(&path, empty));
            }
            // The file system's errors say what is wrong; SQLite's only say "unable to open
            // database file".
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(|err| SqliteError::open(&path, err))?;
            std::fs::canonicalize(&path)
                .map_err(|err| SqliteError::open(&path, err))?
                .into()
        };
        let writer = connect(&path)?;
        let journal: String =
            retry_busy(|| writer.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0)))
                .map_err(|err| SqliteError::setup(&path, err))?;
        if !memory && !journal.eq_ignore_ascii_case("wal") {
            tracing::warn!(path = %path.display(), %journal, "SQLite refused WAL mode: reads will wait for writes");
        }
        let reader = if memory {
            None
        } else {
            Some(Mutex::new(connect(&path)?))
        };
        tracing::debug!(path = %path.display(), %journal, "SQLite store opened");
        Ok(Self {
            path,
            database,
            writer: Mutex::new(writer),
            reader,
            bound: AtomicU64::new(0),
        })
    }

    /// The path of the database file, as given.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The database's identity for wake-ups: the same for every store of this process that opened
    /// the file.
    pub(crate) fn database(&self) -> &Arc<Path> {
        &self.database
    }

    /// Bounds every later operation by `limit` (the longest given is kept): from when it was
    /// asked for, its wait for this process's connection and then for another process's lock
    /// on the file together last at most that long, so that an operation its caller gave up
    /// never runs late, and never holds the connection that the operations queued after it need.
    pub(crate) fn bound_by(&self, limit: Duration) {
        let millis = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX).max(1);
        self.bound.fetch_max(millis, Ordering::AcqRel);
    }

    /// Sets `conn`'s busy wait to what is left of the bound of an operation asked for at `asked`,
    /// [`BUSY_WAIT`] at most; fails, starting nothing, if nothing is left.
    fn within_bound(&self, conn: &Connection, asked: Instant) -> Result<(), StoreError> {
        let limit = match self.bound.load(Ordering::Acquire) {
            0 => BUSY_TIMEOUT,
            millis => Duration::from_millis(millis),
        };
        let left = limit.saturating_sub(asked.elapsed());
        if left.is_zero() {
            return Err(StoreError::unavailable(Overdue(limit)));
        }
        conn.busy_timeout(left.min(BUSY_WAIT)).map_err(db_error)
    }

    /// The writer connection, locked.
    pub(crate) fn writer(&self) -> MutexGuard<'_, Connection> {
        lock(&self.writer)
    }

    /// Runs setup work (`op`, given the writer and the path) off the async runtime.
    pub(crate) async fn setup<T, F>(self: &Arc<Self>, op: F) -> Result<T, SqliteError>
    where
        F: FnOnce(&mut Connection, &Path) -> Result<T, SqliteError> + Send + 'static,
        T: Send + 'static,
    {
        let conns = Arc::clone(self);
        tokio::task::spawn_blocking(move || op(&mut conns.writer(), &conns.path))
            .await
            .map_err(|source| cancelled(&self.path, source))?
    }

    /// Runs `op` in one immediate transaction on the writer connection, off the async runtime.
    pub(crate) async fn write<T, F>(self: &Arc<Self>, op: F) -> Result<T, StoreError>
    where
        F: FnOnce(&Transaction<'_>) -> Result<T, StoreError> + Send + 'static,
        T: Send + 'static,
    {
        let (conns, asked) = (Arc::clone(self), Instant::now());
        blocking(move || {
            let mut conn = conns.writer();
            conns.within_bound(&conn, asked)?;
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(db_error)?;
            // An error drops `tx`, which rolls back.
            let value = op(&tx)?;
            tx.commit().map_err(db_error)?;
            Ok(value)
        })
        .await
    }

    /// Runs `op` on the reader connection, off the async runtime.
    pub(crate) async fn read<T, F>(self: &Arc<Self>, op: F) -> Result<T, StoreError>
    where
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
        T: Send + 'static,
    {
        let (conns, asked) = (Arc::clone(self), Instant::now());
        blocking(move || {
            let conn = lock(conns.reader.as_ref().unwrap_or(&conns.writer));
            conns.within_bound(&conn, asked)?;
            op(&conn)
        })
        .await
    }
}

/// An operation not started: the operations before it on this process's connection, or another
/// process holding the file's lock, took its whole bound.
#[derive(Debug, thiserror::Error)]
#[error(
    "the SQLite file stayed locked for the whole store timeout ({0:?}), by another process's transaction or by this process's operations before this one; nothing was done"
)]
struct Overdue(Duration);

fn connect(path: &Path) -> Result<Connection, SqliteError> {
    let setup = |err| SqliteError::setup(path, err);
    let conn = Connection::open(path).map_err(setup)?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(setup)?;
    // Durable at every checkpoint rather than every commit: with WAL a crash of the machine (not of
    // the process) can lose the last commits, never corrupt the file.
    conn.pragma_update(None, "synchronous", "NORMAL").map_err(setup)?;
    Ok(conn)
}

/// Retries `op` while it fails with `SQLITE_BUSY`, for up to [`BUSY_TIMEOUT`]. Only for setup:
/// switching a new file to WAL fails at once, without calling the busy handler, while another
/// connection opens the same file.
pub(crate) fn retry_busy<T>(mut op: impl FnMut() -> rusqlite::Result<T>) -> rusqlite::Result<T> {
    let give_up = std::time::Instant::now() + BUSY_TIMEOUT;
    loop {
        match op() {
            Err(err)
                if err.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy)
                    && std::time::Instant::now() < give_up =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            result => return result,
        }
    }
}

fn lock(conn: &Mutex<Connection>) -> MutexGuard<'_, Connection> {
    // A panic cannot leave a transaction open: dropping the `Transaction` rolls it back.
    conn.lock().unwrap_or_else(PoisonError::into_inner)
}

fn cancelled(path: &Path, source: tokio::task::JoinError) -> SqliteError {
    if source.is_panic() {
        std::panic::resume_unwind(source.into_panic());
    }
    SqliteError::Cancelled {
        path: path.to_owned(),
        source,
    }
}

async fn blocking<T, F>(op: F) -> Result<T, StoreError>
where
    F: FnOnce() -> Result<T, StoreError> + Send + 'static,
    T: Send + 'static,
{
    match tokio::task::spawn_blocking(op).await {
        Ok(result) => result,
        Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
        Err(err) => Err(StoreError::unavailable(err)),
    }
}

/// SQLite's errors are the store being unavailable, except values of the wrong type or range:
/// those mean the row itself is corrupt; and the file's lock held past the busy wait
/// ([`BUSY_WAIT`]), which is [`StoreError::Locked`]: a writing transaction still open (a handler
/// completing its run in the same file, or another writer).
pub(crate) fn db_error(err: rusqlite::Error) -> StoreError {
    if let Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) = err.sqlite_error_code() {
        tracing::debug!(error = %err, "the SQLite file is locked by a writing transaction still open");
        return StoreError::Locked;
    }
    match err {
        rusqlite::Error::InvalidColumnType(..)
        | rusqlite::Error::FromSqlConversionFailure(..)
        | rusqlite::Error::IntegralValueOutOfRange(..) => StoreError::Corrupt(err.to_string()),
        err => StoreError::unavailable(err),
    }
}
