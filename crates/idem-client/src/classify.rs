//! Which answers and errors are worth a retry. The middleware asks a [`RetryClassifier`]; whether
//! a retry is *safe* (the request has a key, or its method is idempotent) is decided by the
//! middleware itself and cannot be overridden here.

use http::{HeaderMap, StatusCode};
use idem_core::ProblemKind;

/// Whether a condition is worth another attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Retryable {
    /// Likely to pass: another attempt may get a different answer.
    Transient,
    /// Final: another attempt would get the same answer (or this one is a success).
    Fatal,
}

/// One attempt's answer, as a [`RetryClassifier`] sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ResponseInfo<'a> {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// The `type` of an RFC 9457 `application/problem+json` error body, when there is one
    /// (such as `urn:idem:problem:key-in-flight`).
    pub problem_type: Option<&'a str>,
}

impl<'a> ResponseInfo<'a> {
    /// The view of an answer.
    pub fn new(status: StatusCode, headers: &'a HeaderMap, problem_type: Option<&'a str>) -> Self {
        Self {
            status,
            headers,
            problem_type,
        }
    }

    /// The problem's name: the last path segment or URN part of its `type`
    /// (`key-in-flight` for `urn:idem:problem:key-in-flight` or `https://…/problems/key-in-flight`).
    pub fn problem_name(&self) -> Option<&'a str> {
        self.problem_type
            .map(|uri| uri.trim_end_matches('/'))
            .and_then(|uri| uri.rsplit([':', '/']).next())
            .filter(|name| !name.is_empty())
    }
}

/// Decides which answers and errors are transient. Implement it to change the retry table;
/// [`DefaultClassifier`] is the retry table of the design (docs/design.md).
pub trait RetryClassifier: Send + Sync + 'static {
    /// Whether an answer is worth another attempt.
    fn classify_response(&self, response: &ResponseInfo<'_>) -> Retryable;

    /// Whether an attempt that got no answer is worth another attempt.
    fn classify_error(&self, error: &reqwest_middleware::Error) -> Retryable;
}

/// The retry table of the design (docs/design.md, "The client").
///
/// | outcome | retried | why |
/// |---|---|---|
/// | no answer: connect error, reset, timeout, an answer cut off | yes | nothing or an unknown part was done; the key makes a repeat safe |
/// | 500, 502, 503, 504 | yes | the server or a gateway failed; idem does not store 5xx, so the retry runs again |
/// | 500 `answer-unreadable` | no | the request was processed and its stored answer cannot be read: every repeat gets this |
/// | 408, 429 | yes | the server asked for the request again (later) |
/// | 409 `key-in-flight` | yes | the first copy is still running; the retry waits for it or gets its stored answer |
/// | other 409, 400, 401, 403, 404, 422, other 4xx | no | the request itself is wrong: a repeat gets the same answer |
/// | 1xx, 2xx, 3xx, other 5xx | no | an answer (or not a transient failure) |
/// | a builder or redirect error, an error of another middleware | no | a repeat would fail the same way |
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DefaultClassifier;

impl RetryClassifier for DefaultClassifier {
    fn classify_response(&self, response: &ResponseInfo<'_>) -> Retryable {
        match response.status.as_u16() {
            500 if response.problem_name() == Some(ProblemKind::AnswerUnreadable.name()) => Retryable::Fatal,
            408 | 429 | 500 | 502 | 503 | 504 => Retryable::Transient,
            409 if response.problem_name() == Some(ProblemKind::KeyInFlight.name()) => Retryable::Transient,
            _ => Retryable::Fatal,
        }
    }

    fn classify_error(&self, error: &reqwest_middleware::Error) -> Retryable {
        match error {
            // A body error here is an answer cut off while its problem type was being read: the
            // request bodies this middleware sends are buffered and cannot fail.
            reqwest_middleware::Error::Reqwest(err)
                if err.is_connect() || err.is_timeout() || err.is_request() || err.is_body() =>
            {
                Retryable::Transient
            }
            _ => Retryable::Fatal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classify(status: u16, problem_type: Option<&str>) -> Retryable {
        let headers = HeaderMap::new();
        let status = StatusCode::from_u16(status).unwrap();
        DefaultClassifier.classify_response(&ResponseInfo::new(status, &headers, problem_type))
    }

    #[test]
    fn the_retry_table() {
        for status in [408, 429, 500, 502, 503, 504] {
            assert_eq!(classify(status, None), Retryable::Transient, "{status}");
        }
        for status in [
            200, 201, 204, 301, 304, 400, 401, 403, 404, 409, 410, 413, 422, 501, 505,
        ] {
            assert_eq!(classify(status, None), Retryable::Fatal, "{status}");
        }
    }

    #[test]
    fn only_the_key_in_flight_conflict_is_retried() {
        for (status, problem_type, expected) in [
            (409, "urn:idem:problem:key-in-flight", Retryable::Transient),
            (409, "https://example.com/problems/key-in-flight/", Retryable::Transient),
            (409, "urn:idem:problem:key-mismatch", Retryable::Fatal),
            // A processed request whose stored answer cannot be read: every repeat gets the same.
            (500, "urn:idem:problem:answer-unreadable", Retryable::Fatal),
            (500, "urn:idem:problem:internal-error", Retryable::Transient),
            (409, "about:blank", Retryable::Fatal),
            (422, "urn:idem:problem:key-in-flight", Retryable::Fatal),
        ] {
            assert_eq!(
                classify(status, Some(problem_type)),
                expected,
                "{status} {problem_type}"
            );
        }
    }

    #[test]
    fn problem_names() {
        let headers = HeaderMap::new();
        let name = |t| ResponseInfo::new(StatusCode::CONFLICT, &headers, Some(t)).problem_name();
        assert_eq!(name("urn:idem:problem:key-expired"), Some("key-expired"));
        assert_eq!(name("key-expired"), Some("key-expired"));
        assert_eq!(name("https://x/"), Some("x"));
        assert_eq!(name(""), None);
    }
}
