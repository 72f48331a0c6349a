//! The PostgreSQL store of idem: every record in one table, shared by every instance of a service.
//!
//! * **Claims** are one statement that reads the record and, only when there is none, inserts it
//!   (`INSERT ... ON CONFLICT DO NOTHING`), so a replay is a plain read. Taking over an expired
//!   lease or replacing a purged record is decided again in a transaction that holds the row's
//!   lock. Complete, release and renew are compare-and-set statements on the fencing token.
//! * **Waiters** are woken through `LISTEN`/`NOTIFY`: every change that ends a claim notifies in
//!   its own transaction, and each store keeps one dedicated listening connection that
//!   reconnects by itself. Waiters also poll, backing off up to `poll_interval`, so that nothing
//!   is missed while that connection is down; `notify=off` leaves only the polling, for poolers
//!   without `LISTEN` (PgBouncer in transaction mode).
//! * **Checkpoints** of a run are kept in its record's row: written by a compare-and-set on the
//!   fencing token, kept through a takeover or a release as unknown, and emptied by the statement
//!   that completes the record or claims it anew (deleting the row takes them with it).
//! * **The scope salt** (the key of the hash of credential scopes) is one row per schema: the
//!   first instance to ask makes it with `INSERT ... ON CONFLICT DO NOTHING` and every other one
//!   reads that row. Purging never touches it.
//! * **Purging** deletes and tombstones in batches, one instance at a time (an advisory lock
//!   that the others do not wait for), through indexes on `purge_at` and `expires_at`.
//! * **Migrations** are versioned (`idem_schema_migrations`) and run under an advisory lock, so
//!   that instances starting together are safe.
//! * **Outages**: the pool replaces broken connections and the listener reconnects, so the store
//!   works again, without a restart, once the server is back. Meanwhile operations fail with
//!   [`StoreError::Unavailable`](idem_core::StoreError::Unavailable).
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use idem_core::{Policy, Protocol, Store};
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
//!
//! Schema (version 3): `idem_records`, keyed by `(scope, key)`, indexed on `purge_at` and (for
//! rows that still hold an answer) on `expires_at`, with the checkpoints of the current run in two
//! arrays that line up, `checkpoint_names` and `checkpoint_values` (added by version 2);
//! `idem_scope_salt`, the one row of the scope salt (added by version 3);
//! `idem_schema_migrations`, the versions applied. An older database is upgraded in place when a
//! store connects. Statements are prepared once per connection: behind PgBouncer in transaction
//! mode this needs PgBouncer 1.21 or later with `max_prepared_statements` set.
#![forbid(unsafe_code)]

mod error;
mod listener;
mod replays;
mod schema;
mod store;
mod url;

pub use error::{BoxError, PostgresError};
pub use store::PostgresStore;
