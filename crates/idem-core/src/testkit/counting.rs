//! A store whose operations are counted, to prove how many round trips a request costs.

use std::time::Duration;

use crate::Store;
use crate::store::{Observed, Observer, StoreOperation};

/// A store whose operations are counted, to prove how many round trips a request costs.
pub type CountingStore<S> = Observed<S, Counts>;

/// Counts the operations on `inner`.
pub fn counting<S: Store>(inner: S) -> CountingStore<S> {
    Observed::new(inner, Counts::default())
}

/// An [`Observer`] that counts each operation.
#[derive(Debug, Default)]
pub struct Counts {
    counts: [std::sync::atomic::AtomicU64; StoreOperation::ALL.len()],
}

impl Observer for Counts {
    fn observe(&self, operation: StoreOperation, _elapsed: Duration, _failed: bool) {
        self.counts[operation as usize].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl<S> Observed<S, Counts> {
    /// How many times `operation` ran.
    pub fn count(&self, operation: StoreOperation) -> u64 {
        self.observer().counts[operation as usize].load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many operations ran in all, the per-instance reads (clock, scope salt) aside.
    pub fn total(&self) -> u64 {
        StoreOperation::ALL
            .into_iter()
            .filter(|operation| !operation.per_instance())
            .map(|operation| self.count(operation))
            .sum()
    }

    /// Starts counting from zero again.
    pub fn reset(&self) {
        for count in &self.observer().counts {
            count.store(0, std::sync::atomic::Ordering::SeqCst);
        }
    }
}
