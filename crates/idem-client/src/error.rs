//! The errors of the middleware. They travel inside `reqwest_middleware::Error::Middleware`; read
//! them back with [`ErrorExt::retry_error`](crate::ErrorExt::retry_error).

use std::time::Duration;

use http::StatusCode;

use crate::report::{RetryReport, StopReason, human};

/// Why a request sent through [`IdempotencyMiddleware`](crate::IdempotencyMiddleware) ended
/// without an answer to hand back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RetryError {
    /// The body is a stream, which cannot be sent a second time, and retries are allowed. Nothing
    /// was sent.
    #[error(
        "the body of {method} {url} is a stream, which cannot be sent again for a retry; nothing was sent. \
         Buffer the body (for example `Body::from(bytes)`), or allow this request no retries with the \
         `MaxRetries(0)` request extension"
    )]
    BodyNotReplayable {
        /// The request's method.
        method: http::Method,
        /// The request's URL.
        url: String,
    },

    /// The server asked to be retried later (`Retry-After`) than the deadline allows, so the
    /// middleware stopped at once instead of waiting in vain.
    #[error("{}", beyond_deadline(.status, .retry_after, .capped, .left, .deadline, .report))]
    RetryAfterBeyondDeadline {
        /// The status of the last answer.
        status: StatusCode,
        /// The wait the server asked for.
        retry_after: Duration,
        /// That wait after the middleware's Retry-After cap: the one compared with `left`.
        capped: Duration,
        /// What was left of the deadline.
        left: Duration,
        /// The deadline.
        deadline: Duration,
        /// The attempts made.
        report: RetryReport,
    },

    /// The deadline passed while an attempt was waiting for its answer.
    #[error(
        "the deadline of {} passed during attempt {} (no answer yet)",
        human(*.deadline),
        .report.attempts
    )]
    DeadlineExceeded {
        /// The deadline.
        deadline: Duration,
        /// The attempts made, the interrupted one included.
        report: RetryReport,
    },

    /// The last attempt got no answer and the middleware stopped retrying.
    #[error("no answer after {} attempt(s): {reason}", .report.attempts)]
    GaveUp {
        /// Why there was no further retry.
        reason: StopReason,
        /// The attempts made.
        report: RetryReport,
        /// The last attempt's error.
        #[source]
        source: reqwest_middleware::Error,
    },
}

fn beyond_deadline(
    status: &StatusCode,
    retry_after: &Duration,
    capped: &Duration,
    left: &Duration,
    deadline: &Duration,
    report: &RetryReport,
) -> String {
    let asked = if capped < retry_after {
        format!("{} (capped at {})", human(*retry_after), human(*capped))
    } else {
        human(*retry_after).to_string()
    };
    format!(
        "gave up after {} attempt(s): the server answered {status} with Retry-After {asked}, more than the {} left of the {} deadline",
        report.attempts,
        human(*left),
        human(*deadline),
    )
}

impl RetryError {
    /// The attempts made, when any were.
    pub fn report(&self) -> Option<&RetryReport> {
        match self {
            Self::BodyNotReplayable { .. } => None,
            Self::RetryAfterBeyondDeadline { report, .. }
            | Self::DeadlineExceeded { report, .. }
            | Self::GaveUp { report, .. } => Some(report),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> RetryReport {
        RetryReport {
            attempts: 1,
            key: None,
            replayed: false,
            waited: Duration::ZERO,
            elapsed: Duration::ZERO,
            stopped: None,
        }
    }

    #[test]
    fn the_deadline_message_names_the_wait_and_what_is_left() {
        let err = RetryError::RetryAfterBeyondDeadline {
            status: StatusCode::SERVICE_UNAVAILABLE,
            retry_after: Duration::from_secs(3600),
            capped: Duration::from_secs(30),
            left: Duration::from_micros(4_998_700),
            deadline: Duration::from_secs(5),
            report: report(),
        };
        assert_eq!(
            err.to_string(),
            "gave up after 1 attempt(s): the server answered 503 Service Unavailable with Retry-After 1h \
             (capped at 30s), more than the 4s 998ms left of the 5s deadline"
        );
    }
}
