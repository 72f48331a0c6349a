//! The connections that carry acknowledged writes, each lent to one call at a time.
//!
//! `WAIT` blocks the connection that sends it, on the server, until the replicas answer or its
//! timeout ends: a command queued behind it on the same connection waits as long. So a connection
//! here carries one write and its `WAIT` at a time, and the pool opens more as the concurrency
//! needs them (up to [`MAX_CONNECTIONS`]): a stalled replica costs each write its own
//! `replica_timeout`, never the sum of those queued before it. A connection whose call did not end
//! cleanly (timed out, reset, or abandoned by its caller) may still have a `WAIT` pending on the
//! server: it is closed, never lent again.

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use redis::RedisResult;
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::time::Instant;

use crate::conn::Commands;
use crate::url::Config;

/// How many connections are opened with the pool, so that ordinary traffic never waits for one.
pub(crate) const OPENED_AT_START: usize = 4;

/// The most connections the pool holds: writes that wait for replicas at the same moment beyond
/// this wait for a connection, within their own `replica_timeout`.
pub(crate) const MAX_CONNECTIONS: usize = 128;

/// The pool.
pub(crate) struct AckPool {
    config: Config,
    /// How long one call on a connection may take (the write, then `WAIT`).
    response_timeout: Duration,
    /// One permit per connection that may be lent at once.
    permits: Semaphore,
    /// Connections not lent now, the most recently given back last.
    idle: Mutex<Vec<Arc<Commands>>>,
    /// Every connection opened and not closed, lent or not (for Sentinel to move them).
    opened: Mutex<Vec<Weak<Commands>>>,
}

/// Why no connection could be lent.
#[derive(Debug)]
pub(crate) enum NotLent {
    /// Every connection was lent until the deadline.
    AllBusy,
    /// A new connection could not be opened (or not before the deadline: `None`).
    Open(Option<redis::RedisError>),
}

impl AckPool {
    /// Opens the pool with [`OPENED_AT_START`] connections; a call on one may take
    /// `response_timeout`.
    pub(crate) async fn open(config: &Config, response_timeout: Duration) -> RedisResult<Self> {
        let pool = Self {
            config: config.clone(),
            response_timeout,
            permits: Semaphore::new(MAX_CONNECTIONS),
            idle: Mutex::new(Vec::with_capacity(MAX_CONNECTIONS)),
            opened: Mutex::new(Vec::with_capacity(MAX_CONNECTIONS)),
        };
        for _ in 0..OPENED_AT_START {
            let commands = pool.connect().await?;
            pool.idle.lock().unwrap_or_else(PoisonError::into_inner).push(commands);
        }
        Ok(pool)
    }

    /// A connection for one call, by `deadline`: an idle one, or a new one.
    pub(crate) async fn lend(&self, deadline: Instant) -> Result<Lent<'_>, NotLent> {
        let permit = tokio::time::timeout_at(deadline, self.permits.acquire())
            .await
            .map_err(|_| NotLent::AllBusy)?
            .expect("the pool's semaphore is never closed");
        let idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let commands = match idle {
            Some(commands) => commands,
            None => match tokio::time::timeout_at(deadline, self.connect()).await {
                Ok(Ok(commands)) => commands,
                Ok(Err(err)) => return Err(NotLent::Open(Some(err))),
                Err(_) => return Err(NotLent::Open(None)),
            },
        };
        Ok(Lent {
            pool: self,
            commands: Some(commands),
            _permit: permit,
        })
    }

    /// Every connection open now, lent or not.
    pub(crate) fn connections(&self) -> Vec<Arc<Commands>> {
        let mut opened = self.opened.lock().unwrap_or_else(PoisonError::into_inner);
        opened.retain(|commands| commands.strong_count() > 0);
        opened.iter().filter_map(Weak::upgrade).collect()
    }

    async fn connect(&self) -> RedisResult<Arc<Commands>> {
        let commands = Commands::connect(&self.config, self.response_timeout).await?;
        let mut opened = self.opened.lock().unwrap_or_else(PoisonError::into_inner);
        opened.retain(|commands| commands.strong_count() > 0);
        opened.push(Arc::downgrade(&commands));
        Ok(commands)
    }
}

/// A connection lent for one call. Dropped without [`Lent::give_back`], it is closed: its call
/// did not end cleanly, and a `WAIT` may still hold it on the server.
pub(crate) struct Lent<'a> {
    pool: &'a AckPool,
    commands: Option<Arc<Commands>>,
    _permit: SemaphorePermit<'a>,
}

impl Lent<'_> {
    /// The connection.
    pub(crate) fn commands(&self) -> &Arc<Commands> {
        self.commands.as_ref().expect("present until given back")
    }

    /// Its call ended with every reply read: the connection may carry the next one.
    pub(crate) fn give_back(mut self) {
        if let Some(commands) = self.commands.take() {
            self.pool
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(commands);
        }
    }
}
