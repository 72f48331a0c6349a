//! In-process wake-ups for [`idem_core::Store::wait`]. The registry is process-wide and keyed by the
//! database file, so that every store object of this process that opened the same file wakes the
//! others' waiters. Other processes are noticed by polling.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use idem_core::store::RecordId;
use tokio::sync::Notify;

type WaitKey = (Arc<Path>, RecordId);

static WAITERS: LazyLock<Mutex<HashMap<WaitKey, Arc<Notify>>>> = LazyLock::new(Default::default);

fn waiters() -> std::sync::MutexGuard<'static, HashMap<WaitKey, Arc<Notify>>> {
    // The map stays consistent even if a holder panicked: every critical section is one map call.
    WAITERS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Interest in changes of one record; the registry entry goes when the last subscription does.
#[derive(Debug)]
pub(crate) struct Subscription {
    key: WaitKey,
    notify: Arc<Notify>,
}

impl Subscription {
    pub(crate) fn new(database: &Arc<Path>, id: &RecordId) -> Self {
        let key = (Arc::clone(database), id.clone());
        let notify = Arc::clone(waiters().entry(key.clone()).or_default());
        Self { key, notify }
    }

    pub(crate) fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut map = waiters();
        // Counted under the lock, which every new subscriber also takes: the map's reference and
        // ours are the last two.
        if Arc::strong_count(&self.notify) == 2 {
            map.remove(&self.key);
        }
    }
}

/// Wakes every waiter of this process on the record. Call it after the change is committed.
pub(crate) fn wake(database: &Arc<Path>, id: &RecordId) {
    // Woken under the lock (it only schedules tasks) so that no one else holds a reference that
    // would keep `Subscription::drop` from removing the entry.
    if let Some(notify) = waiters().get(&(Arc::clone(database), id.clone())) {
        notify.notify_waiters();
    }
}

#[cfg(test)]
pub(crate) fn is_registered(key: &WaitKey) -> bool {
    waiters().contains_key(key)
}
