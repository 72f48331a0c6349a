//! The store conformance suite of `idem-core`, on a SQLite file shared by several handles.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use idem_core::Store;
use idem_core::testkit::Harness;
use idem_sqlite::SqliteStore;

/// One database file per case; every `open` is a new handle on it, as another process would have.
struct SqliteHarness {
    dir: tempfile::TempDir,
}

impl SqliteHarness {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("a temporary directory"),
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("idem.db")
    }
}

#[async_trait]
impl Harness for SqliteHarness {
    async fn open(&self) -> Arc<dyn Store> {
        Arc::new(SqliteStore::open(self.path()).await.expect("open the SQLite store"))
    }

    /// Every record and the salt deleted from the file under the open handles.
    async fn lose_data(&self) {
        let conn = rusqlite::Connection::open(self.path()).expect("open the file");
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .expect("busy timeout");
        conn.execute_batch("DELETE FROM idem_records; DELETE FROM idem_scope_salt;")
            .expect("delete the records and the salt");
    }
}

idem_core::conformance_tests!(SqliteHarness::new());
