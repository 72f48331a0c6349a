//! The schema: one table of records, indexed on the two retention deadlines so that purging never
//! scans. `PRAGMA user_version` holds the schema version.

use std::path::Path;

use rusqlite::{Connection, TransactionBehavior};

use crate::SqliteError;
use crate::store::retry_busy;

/// The newest schema version this crate writes.
pub(crate) const VERSION: i64 = 1;

/// Idempotent: every statement is `IF NOT EXISTS`. A rowid table (not `WITHOUT ROWID`) because
/// rows carry response bodies of up to hundreds of KiB, and purging deletes by rowid.
const SCHEMA_V1: &str = "
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
    PRIMARY KEY (scope, key)
) STRICT;
CREATE INDEX IF NOT EXISTS idem_records_purge_at ON idem_records (purge_at);
CREATE INDEX IF NOT EXISTS idem_records_expires_at ON idem_records (expires_at) WHERE response IS NOT NULL;
";

/// Creates the schema if it is absent, in one immediate transaction so that processes starting
/// together on a new file do not trip over each other.
pub(crate) fn migrate(conn: &mut Connection, path: &Path) -> Result<(), SqliteError> {
    let found = retry_busy(|| {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let found: i64 = tx.pragma_query_value(None, "user_version", |row| row.get(0))?;
        if found <= VERSION {
            tx.execute_batch(SCHEMA_V1)?;
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
