//! Why a SQLite store could not be opened. Errors of store operations are
//! [`idem_core::StoreError`]s; this type only covers setting the store up.

use std::io;
use std::path::{Path, PathBuf};

/// A SQLite store could not be opened or set up.
#[derive(Debug, thiserror::Error)]
pub enum SqliteError {
    /// The URL is not a SQLite URL this store understands.
    #[error(
        "invalid SQLite store URL {url:?}: {reason}; expected sqlite://relative/path.db, sqlite:///absolute/path.db or sqlite:path"
    )]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The database file cannot be opened or created.
    #[error("cannot open the SQLite database {}: {reason}", path.display())]
    Open {
        /// The path as given.
        path: PathBuf,
        /// What went wrong, in words (which directory is missing, ...).
        reason: String,
        /// The error of the file system.
        #[source]
        source: io::Error,
    },
    /// The file was opened but SQLite refused to use it (not a database, locked for longer than the
    /// busy timeout, ...).
    #[error("cannot set up the SQLite database {}", path.display())]
    Setup {
        /// The path as given.
        path: PathBuf,
        /// The error of SQLite.
        #[source]
        source: rusqlite::Error,
    },
    /// The database was created by a newer version of idem.
    #[error(
        "the SQLite database {} has schema version {found}, but this version of idem only knows versions up to {supported}; upgrade idem",
        path.display()
    )]
    NewerSchema {
        /// The path as given.
        path: PathBuf,
        /// The version found in the file.
        found: i64,
        /// The newest version this crate knows.
        supported: i64,
    },
    /// The blocking task that sets the store up did not finish (the runtime is shutting down).
    #[error("setting up the SQLite database {} was cancelled", path.display())]
    Cancelled {
        /// The path as given.
        path: PathBuf,
        /// The error of the runtime.
        #[source]
        source: tokio::task::JoinError,
    },
}

impl SqliteError {
    pub(crate) fn open(path: &Path, source: io::Error) -> Self {
        let reason = match source.kind() {
            io::ErrorKind::NotFound => match path.parent().filter(|p| !p.as_os_str().is_empty()) {
                Some(parent) => format!("the directory {} does not exist", parent.display()),
                None => "the directory does not exist".to_owned(),
            },
            io::ErrorKind::PermissionDenied => "permission denied".to_owned(),
            io::ErrorKind::IsADirectory => "it is a directory, not a file".to_owned(),
            io::ErrorKind::NotADirectory => "a part of the path is not a directory".to_owned(),
            io::ErrorKind::ReadOnlyFilesystem => "the file system is read-only".to_owned(),
            kind => kind.to_string(),
        };
        Self::Open {
            path: path.to_owned(),
            reason,
            source,
        }
    }

    pub(crate) fn setup(path: &Path, source: rusqlite::Error) -> Self {
        Self::Setup {
            path: path.to_owned(),
            source,
        }
    }
}
