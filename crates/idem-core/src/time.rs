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
    /// The last millisecond RFC 3339 can write, 9999-12-31T23:59:59.999Z: the latest time idem
    /// computes ([`plus`](Self::plus) stops there) and the latest a record can hold undamaged.
    /// Every store takes it (it is far below `i64::MAX`, PostgreSQL's `bigint`, and below what
    /// Redis's `PEXPIRE` accepts from any clock before the year 292 000 000).
    pub const LAST_RFC3339: Self = Self(253_402_300_799_999);

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

    /// This time plus `duration`, saturating at [`LAST_RFC3339`](Self::LAST_RFC3339): however
    /// long a duration a library user gives, what idem stores stays a time every store takes and
    /// every listing can print. (A time already past it, read from a damaged record, is kept.)
    pub fn plus(self, duration: Duration) -> Self {
        let millis = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        Self(self.0.saturating_add(millis).min(self.0.max(Self::LAST_RFC3339.0)))
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

    /// Whether RFC 3339 can write this time: not past the year 9999. No setting idem accepts
    /// makes a later one, so a record holding one is damaged.
    pub fn is_rfc3339(self) -> bool {
        self <= Self::LAST_RFC3339
    }

    /// The time in RFC 3339 with milliseconds; `None` past the year 9999, which it cannot write.
    pub fn rfc3339(self) -> Option<String> {
        self.is_rfc3339().then(|| self.to_string())
    }

    /// Why a record holding `times` (each with the name of its field) is damaged: the first of
    /// them past the year 9999, named; `None` if RFC 3339 can write them all.
    pub fn past_rfc3339(times: &[(&str, Self)]) -> Option<String> {
        let (field, at) = times.iter().find(|(_, at)| !at.is_rfc3339())?;
        Some(format!("its {field} is {at}, a time no setting idem accepts makes"))
    }
}

/// RFC 3339 with milliseconds (`2026-12-06T01:12:00.000Z`). A time past the year 9999, which
/// RFC 3339 cannot write, is written as its milliseconds and what they mean, never an error: a
/// `Display` error panics in `to_string`, and one damaged record would stop every listing.
impl fmt::Display for UnixMillis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_rfc3339() {
            humantime::format_rfc3339_millis(self.to_system_time()).fmt(f)
        } else {
            write!(f, "{} ms after the Unix epoch (past the year 9999)", self.0)
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_time_is_written_and_those_past_9999_say_so() {
        let cases = [
            (0, "1970-01-01T00:00:00.000Z"),
            (UnixMillis::LAST_RFC3339.0, "9999-12-31T23:59:59.999Z"),
            (
                UnixMillis::LAST_RFC3339.0 + 1,
                "253402300800000 ms after the Unix epoch (past the year 9999)",
            ),
            (
                u64::MAX,
                "18446744073709551615 ms after the Unix epoch (past the year 9999)",
            ),
        ];
        for (millis, written) in cases {
            let at = UnixMillis(millis);
            assert_eq!(at.to_string(), written, "{millis}");
            assert_eq!(at.rfc3339().is_some(), millis <= UnixMillis::LAST_RFC3339.0, "{millis}");
        }
        let damage = UnixMillis::past_rfc3339(&[("created_at", UnixMillis(5)), ("purge_at", UnixMillis(u64::MAX))]);
        assert!(damage.is_some_and(|why| why.starts_with("its purge_at is 18446744073709551615 ms")));
        assert_eq!(UnixMillis::past_rfc3339(&[("created_at", UnixMillis(5))]), None);
    }

    #[test]
    fn plus_stops_at_the_last_time_rfc3339_writes() {
        let now = UnixMillis(1_765_000_000_000);
        let cases = [
            (Duration::from_secs(60), UnixMillis(1_765_000_060_000)),
            (Duration::from_secs(8_000 * 365 * 86_400), UnixMillis::LAST_RFC3339),
            (Duration::MAX, UnixMillis::LAST_RFC3339),
        ];
        for (duration, expected) in cases {
            assert_eq!(now.plus(duration), expected, "{duration:?}");
        }
        let damaged = UnixMillis(u64::MAX - 5);
        assert_eq!(
            damaged.plus(Duration::from_millis(1)),
            UnixMillis(u64::MAX - 5),
            "a damaged time is kept"
        );
    }
}
