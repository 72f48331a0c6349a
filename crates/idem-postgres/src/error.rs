//! Why a PostgreSQL store could not be set up ([`PostgresError`]), and how the errors of store
//! operations are described inside [`idem_core::StoreError`].
//!
//! No message ever contains a password: servers are named by `user@host:port/database`.

use std::error::Error as StdError;
use std::fmt::Write as _;
use std::sync::Arc;

use idem_core::StoreError;

/// The error of a driver or of the pool, as the cause of a [`PostgresError`].
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// A PostgreSQL store could not be set up. Errors of store operations are
/// [`idem_core::StoreError`]s; this type only covers connecting and migrating.
#[derive(Debug, thiserror::Error)]
pub enum PostgresError {
    /// The URL is not a PostgreSQL URL this store understands.
    #[error(
        "invalid PostgreSQL store URL {url:?}: {reason}; expected postgres://user[:password]@host[:port]/database[?option=value&...]"
    )]
    InvalidUrl {
        /// The URL as given, with any password replaced by `***`.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No connection to the server could be made (it is down or unreachable, the database does not
    /// exist, the credentials were refused, ...).
    #[error("cannot connect to PostgreSQL at {target}")]
    Connect {
        /// The server, as `user@host:port/database`.
        target: String,
        /// The error of the driver or of the pool.
        #[source]
        source: BoxError,
    },
    /// The schema could not be created or brought up to date.
    #[error("cannot migrate the idem schema in PostgreSQL at {target}: {step} failed")]
    Migrate {
        /// The server, as `user@host:port/database`.
        target: String,
        /// The step that failed, in words.
        step: String,
        /// The error of the driver.
        #[source]
        source: BoxError,
    },
    /// The database was migrated by a newer version of idem.
    #[error(
        "the idem schema in PostgreSQL at {target} has version {found}, but this version of idem only knows versions up to {supported}; upgrade idem"
    )]
    NewerSchema {
        /// The server, as `user@host:port/database`.
        target: String,
        /// The newest version recorded in `idem_schema_migrations`.
        found: i32,
        /// The newest version this crate knows.
        supported: i32,
    },
    /// The connecting role lacks rights the store needs on a migrated schema (`USAGE` on the
    /// schema, a right on a table or a function).
    #[error(
        "the role {role} lacks {missing} in PostgreSQL at {target}; grant it, or connect as a role that has it (the grants of each role: docs/stores.md, \"PostgreSQL roles\")"
    )]
    MissingPrivileges {
        /// The server, as `user@host:port/database`.
        target: String,
        /// The role connected (`current_user`).
        role: String,
        /// Each missing right and its object: `USAGE on schema idem, DELETE on table idem.idem_records`.
        missing: String,
    },
    /// The schema is older than this version of idem, and the connecting role cannot migrate it.
    #[error(
        "the idem schema {schema} in PostgreSQL at {target} is at version {found} and this idem needs version {needed}, but the role {role} cannot migrate it: it lacks {missing}; run `idem migrate` with a role that has it"
    )]
    MigrationNeeded {
        /// The server, as `user@host:port/database`.
        target: String,
        /// The schema of the store's tables.
        schema: String,
        /// The role connected (`current_user`).
        role: String,
        /// The version recorded in `idem_schema_migrations` (0: none).
        found: i32,
        /// The newest version this crate knows.
        needed: i32,
        /// Each missing right and its object.
        missing: String,
    },
    /// No `schema=` was given, and no schema of the connection's `search_path` exists.
    #[error(
        "no schema of the search_path ({search_path}) exists in PostgreSQL at {target}: name one with schema=NAME in the store URL"
    )]
    NoSchema {
        /// The server, as `user@host:port/database`.
        target: String,
        /// The connection's `search_path`.
        search_path: String,
    },
    /// The connection that listens for change notifications could not be set up.
    #[error(
        "cannot LISTEN for change notifications on PostgreSQL at {target} (behind a pooler without LISTEN, such as PgBouncer in transaction mode, add notify=off to the URL)"
    )]
    Listen {
        /// The server, as `user@host:port/database`.
        target: String,
        /// The error of the driver.
        #[source]
        source: BoxError,
    },
}

/// What went wrong in one store operation: becomes the source of
/// [`StoreError::Unavailable`]. Its message carries the driver's whole explanation (the driver's
/// own top-level message is only "db error"), so that a log line of the store error says it all.
#[derive(Debug, thiserror::Error)]
#[error("{operation} on PostgreSQL at {target}: {detail}")]
pub(crate) struct Failure {
    operation: &'static str,
    target: Arc<str>,
    detail: String,
    #[source]
    source: Option<BoxError>,
}

impl Failure {
    pub(crate) fn new(operation: &'static str, target: &Arc<str>, detail: String, source: Option<BoxError>) -> Self {
        Self {
            operation,
            target: Arc::clone(target),
            detail,
            source,
        }
    }

    /// Wraps a driver error of `operation`.
    pub(crate) fn db(operation: &'static str, target: &Arc<str>, err: tokio_postgres::Error) -> StoreError {
        StoreError::unavailable(Self::new(operation, target, describe(&err), Some(Box::new(err))))
    }

    /// Wraps an error of the pool: no connection could be had for `operation`.
    pub(crate) fn pool(
        operation: &'static str,
        target: &Arc<str>,
        err: deadpool_postgres::PoolError,
        pool_size: usize,
    ) -> StoreError {
        use deadpool_postgres::{PoolError, TimeoutType};
        let failure = match err {
            PoolError::Backend(err) => Self::new(operation, target, describe(&err), Some(Box::new(err))),
            PoolError::Timeout(TimeoutType::Wait) => Self::new(
                operation,
                target,
                format!("all {pool_size} pooled connections stayed busy (raise pool_size in the store URL)"),
                Some(Box::new(err)),
            ),
            err => Self::new(operation, target, describe(&err), Some(Box::new(err))),
        };
        StoreError::unavailable(failure)
    }
}

/// An error and its causes in one line: `error connecting to server: Connection refused (os
/// error 111)`, `db error: ERROR: relation "idem_records" does not exist`.
pub(crate) fn describe(err: &(dyn StdError + 'static)) -> String {
    let mut out = err.to_string();
    let mut cause = err.source();
    while let Some(err) = cause {
        let text = err.to_string();
        // Some causes repeat their wrapper's message.
        if !out.ends_with(&text) {
            let _ = write!(out, ": {text}");
        }
        cause = err.source();
    }
    out
}

/// The server refused to wait for a row lock (`55P03`, `lock_not_available`): a statement with
/// `NOWAIT` found the row locked, or one waited out the session's `lock_timeout`.
pub(crate) fn lock_not_available(err: &tokio_postgres::Error) -> bool {
    err.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE)
}
