//! RFC 9457 problem responses. Every refusal idem makes is one of these, with a stable `type`
//! whose last URN part names the case (`key-mismatch`, …).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde::Serialize;

/// The cases idem answers with a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProblemKind {
    /// The key header is malformed, repeated or a list.
    KeyInvalid,
    /// The header the scope comes from is repeated, so who the caller is cannot be told.
    ScopeInvalid,
    /// The caller presented no credential and anonymous keyed requests are refused
    /// (`--anonymous reject`).
    CredentialMissing,
    /// The route requires a key and none was sent.
    KeyMissing,
    /// The key was used for a different request.
    KeyMismatch,
    /// The first request with this key is still running.
    KeyInFlight,
    /// The key's stored answer has expired.
    KeyExpired,
    /// The store cannot be reached; nothing was run.
    StoreUnavailable,
    /// The keyed request's body is over the limit.
    BodyTooLarge,
    /// The request's path reads as two paths under different protecting rules (as sent, and
    /// decoded and normalised as many servers read it): neither is applied, nothing runs.
    PathAmbiguous,
    /// The request's body broke off or could not be read; nothing was claimed or run.
    BodyIncomplete,
    /// Something failed inside idem itself (a bug); the answer says so instead of closing the
    /// connection.
    Internal,
    /// The upstream could not be reached; nothing was sent.
    UpstreamUnavailable,
    /// The connection to the upstream was lost after the request was sent.
    UpstreamFailed,
    /// The upstream did not answer in time; it is still being waited for.
    UpstreamTimeout,
    /// The key's stored answer cannot be read (sealed under a key not configured, or damaged), or
    /// the store holds data about the key that it cannot read (a corrupt record); the request is
    /// not run again.
    AnswerUnreadable,
    /// The request's head (request line and headers) is over the gateway's limit; nothing was
    /// claimed or sent.
    HeadTooLarge,
}

impl ProblemKind {
    /// The stable name, the last part of the `type` URN.
    pub fn name(self) -> &'static str {
        match self {
            Self::KeyInvalid => "key-invalid",
            Self::ScopeInvalid => "scope-invalid",
            Self::CredentialMissing => "credential-missing",
            Self::KeyMissing => "key-missing",
            Self::KeyMismatch => "key-mismatch",
            Self::KeyInFlight => "key-in-flight",
            Self::KeyExpired => "key-expired",
            Self::StoreUnavailable => "store-unavailable",
            Self::BodyTooLarge => "body-too-large",
            Self::BodyIncomplete => "body-incomplete",
            Self::PathAmbiguous => "path-ambiguous",
            Self::Internal => "internal-error",
            Self::UpstreamUnavailable => "upstream-unavailable",
            Self::UpstreamFailed => "upstream-failed",
            Self::UpstreamTimeout => "upstream-timeout",
            Self::AnswerUnreadable => "answer-unreadable",
            Self::HeadTooLarge => "head-too-large",
        }
    }

    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            Self::KeyInvalid | Self::KeyMissing | Self::ScopeInvalid | Self::BodyIncomplete | Self::PathAmbiguous => {
                StatusCode::BAD_REQUEST
            }
            Self::CredentialMissing => StatusCode::UNAUTHORIZED,
            Self::Internal | Self::AnswerUnreadable => StatusCode::INTERNAL_SERVER_ERROR,
            Self::KeyMismatch | Self::KeyExpired => StatusCode::UNPROCESSABLE_ENTITY,
            Self::KeyInFlight => StatusCode::CONFLICT,
            Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UpstreamUnavailable | Self::UpstreamFailed => StatusCode::BAD_GATEWAY,
            Self::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Self::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        }
    }

    /// A short, fixed summary.
    pub fn title(self) -> &'static str {
        match self {
            Self::KeyInvalid => "Invalid idempotency key",
            Self::ScopeInvalid => "Ambiguous caller identity",
            Self::CredentialMissing => "Credential required for idempotent requests",
            Self::KeyMissing => "Idempotency key required",
            Self::KeyMismatch => "Idempotency key reused for a different request",
            Self::KeyInFlight => "Request with this idempotency key is in progress",
            Self::KeyExpired => "Idempotency key expired",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::BodyTooLarge => "Request body too large",
            Self::BodyIncomplete => "Request body incomplete",
            Self::PathAmbiguous => "Ambiguous request path",
            Self::Internal => "Internal error",
            Self::UpstreamUnavailable => "Upstream unavailable",
            Self::UpstreamFailed => "Upstream connection lost",
            Self::UpstreamTimeout => "Upstream timed out",
            Self::AnswerUnreadable => "Stored answer unreadable",
            Self::HeadTooLarge => "Request head too large",
        }
    }

    /// The `type` URI.
    pub fn type_uri(self) -> String {
        format!("urn:idem:problem:{}", self.name())
    }
}

/// One problem response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Which case.
    pub kind: ProblemKind,
    /// What the client can do about it.
    pub detail: String,
    /// Sent as `Retry-After` (whole seconds, at least one).
    pub retry_after: Option<Duration>,
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    type_uri: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
}

impl Problem {
    /// A problem with a detail.
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Adds `Retry-After`.
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The `application/problem+json` response.
    pub fn to_response(&self) -> Response<Bytes> {
        let body = Body {
            type_uri: self.kind.type_uri(),
            title: self.kind.title(),
            status: self.kind.status().as_u16(),
            detail: &self.detail,
        };
        let json = serde_json::to_vec(&body).expect("a problem always serialises");
        let mut response = Response::new(Bytes::from(json));
        *response.status_mut() = self.kind.status();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = self.retry_after {
            let secs = after.as_secs_f64().ceil().max(1.0) as u64;
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_rfc9457_json() {
        let response = Problem::new(ProblemKind::KeyInFlight, "wait")
            .retry_after(Duration::from_millis(1500))
            .to_response();
        assert_eq!(response.status(), 409);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/problem+json");
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        let json: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(json["type"], "urn:idem:problem:key-in-flight");
        assert_eq!(json["status"], 409);
        assert_eq!(json["detail"], "wait");
        assert!(json["title"].as_str().is_some_and(|t| !t.is_empty()));
    }
}
