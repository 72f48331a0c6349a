//! How long to wait before a retry: exponential backoff with full jitter, and the server's
//! `Retry-After` (delay-seconds or an HTTP-date).

use std::time::{Duration, SystemTime};

use http::HeaderMap;
use http::header::RETRY_AFTER;
use rand::Rng;

/// Exponential backoff with full jitter: the `n`th retry waits a uniformly random time in
/// `[0, min(cap, base × 2ⁿ⁻¹)]`.
///
/// Full jitter spreads clients that failed together over the whole window, so a recovering
/// server sees a trickle instead of a synchronised wave ("Exponential Backoff And Jitter", AWS
/// Architecture Blog, 2015).
///
/// ```
/// use std::time::Duration;
/// use idem_client::Backoff;
///
/// let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
/// assert_eq!(backoff.window(1), Duration::from_millis(100));
/// assert_eq!(backoff.window(3), Duration::from_millis(400));
/// assert_eq!(backoff.window(20), Duration::from_secs(2)); // capped
/// assert!(backoff.delay(3) <= Duration::from_millis(400));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
}

impl Default for Backoff {
    /// 200 ms for the first retry, doubling up to 10 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(200), Duration::from_secs(10))
    }
}

impl Backoff {
    /// A backoff whose first window is `base` and which never waits longer than `cap`.
    pub fn new(base: Duration, cap: Duration) -> Self {
        Self { base, cap }
    }

    /// The first retry's window.
    pub fn base(&self) -> Duration {
        self.base
    }

    /// The longest wait.
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// The upper end of the window of the `retry`th retry (1 is the first; 0 counts as 1):
    /// `min(cap, base × 2^(retry − 1))`.
    pub fn window(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1);
        let grown = 1u32
            .checked_shl(doublings)
            .and_then(|factor| self.base.checked_mul(factor))
            .unwrap_or(Duration::MAX);
        grown.min(self.cap)
    }

    /// A random wait for the `retry`th retry, uniform over `[0, window(retry)]`.
    pub fn delay(&self, retry: u32) -> Duration {
        self.delay_at(retry, rand::rng().random::<f64>())
    }

    /// The wait at `fraction` (clamped to `[0, 1]`) of the window: the deterministic half of
    /// [`Backoff::delay`].
    pub(crate) fn delay_at(&self, retry: u32, fraction: f64) -> Duration {
        let fraction = if fraction.is_nan() {
            0.0
        } else {
            fraction.clamp(0.0, 1.0)
        };
        self.window(retry).mul_f64(fraction).min(self.cap)
    }
}

/// The wait a `Retry-After` header asks for, measured from `now`: delay-seconds, or the time until
/// an HTTP-date (zero if the date has passed). `None` when the header is absent or unreadable.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let text = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        // An absurdly long number still means "a long time", not "unreadable".
        return Some(Duration::from_secs(text.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(text).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn windows_double_until_the_cap() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_millis(1000));
        let windows: Vec<u128> = (0..=6).map(|n| b.window(n).as_millis()).collect();
        assert_eq!(windows, [100, 100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.window(u32::MAX), Duration::from_millis(1000));
        assert_eq!(b.delay_at(3, 0.0), Duration::ZERO);
        assert_eq!(b.delay_at(3, 1.0), Duration::from_millis(400));
        assert_eq!(b.delay_at(3, 0.5), Duration::from_millis(200));
        assert_eq!(b.delay_at(3, f64::NAN), Duration::ZERO);
        assert_eq!(b.delay_at(3, 7.0), Duration::from_millis(400));
    }

    #[test]
    fn a_cap_below_the_base_wins() {
        let b = Backoff::new(Duration::from_secs(5), Duration::from_secs(1));
        assert_eq!(b.window(1), Duration::from_secs(1));
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(retry_after(&headers("7"), now), Some(Duration::from_secs(7)));
        assert_eq!(retry_after(&headers(" 0 "), now), Some(Duration::ZERO));
        let in_90s = httpdate::fmt_http_date(now + Duration::from_secs(90));
        assert_eq!(retry_after(&headers(&in_90s), now), Some(Duration::from_secs(90)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(90));
        assert_eq!(retry_after(&headers(&past), now), Some(Duration::ZERO));
        assert_eq!(
            retry_after(&headers("99999999999999999999999"), now),
            Some(Duration::from_secs(u64::MAX))
        );
        assert_eq!(retry_after(&headers("soon"), now), None);
        assert_eq!(retry_after(&headers("-1"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }
}
