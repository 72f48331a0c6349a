//! The SQLite store of idem: every record in one file, safe to share between the processes of one
//! machine.
//!
//! The database runs in WAL mode; every write is one `BEGIN IMMEDIATE` transaction, so claims are
//! atomic across connections and processes. Waiters in this process are woken at once; changes
//! made by other processes are noticed by polling (5 ms, doubling up to 100 ms).
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use idem_core::{Policy, Store, protocol::Protocol};
//! use idem_sqlite::SqliteStore;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // Creates the file and its schema if they are absent.
//! let store = SqliteStore::from_url("sqlite://idem.db").await?;
//! store.ping().await?;
//! let protocol = Protocol::new(Arc::new(store), Policy::default());
//! # let _ = protocol;
//! # Ok(())
//! # }
//! ```
//!
//! Schema (`PRAGMA user_version` 4): one `STRICT` table `idem_records`, keyed by `(scope, key)`,
//! indexed on `purge_at` and (for rows that still hold an answer) on `expires_at`, so that
//! [`Store::purge`](idem_core::Store::purge) never scans the table, and on `created_at`, so that
//! [`Store::list`](idem_core::Store::list) reads records newest first. The checkpoints of a record's
//! current run are one blob in its row, so they go wherever the row goes. The store's
//! [scope salt](idem_core::Store::scope_salt) is the one row of `idem_scope_salt`, which purging
//! never touches. A file made by an older version is upgraded in place when it is opened.
//!
//! With the feature `sqlx`, [`SqliteStore::complete_in`] completes a record inside the handler's
//! own sqlx transaction on the same file: the answer commits with the business writes, or
//! neither does (docs/design.md, "Exactly once with the business write").
#![forbid(unsafe_code)]

mod checkpoints;
mod conn;
mod decode;
mod deletions;
mod error;
#[cfg(feature = "sqlx")]
mod in_transaction;
mod list;
mod schema;
mod sql;
mod store;
mod url;
mod waiters;

pub use deletions::DELETIONS_POLL_INTERVAL;
pub use error::SqliteError;
pub use store::SqliteStore;
