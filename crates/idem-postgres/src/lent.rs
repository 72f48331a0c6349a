//! The pool's connections as the store's operations borrow them ([`Lent`]), and the session
//! settings that bound every statement on them ([`Bounds`]).
//!
//! An operation's caller gives up after its `store_timeout` and drops the operation. The
//! statement it was running may still be queued on the server (waiting on a lock), and the
//! connection would go back to the pool still busy: the next request to take it would queue
//! behind work nobody waits for. So a connection goes back to the pool only when its operation
//! ends; one dropped part-way is taken out of the pool, its statement cancelled on the server
//! and the connection closed. And every statement is bounded on the server too: each connection
//! is opened with `statement_timeout` and `lock_timeout` equal to the longest `store_timeout`
//! the store was given ([`Store::bound_operations`](idem_core::Store::bound_operations)), and
//! with `idle_in_transaction_session_timeout` equal to it too: idem's transactions run their
//! statements back to back, so one left idle that long is one whose connection was cut off
//! (its process frozen, its network path dead) while it held a record's row lock, which every
//! other instance would otherwise read as a run alive for as long as the server keeps the
//! session (until TCP notices: hours).

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use deadpool_postgres::{HookError, Object};
use tokio_postgres::NoTls;

/// A pooled connection lent to one operation: back to the pool by [`Lent::give_back`], or, if
/// dropped without it (its operation was dropped part-way), cancelled and closed.
pub(crate) struct Lent(Option<Object>);

impl Lent {
    pub(crate) fn new(object: Object) -> Self {
        Self(Some(object))
    }

    /// The operation ended: nothing runs on the connection any more.
    pub(crate) fn give_back(mut self) {
        drop(self.0.take());
    }
}

impl Deref for Lent {
    type Target = Object;

    fn deref(&self) -> &Object {
        self.0
            .as_ref()
            .expect("a lent connection is there until it is given back")
    }
}

impl DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut Object {
        self.0
            .as_mut()
            .expect("a lent connection is there until it is given back")
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let Some(object) = self.0.take() else { return };
        // Out of the pool: closed when dropped, below. Closing alone would not stop a statement
        // waiting on a lock (the server reads the socket only between statements), so the
        // statement is cancelled first, on a connection of its own.
        let client = Object::take(object);
        let cancel = client.cancel_token();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(err) = cancel.cancel_query(NoTls).await {
                    tracing::debug!(error = %err, "could not cancel the statement of an abandoned store operation");
                }
            });
        }
        drop(client);
    }
}

/// The server-side bound of every statement on the pool's connections.
#[derive(Debug, Default)]
pub(crate) struct Bounds(Mutex<Bound>);

#[derive(Debug, Default, Clone, Copy)]
struct Bound {
    /// The longest `store_timeout` given; none until one is given (then nothing is bounded).
    limit: Option<Duration>,
    /// When it last grew: connections opened before it carry a shorter bound.
    since: Option<Instant>,
}

impl Bounds {
    /// Keeps `limit` if it is longer than the bound so far.
    pub(crate) fn raise(&self, limit: Duration) {
        let mut bound = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if bound.limit.is_none_or(|known| limit > known) {
            *bound = Bound {
                limit: Some(limit),
                since: Some(Instant::now()),
            };
        }
    }

    /// The statement that sets the bound on a new connection, if there is one.
    pub(crate) fn session_settings(&self) -> Option<String> {
        let limit = self.bound().limit?;
        // Whole milliseconds, at least one (zero would mean no bound at all).
        let millis = limit.as_millis().clamp(1, i32::MAX as u128);
        Some(format!(
            "SET statement_timeout = {millis}; SET lock_timeout = {millis}; SET idle_in_transaction_session_timeout = {millis}"
        ))
    }

    /// Refuses a pooled connection opened before the bound last grew: the pool opens another.
    pub(crate) fn check(&self, created: Instant) -> Result<(), HookError> {
        match self.bound().since {
            Some(since) if created < since => Err(HookError::Message("opened under an older statement bound".into())),
            _ => Ok(()),
        }
    }

    fn bound(&self) -> Bound {
        *self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
