//! What the middleware tells the caller: how many attempts, which key, whether the final answer
//! was a replay, and, when it stopped retrying early, why.

use std::fmt;
use std::time::Duration;

use idem_core::IdempotencyKey;

/// How one logical request went. The middleware puts it into the final response's extensions
/// (read it with [`ResponseExt::retry_report`]) and into every [`RetryError`](crate::RetryError).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryReport {
    /// Attempts made, the first included.
    pub attempts: u32,
    /// The idempotency key every attempt carried: stamped by the middleware or given by the caller.
    /// `None` when the request had no valid key (a `GET`, or stamping turned off).
    pub key: Option<IdempotencyKey>,
    /// Whether the final answer carries `Idempotency-Replayed: true`: the server had already
    /// handled this key and returned the stored answer instead of running the request again.
    pub replayed: bool,
    /// Time spent waiting between attempts.
    pub waited: Duration,
    /// Time from the first attempt to the final answer.
    pub elapsed: Duration,
    /// `None` when the final answer was final (a success, or not worth a retry). `Some` when it was
    /// worth a retry but the middleware stopped, and why.
    pub stopped: Option<StopReason>,
}

/// Why the middleware stopped retrying an answer or error that was worth a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StopReason {
    /// The classifier says the outcome is final (used for errors: an answer that is final leaves
    /// [`RetryReport::stopped`] empty).
    NotRetryable,
    /// The request has no key and a method that is not idempotent (a keyless `POST`), and it may
    /// have reached the server: repeating it could run it twice.
    UnsafeToRepeat,
    /// The retries allowed were all made.
    RetriesExhausted,
    /// The shared retry budget is empty: the server is failing many requests of this client.
    BudgetExhausted,
    /// The next backoff wait would end after the deadline.
    DeadlineTooClose,
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotRetryable => "the error is not worth a retry",
            Self::UnsafeToRepeat => {
                "a request without an idempotency key may have been processed; repeating it is unsafe"
            }
            Self::RetriesExhausted => "no retries left",
            Self::BudgetExhausted => "the client's retry budget is spent",
            Self::DeadlineTooClose => "the next wait would end after the deadline",
        })
    }
}

/// Rounds to milliseconds and prints in humantime form (`1s 250ms`).
pub(crate) fn human(duration: Duration) -> humantime::FormattedDuration {
    let millis = Duration::from_millis(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX));
    humantime::format_duration(millis)
}

impl fmt::Display for RetryReport {
    /// `attempts=3 key=0193… replayed=true waited=0.412s`, the form `idem request` prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "attempts={} key=", self.attempts)?;
        match &self.key {
            Some(key) => write!(f, "{key}")?,
            None => f.write_str("none")?,
        }
        write!(
            f,
            " replayed={} waited={:.3}s",
            self.replayed,
            self.waited.as_secs_f64()
        )
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for reqwest::Response {}
    impl Sealed for reqwest_middleware::Error {}
}

/// Reads the [`RetryReport`] from a response sent through the middleware.
pub trait ResponseExt: sealed::Sealed {
    /// The report, or `None` if the response did not pass through an
    /// [`IdempotencyMiddleware`](crate::IdempotencyMiddleware).
    fn retry_report(&self) -> Option<&RetryReport>;
}

impl ResponseExt for reqwest::Response {
    fn retry_report(&self) -> Option<&RetryReport> {
        self.extensions().get::<RetryReport>()
    }
}

/// Reads this crate's [`RetryError`](crate::RetryError) out of a `reqwest_middleware::Error`,
/// which carries middleware errors as `anyhow::Error`.
pub trait ErrorExt: sealed::Sealed {
    /// The middleware's error, if this is one.
    fn retry_error(&self) -> Option<&crate::RetryError>;

    /// The report of the attempts made before the middleware gave up, if it did.
    fn retry_report(&self) -> Option<&RetryReport> {
        self.retry_error().and_then(crate::RetryError::report)
    }
}

impl ErrorExt for reqwest_middleware::Error {
    fn retry_error(&self) -> Option<&crate::RetryError> {
        match self {
            reqwest_middleware::Error::Middleware(err) => err.downcast_ref(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_form() {
        let report = RetryReport {
            attempts: 3,
            key: Some(IdempotencyKey::new("k-1").unwrap()),
            replayed: true,
            waited: Duration::from_micros(412_345),
            elapsed: Duration::from_secs(1),
            stopped: None,
        };
        assert_eq!(report.to_string(), "attempts=3 key=k-1 replayed=true waited=0.412s");
        let keyless = RetryReport { key: None, ..report };
        assert!(keyless.to_string().contains("key=none"));
    }
}
