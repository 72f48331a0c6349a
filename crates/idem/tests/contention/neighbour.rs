//! A neighbour of the gateway's SQLite file: another connection (as another process writing to
//! the same file would be) that takes the database's write lock and holds it until told to let
//! go, or until a cap.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

/// A write transaction held open on a SQLite file.
pub(crate) struct Neighbour {
    release: mpsc::Sender<()>,
    /// Answers, once released, whether the cap ran out before the release came.
    held: tokio::task::JoinHandle<bool>,
}

impl Neighbour {
    /// Takes the write lock of the database at `path` (`BEGIN IMMEDIATE`, a row written) and
    /// holds it until [`Neighbour::release`] or `cap`; returns once it holds it.
    pub(crate) async fn hold(path: PathBuf, cap: Duration) -> Self {
        let (release, released) = mpsc::channel::<()>();
        let (holding, held_now) = tokio::sync::oneshot::channel::<()>();
        let held = tokio::task::spawn_blocking(move || {
            let conn = rusqlite::Connection::open(&path).expect("open the gateway's SQLite file");
            conn.busy_timeout(Duration::from_secs(30)).expect("busy timeout");
            conn.execute_batch(
                "BEGIN IMMEDIATE; CREATE TABLE IF NOT EXISTS neighbour (n INTEGER); INSERT INTO neighbour VALUES (1);",
            )
            .expect("take the write lock");
            let _ = holding.send(());
            let capped = matches!(released.recv_timeout(cap), Err(mpsc::RecvTimeoutError::Timeout));
            conn.execute_batch("COMMIT").expect("let the write lock go");
            capped
        });
        held_now.await.expect("the neighbour took the write lock");
        Self { release, held }
    }

    /// Lets the lock go; whether the cap had run out first.
    pub(crate) async fn release(self) -> bool {
        let _ = self.release.send(());
        self.held.await.expect("the neighbour")
    }
}
