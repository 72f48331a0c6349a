//! [`StoreClock`]: the store's time, as seen from this process, so that every instance judges
//! leases, expiry and tombstones on one clock, whatever its own says.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::store::{Store, StoreError};
use crate::time::{Clock, UnixMillis};

/// How often the offset to the store's clock is measured again.
pub const RESYNC_EVERY: Duration = Duration::from_secs(10);

/// A measurement whose round trip took longer than this is too imprecise to use.
const MAX_ROUND_TRIP: Duration = Duration::from_secs(1);

/// An offset this large is worth telling the operator about.
const NOTABLE_OFFSET_MS: i64 = 1_000;

/// The store's clock, as seen from this process: this machine's clock corrected by its offset to
/// [`Store::clock`], measured at the first use and every [`RESYNC_EVERY`] after (half the round
/// trip is taken as the one-way delay).
///
/// Leases, expiry and tombstones are judged on it, so an instance whose clock is skewed (a
/// stopped NTP daemon, a VM resumed from a pause, a container with a fake time) neither takes
/// over a healthy run nor expires a key early: it reads the time every other instance reads.
/// Until the first measurement arrives (a round trip after the first use) it reads this
/// machine's clock; `idem serve` measures once before it listens.
pub struct StoreClock {
    store: Arc<dyn Store>,
    /// The store's clock minus this machine's, in milliseconds.
    offset_ms: AtomicI64,
    following: AtomicBool,
    me: Weak<Self>,
}

/// A measurement of the store's clock that was too slow to be precise.
#[derive(Debug, thiserror::Error)]
#[error("the store's clock answered after {0:?}, too late to measure it precisely")]
struct SlowMeasurement(Duration);

impl StoreClock {
    /// The clock of `store`; it follows the store once it is first read within a Tokio runtime.
    pub fn new(store: Arc<dyn Store>) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            store,
            offset_ms: AtomicI64::new(0),
            following: AtomicBool::new(false),
            me: me.clone(),
        })
    }

    /// Measures the offset to the store's clock now and uses it; returns it (store minus this
    /// machine, in milliseconds).
    pub async fn sync(&self) -> Result<i64, StoreError> {
        let local = UnixMillis::now();
        let started = Instant::now();
        let store = self.store.clock().await?;
        let round_trip = started.elapsed();
        if round_trip > MAX_ROUND_TRIP {
            return Err(StoreError::unavailable(SlowMeasurement(round_trip)));
        }
        let midway = as_i64(local.0).saturating_add(as_i64(round_trip.as_millis() as u64) / 2);
        let offset = as_i64(store.0).saturating_sub(midway);
        let before = self.offset_ms.swap(offset, Ordering::AcqRel);
        if offset.abs() >= NOTABLE_OFFSET_MS && (offset - before).abs() >= NOTABLE_OFFSET_MS {
            tracing::warn!(
                offset_ms = offset,
                "this machine's clock is off the store's; leases and expiry are judged on the store's"
            );
        }
        Ok(offset)
    }

    /// The offset in use: the store's clock minus this machine's, in milliseconds.
    pub fn offset_ms(&self) -> i64 {
        self.offset_ms.load(Ordering::Acquire)
    }

    /// Starts measuring in the background (once, and only within a runtime); the task ends when
    /// the clock is dropped.
    fn follow(&self) {
        if self.following.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.following.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.me.clone();
        runtime.spawn(async move {
            loop {
                let Some(clock) = me.upgrade() else { return };
                if let Err(err) = clock.sync().await {
                    tracing::warn!(error = %err, "could not read the store's clock; keeping the last offset");
                }
                drop(clock);
                tokio::time::sleep(RESYNC_EVERY).await;
            }
        });
    }
}

fn as_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

impl Clock for StoreClock {
    fn now(&self) -> UnixMillis {
        self.follow();
        let local = as_i64(UnixMillis::now().0);
        UnixMillis(u64::try_from(local.saturating_add(self.offset_ms())).unwrap_or(0))
    }
}

impl fmt::Debug for StoreClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreClock")
            .field("store", &self.store)
            .field("offset_ms", &self.offset_ms())
            .finish()
    }
}
