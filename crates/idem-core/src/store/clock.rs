//! [`StoreClock`]: the store's time, as seen from this process, so that every instance judges
//! leases, expiry and tombstones on one clock, whatever its own says.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::store::{Store, StoreError};
use crate::time::{Clock, UnixMillis};

/// How often the store's clock is measured again.
pub const RESYNC_EVERY: Duration = Duration::from_secs(10);

/// A measurement whose round trip took at most this long replaces the one held. A slower one
/// replaces it only if it is no slower than the one held: the first is taken however slow (half
/// its round trip still bounds its error, where this machine's clock has none), and a store that
/// stays slow is followed by its most precise reading.
const MAX_ROUND_TRIP: Duration = Duration::from_secs(1);

/// An offset this large is worth telling the operator about.
const NOTABLE_OFFSET_MS: i64 = 1_000;

/// No measurement yet (in `store_minus_elapsed_ms`).
const UNMEASURED: i64 = i64::MIN;

/// The store's clock, as seen from this process: the store's time at the last measurement (half
/// the round trip is taken as the one-way delay), carried forward by a steady clock
/// ([`steady_ms`]: never stepped, and counting time suspended); measured at the first use and
/// every [`RESYNC_EVERY`] after.
///
/// Leases, expiry and tombstones are judged on it, so an instance whose clock is skewed (a
/// stopped NTP daemon, a container with a fake time) neither takes over a healthy run nor expires
/// a key early: it reads the time every other instance reads. This machine's wall clock plays no
/// part once the store has been measured, so a step of it (an NTP correction, `date -s`, a
/// resumed VM setting its time) moves nothing: between two measurements the time advances as the
/// steady clock does. Until the first measurement arrives (a round trip after the first use) it
/// reads this machine's wall clock; `idem serve` measures once before it listens. A store whose
/// clock is this machine's ([`Store::clock_is_local`], SQLite) is read at every use instead:
/// every process sharing its file then sees a step at the same moment.
pub struct StoreClock {
    store: Arc<dyn Store>,
    /// When this clock was made, on the steady clock ([`steady_ms`]).
    started_ms: i64,
    /// The store's time in Unix milliseconds minus the milliseconds elapsed since `started_ms`,
    /// at the last measurement; [`UNMEASURED`] before the first.
    store_minus_elapsed_ms: AtomicI64,
    /// The round trip of the measurement held, in milliseconds ([`i64::MAX`] before the first).
    round_trip_ms: AtomicI64,
    /// The offset to this machine's wall clock last told (store minus this machine, in
    /// milliseconds): a step of the wall clock shows as a change of it.
    told_offset_ms: AtomicI64,
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
            started_ms: steady_ms(),
            store_minus_elapsed_ms: AtomicI64::new(UNMEASURED),
            round_trip_ms: AtomicI64::new(i64::MAX),
            told_offset_ms: AtomicI64::new(0),
            following: AtomicBool::new(false),
            me: me.clone(),
        })
    }

    /// Measures the store's clock now and uses it; returns its offset to this machine's wall
    /// clock (store minus this machine, in milliseconds), for the operator.
    pub async fn sync(&self) -> Result<i64, StoreError> {
        let asked = self.elapsed_ms();
        let store = self.store.clock().await?;
        let answered = self.elapsed_ms();
        let round_trip_ms = answered.saturating_sub(asked).max(0);
        let round_trip = Duration::from_millis(u64::try_from(round_trip_ms).unwrap_or(0));
        if round_trip > MAX_ROUND_TRIP && round_trip_ms > self.round_trip_ms.load(Ordering::Acquire) {
            return Err(StoreError::unavailable(SlowMeasurement(round_trip)));
        }
        // The store read its clock about halfway through the round trip.
        let measured = as_i64(store.0).saturating_sub(asked.saturating_add(answered) / 2);
        self.store_minus_elapsed_ms.store(measured, Ordering::Release);
        self.round_trip_ms.store(round_trip_ms, Ordering::Release);
        let offset = self.offset_ms();
        let before = self.told_offset_ms.swap(offset, Ordering::AcqRel);
        if offset.abs() >= NOTABLE_OFFSET_MS && (offset - before).abs() >= NOTABLE_OFFSET_MS {
            tracing::warn!(
                offset_ms = offset,
                "this machine's clock is off the store's; leases and expiry are judged on the store's"
            );
        }
        Ok(offset)
    }

    /// The store's clock minus this machine's wall clock, in milliseconds (0 before the first
    /// measurement): what the operator is told, not what the time is computed from.
    pub fn offset_ms(&self) -> i64 {
        self.read()
            .map_or(0, |now| now.saturating_sub(as_i64(UnixMillis::now().0)))
    }

    /// Milliseconds elapsed on the steady clock since this clock was made.
    fn elapsed_ms(&self) -> i64 {
        steady_ms().saturating_sub(self.started_ms)
    }

    /// The store's time now, in Unix milliseconds, if it has been measured.
    fn read(&self) -> Option<i64> {
        let measured = self.store_minus_elapsed_ms.load(Ordering::Acquire);
        (measured != UNMEASURED).then(|| measured.saturating_add(self.elapsed_ms()))
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
                    tracing::warn!(error = %err, "could not read the store's clock; keeping the last measurement");
                }
                drop(clock);
                tokio::time::sleep(RESYNC_EVERY).await;
            }
        });
    }
}

/// Milliseconds on a clock that is never stepped: Linux's `CLOCK_BOOTTIME`, which also counts the
/// time the machine was suspended (a clock that stopped then would lag the store's by as long
/// until the next measurement); elsewhere the monotonic clock of [`std::time::Instant`], from the
/// first read.
#[cfg(target_os = "linux")]
fn steady_ms() -> i64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    now.tv_sec.saturating_mul(1_000).saturating_add(now.tv_nsec / 1_000_000)
}

#[cfg(not(target_os = "linux"))]
fn steady_ms() -> i64 {
    static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    i64::try_from(ORIGIN.get_or_init(std::time::Instant::now).elapsed().as_millis()).unwrap_or(i64::MAX)
}

fn as_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

impl Clock for StoreClock {
    fn now(&self) -> UnixMillis {
        if self.store.clock_is_local() {
            return UnixMillis::now();
        }
        self.follow();
        let now = self.read().unwrap_or_else(|| as_i64(UnixMillis::now().0));
        UnixMillis(u64::try_from(now).unwrap_or(0))
    }
}

impl fmt::Debug for StoreClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreClock")
            .field("store", &self.store)
            .field("offset_ms", &self.offset_ms())
            .field("measured", &self.read().is_some())
            .finish()
    }
}
