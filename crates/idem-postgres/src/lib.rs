//! The PostgreSQL store of idem: every record in one table, shared by every instance of a service.
//!
//! A claim is one statement (a replay is a plain read); complete, release and renew are
//! compare-and-set statements on the fencing token; waiters are woken by `LISTEN`/`NOTIFY` with a
//! polling fallback; purging runs in batches, one instance at a time; migrations are versioned and
//! run under an advisory lock. How each of these works, and the schema: `docs/stores.md` in the
//! repository; the store contract: `docs/design.md`.
//!
//! When it connects, a store reads whether the server's commits wait for a synchronous standby
//! ([`PostgresStore::replication`]) and logs a warning when a failover (or, with
//! `synchronous_commit = off`, a crash) can lose claims and answers.
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use idem_core::{Policy, Store, protocol::Protocol};
//! use idem_postgres::PostgresStore;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // Connects, creates or updates the schema, and starts listening for changes.
//! let store = PostgresStore::connect("postgres://idem:secret@db.internal:5432/app?pool_size=32").await?;
//! store.ping().await?;
//! let protocol = Protocol::new(Arc::new(store), Policy::default());
//! # let _ = protocol;
//! # Ok(())
//! # }
//! ```
//!
//! URL options, taken out before the URL is handed to tokio-postgres (whose own options, such
//! as `connect_timeout` or `application_name`, pass through):
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `pool_size=N` | 16 | connections in the pool |
//! | `notify=on\|off` | `on` | wake waiters by `LISTEN`/`NOTIFY`; `off` polls only |
//! | `poll_interval=DUR` | `200ms` | the longest pause between two checks of a waiter (the first comes after a quarter of it) |
//! | `schema=NAME` | the `search_path` | the PostgreSQL schema of the tables, created if missing |
//! | `read_first=auto\|always\|never` | `auto` | read a replay's record on connections shared by many reads (pipelined) before claiming on the pool: while replays are most of the recent requests (`auto`), always, or never (and open no such connection: for a pooler that cannot pipeline) |
//! | `read_connections=N` | 2 | the connections those reads share, besides the pool |
//!
//! A handler whose business data is in the same database completes its record inside its own
//! transaction: [`PostgresStore::complete_in_client`] for tokio-postgres and, with the feature
//! `sqlx`, `PostgresStore::complete_in` for sqlx. [`StoreDatabase`] gives its own connections the
//! store's database, without the store's options, and its schema. The answer commits with the business writes, or
//! neither does (`docs/design.md`, "Exactly once with the business write").
#![forbid(unsafe_code)]

mod decode;
mod error;
mod in_transaction;
mod lent;
mod listener;
mod privileges;
mod read_first;
mod replays;
mod replication;
mod schema;
mod sql;
mod store;
mod url;

pub use error::{BoxError, PostgresError};
pub use privileges::Access;
pub use replication::{Replication, SynchronousCommit};
pub use store::PostgresStore;
pub use url::StoreDatabase;
