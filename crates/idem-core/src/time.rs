//! Wall-clock time as the protocol sees it: milliseconds since the Unix epoch, read through an
//! injectable [`Clock`] so that leases and retention can be tested without sleeping.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time, in milliseconds since the Unix epoch.
///
/// Stores persist it as a plain integer so that every instance sharing a store agrees on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct UnixMillis(pub u64);

impl UnixMillis {
    /// The current system time.
    pub fn now() -> Self {
        Self::from_system_time(SystemTime::now())
    }

    /// Converts a [`SystemTime`]; times before the epoch become the epoch.
    pub fn from_system_time(time: SystemTime) -> Self {
        let millis = time.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis();
        Self(u64::try_from(millis).unwrap_or(u64::MAX))
    }

    /// Converts back to a [`SystemTime`].
    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0)
    }

    /// This time plus `duration`, saturating.
    pub fn plus(self, duration: Duration) -> Self {
        let millis = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        Self(self.0.saturating_add(millis))
    }

    /// This time minus `duration`, saturating at the epoch.
    pub fn minus(self, duration: Duration) -> Self {
        let millis = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        Self(self.0.saturating_sub(millis))
    }

    /// How long after `earlier` this time is (zero if it is not later).
    pub fn since(self, earlier: Self) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    /// The value as a signed integer, for stores whose integers are signed.
    pub fn as_i64(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }

    /// The inverse of [`UnixMillis::as_i64`]; negative values become the epoch.
    pub fn from_i64(value: i64) -> Self {
        Self(u64::try_from(value).unwrap_or(0))
    }
}

impl fmt::Display for UnixMillis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        humantime::format_rfc3339_millis(self.to_system_time()).fmt(f)
    }
}

/// The source of wall-clock time for the protocol.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> UnixMillis;
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> UnixMillis {
        UnixMillis::now()
    }
}

/// A clock that only moves when told to, for tests of leases and retention.
#[derive(Clone, Debug)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock stopped at `start`.
    pub fn new(start: UnixMillis) -> Self {
        Self(Arc::new(AtomicU64::new(start.0)))
    }

    /// A clock stopped at the current system time.
    pub fn starting_now() -> Self {
        Self::new(UnixMillis::now())
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let millis = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.0.fetch_add(millis, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> UnixMillis {
        UnixMillis(self.0.load(Ordering::SeqCst))
    }
}
