//! A spawned task that ends with its owner: a test's server stops when the test drops it, whether
//! the test passed or panicked.

use std::future::Future;

use tokio::task::JoinHandle;

/// A task aborted when dropped.
#[derive(Debug)]
pub struct AbortOnDrop(JoinHandle<()>);

impl AbortOnDrop {
    /// Spawns `task` on the current runtime.
    pub fn spawn(task: impl Future<Output = ()> + Send + 'static) -> Self {
        Self(tokio::spawn(task))
    }

    /// Serves `app` on `listener` (a test's HTTP server), until dropped.
    ///
    /// # Panics
    /// In its task, if the server fails.
    pub fn serve(listener: tokio::net::TcpListener, app: axum::Router) -> Self {
        Self::spawn(async move { axum::serve(listener, app).await.expect("a test server serves") })
    }

    /// Aborts the task and returns once it is gone, and what it owned (a listener) with it.
    pub async fn stop(&mut self) {
        self.0.abort();
        let _ = (&mut self.0).await;
    }
}

impl From<JoinHandle<()>> for AbortOnDrop {
    fn from(task: JoinHandle<()>) -> Self {
        Self(task)
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
