//! The schema: one table of records, indexed on the two retention deadlines so that purging never
//! scans, and the store's scope salt. `PRAGMA user_version` holds the schema version.
//!
//! Versions: 1 is the table of records; 2 adds the `checkpoints` column (the checkpoints of the
//! current run, see [`crate::checkpoints`]); 3 adds the table `idem_scope_salt`; 4 adds what a
//! record keeps for the operator (`method`, `path`, `trace_id`, `recovered`, `status`) and the
//! `created_at` index that lists records newest first. A file made by an older version is upgraded
//! in place when it is opened.

use std::path::Path;

use rusqlite::{Connection, TransactionBehavior};

use crate::SqliteError;
use crate::conn::retry_busy;

/// The newest schema version this crate writes.
pub(crate) const VERSION: i64 = 5;

/// The newest schema, for a new file. Idempotent: every statement is `IF NOT EXISTS`. A rowid
/// table (not `WITHOUT ROWID`) because rows carry response bodies of up to hundreds of KiB, and
/// purging deletes by rowid. `checkpoints` and the columns of [`ADD_ORIGIN`] come last, in the
/// order their `ADD COLUMN`s put them in an upgraded file, so that new and upgraded tables are alike.
///
/// `idem_records_created_at` (version 4) serves `Store::list`, which reads records newest first,
/// from a time on: the index is walked backwards and the walk stops at the query's limit. It is on
/// `created_at` alone, which every version has, so `IF NOT EXISTS` adds it to an older file too,
/// and it is as small as an index can be, since every claim writes it.
///
/// `idem_scope_salt` (version 3) holds the store's one scope salt, in a table of its own that
/// retention never touches: one row at most (`id = 1`, so that a second one cannot be inserted),
/// `NULL` in `older_records_until` if the store held no records when the salt was made. Being new
/// as a whole, it needs no step of its own to upgrade a file: `IF NOT EXISTS` adds it. No `CHECK`
/// on the salt's length: its reader reports a salt it cannot use as corrupt.
///
/// `idem_fence` stays empty: a completion in a handler's own transaction whose claim was lost
/// inserts a row its `CHECK` refuses, `OR ROLLBACK`, which rolls the whole transaction back
/// (`complete_in`). New as a whole, like the salt's table, it needs no version of its own.
///
/// `idem_deletions` holds one row at most: how many deletes were made in the file, which every
/// store reads to tell its replay caches of other processes' deletes (`deletions.rs`). New as a
/// whole too.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idem_records (
    scope        TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN ('in-flight', 'completed', 'unknown')),
    fingerprint  BLOB    NOT NULL,
    digest       BLOB    NOT NULL,
    token        BLOB,
    lease_until  INTEGER,
    response     BLOB,
    created_at   INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at   INTEGER,
    purge_at     INTEGER NOT NULL,
    replays      INTEGER NOT NULL DEFAULT 0,
    checkpoints  BLOB,
    method       TEXT    NOT NULL DEFAULT '',
    path         TEXT    NOT NULL DEFAULT '',
    trace_id     TEXT,
    recovered    INTEGER NOT NULL DEFAULT 0,
    status       INTEGER,
    PRIMARY KEY (scope, key)
) STRICT;
CREATE INDEX IF NOT EXISTS idem_records_purge_at ON idem_records (purge_at);
CREATE INDEX IF NOT EXISTS idem_records_expires_at ON idem_records (expires_at) WHERE response IS NOT NULL;
CREATE INDEX IF NOT EXISTS idem_records_created_at ON idem_records (created_at);
CREATE TABLE IF NOT EXISTS idem_fence (
    aborted INTEGER NOT NULL CHECK (aborted = 0)
) STRICT;
CREATE TABLE IF NOT EXISTS idem_deletions (
    id    INTEGER PRIMARY KEY CHECK (id = 1),
    count INTEGER NOT NULL
) STRICT;
CREATE TABLE IF NOT EXISTS idem_scope_salt (
    id                  INTEGER PRIMARY KEY CHECK (id = 1),
    salt                BLOB    NOT NULL,
    created_at          INTEGER NOT NULL,
    older_records_until INTEGER,
    identity            BLOB
) STRICT;
";

/// Version 2, on a file made by version 1: the checkpoints of each record's current run.
const ADD_CHECKPOINTS: &str = "ALTER TABLE idem_records ADD COLUMN checkpoints BLOB";

/// Version 4, on an older file: what a record keeps about its request, its latest run and its
/// answer, each column with the statement that adds it, in [`SCHEMA`]'s order. The defaults are
/// what a record written before them reads as: no method or path, no trace, not recovered, no
/// status.
const ADD_ORIGIN: [(&str, &str); 5] = [
    (
        "method",
        "ALTER TABLE idem_records ADD COLUMN method TEXT NOT NULL DEFAULT ''",
    ),
    (
        "path",
        "ALTER TABLE idem_records ADD COLUMN path TEXT NOT NULL DEFAULT ''",
    ),
    ("trace_id", "ALTER TABLE idem_records ADD COLUMN trace_id TEXT"),
    (
        "recovered",
        "ALTER TABLE idem_records ADD COLUMN recovered INTEGER NOT NULL DEFAULT 0",
    ),
    ("status", "ALTER TABLE idem_records ADD COLUMN status INTEGER"),
];

/// Version 5, on an older file: the store's identity beside its salt (`Store::scope_salt` gives
/// a salt made before it one, atomically, at its first call after the upgrade).
const ADD_IDENTITY: &str = "ALTER TABLE idem_scope_salt ADD COLUMN identity BLOB";

/// Creates the schema if it is absent and upgrades an older one, in one immediate transaction so
/// that processes starting together on a file do not trip over each other (the second one finds
/// the work done).
pub(crate) fn migrate(conn: &mut Connection, path: &Path) -> Result<(), SqliteError> {
    let found = retry_busy(|| {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let found: i64 = tx.pragma_query_value(None, "user_version", |row| row.get(0))?;
        if found <= VERSION {
            tx.execute_batch(SCHEMA)?;
            if !has_column(&tx, "idem_records", "checkpoints")? {
                tx.execute_batch(ADD_CHECKPOINTS)?;
            }
            for (column, add) in ADD_ORIGIN {
                if !has_column(&tx, "idem_records", column)? {
                    tx.execute_batch(add)?;
                }
            }
            if !has_column(&tx, "idem_scope_salt", "identity")? {
                tx.execute_batch(ADD_IDENTITY)?;
            }
            if found < VERSION {
                tx.pragma_update(None, "user_version", VERSION)?;
            }
            tx.commit()?;
        }
        Ok(found)
    })
    .map_err(|source| SqliteError::setup(path, source))?;
    if found > VERSION {
        return Err(SqliteError::NewerSchema {
            path: path.to_owned(),
            found,
            supported: VERSION,
        });
    }
    Ok(())
}

/// Whether `table` has a column named `column`. Each `ADD COLUMN` is guarded by it rather than by
/// the version, so that an upgrade is a no-op on a table that already has the column, whatever
/// version the file says it is.
fn has_column(conn: &Connection, table: &str, column: &str) -> rusqlite::Result<bool> {
    conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM pragma_table_info(?1) WHERE name = ?2)",
        [table, column],
        |row| row.get(0),
    )
}
