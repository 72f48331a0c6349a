//! Admission: from a request's head alone, whether the protocol applies, and if it does, the key,
//! the caller and what the client accepts — or the problem that refuses it before anything runs.
//! Its first step, [`Protocol::admit_path`], reads the path alone, before any route is picked.

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderMap, HeaderValue};

use super::{Outcome, Protocol};
use crate::content_coding::AcceptEncoding;
use crate::key::{IdempotencyKey, KeyError};
use crate::policy::{AnonymousPolicy, MissingKeyPolicy};
use crate::problem::{Problem, ProblemKind};
use crate::route::climbs_above_root;
use crate::scope::{Caller, Scope, ScopeSource};
use crate::store::Origin;
use crate::trace_context::RunTrace;

/// How a request enters the protocol.
#[derive(Debug)]
pub enum Admission {
    /// Not subject to the protocol: pass it on, adding `headers` to the answer.
    PassThrough {
        /// Headers for the answer (`Deprecation`/`Sunset` in a grace period).
        headers: HeaderMap,
    },
    /// Keyed: buffer the body (up to `max_body`), fingerprint it and call [`Protocol::begin`].
    Keyed(Keyed),
    /// Refused before anything ran.
    Refuse(Problem, Outcome),
}

/// A request that the protocol applies to.
#[derive(Debug, Clone)]
pub struct Keyed {
    pub(super) caller: Caller,
    pub(super) key: KeySource,
    /// What this request's client accepts: a replay is decoded for it when needed.
    pub(super) accept: AcceptEncoding,
    /// What the record keeps about the request, read into an [`Origin`] only when a claim is
    /// asked of the store (a replay the replay cache answers needs none).
    pub(super) request: Box<RequestLine>,
}

/// What a record keeps of a keyed request, as it came (cheap to keep: the method and URI are
/// shared, not copied).
#[derive(Debug, Clone)]
pub(super) struct RequestLine {
    method: http::Method,
    uri: http::Uri,
    trace: Option<RunTrace>,
}

impl RequestLine {
    /// The request's [`Origin`], its path read and cut as records keep it.
    pub(super) fn origin(&self) -> Arc<Origin> {
        Arc::new(Origin::new(self.method.as_str(), self.uri.path(), self.trace))
    }
}

#[derive(Debug, Clone)]
pub(super) enum KeySource {
    Client(IdempotencyKey),
    /// A keyless request under `fingerprint:<window>`: the key is derived from the fingerprint.
    Provisional(Duration),
}

impl Keyed {
    /// Where the request's run sits in its trace, as its record will keep it: the
    /// `traceparent`'s trace and parent ids if it has a valid one, unless
    /// [`set_trace`](Self::set_trace) named the span of idem's own.
    pub fn trace(&self) -> Option<RunTrace> {
        self.request.trace
    }

    /// Names the span idem exports for this request as the run's ([`trace`](Self::trace)): its
    /// record keeps it, and a replay of the record links to it.
    pub fn set_trace(&mut self, trace: RunTrace) {
        self.request.trace = Some(trace);
    }

    /// The caller's scope, if known before [`Protocol::begin`]: a credential's is hashed there,
    /// with the store's salt.
    pub fn scope(&self) -> Option<&Scope> {
        self.caller.scope()
    }

    /// The client's key; `None` for a provisional key derived from the fingerprint.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        match &self.key {
            KeySource::Client(key) => Some(key),
            KeySource::Provisional(_) => None,
        }
    }
}

impl Protocol {
    /// Admission's first step, for every request whatever its method and before its route is
    /// picked (a route passed through included): under a path prefix
    /// ([`with_path_prefix`](Self::with_path_prefix)), a path that some reading climbs out of
    /// (`/../admin` under `/api`, in any spelling of `..`: `%2e%2e`, `a%2F..%2F..`, `..;x`) is
    /// refused with `400 path-ambiguous` ([`Outcome::PathAmbiguous`]): the service behind the
    /// prefix, if it normalises the path, would read it as one outside the prefix. Nothing is
    /// claimed or run. Every other path, and every path at the root, is admitted.
    pub fn admit_path(&self, path: &str) -> Result<(), Problem> {
        match &self.inner.path_prefix {
            Some(prefix) => refuse_climb(prefix, path),
            None => Ok(()),
        }
    }

    /// Decides from the request head whether the protocol applies, once its path is admitted
    /// ([`admit_path`](Self::admit_path)) and its route picked.
    pub fn admit(&self, parts: &Parts) -> Admission {
        let policy = &self.inner.policy;
        if !policy.applies_to(&parts.method) {
            return Admission::PassThrough {
                headers: HeaderMap::new(),
            };
        }
        let key = match IdempotencyKey::from_headers(parts.headers.get_all(&policy.key_header)) {
            Ok(Some(key)) => KeySource::Client(key),
            Ok(None) => match self.admit_keyless() {
                Ok(window) => KeySource::Provisional(window),
                Err(admission) => return admission,
            },
            Err(err) => return Admission::Refuse(self.invalid_key(&err), Outcome::Invalid),
        };
        // The scope is needed only once the request is keyed: a keyless request passes through
        // whatever its headers say.
        let caller = match policy.scope.caller_of(parts) {
            Ok(caller) => caller,
            Err(err) => {
                let detail = format!("{err}: the caller's scope is taken from it. The request was not processed.");
                return Admission::Refuse(Problem::new(ProblemKind::ScopeInvalid, detail), Outcome::ScopeInvalid);
            }
        };
        if matches!(key, KeySource::Provisional(_)) && caller.is_anonymous() {
            // A provisional key is (scope, fingerprint): in the anonymous scope it would hand one
            // person's answer to another who happens to post the same body. Passed through as
            // under `allow`, the request is at worst run twice, as it would be without idem.
            tracing::debug!(
                "keyless request from an anonymous caller passed through: no provisional key spans two callers"
            );
            return Admission::PassThrough {
                headers: HeaderMap::new(),
            };
        }
        if caller.is_anonymous() && policy.anonymous == AnonymousPolicy::Reject {
            let detail = format!(
                "this endpoint keeps stored answers per caller and this request names none ({}); send it with your credential. The request was not processed.",
                self.identity()
            );
            return Admission::Refuse(
                Problem::new(ProblemKind::CredentialMissing, detail),
                Outcome::CredentialMissing,
            );
        }
        Admission::Keyed(Keyed {
            caller,
            key,
            accept: AcceptEncoding::from_headers(&parts.headers),
            // Boxed: an `Admission` is returned by value, and a URI is large.
            request: Box::new(RequestLine {
                method: parts.method.clone(),
                uri: parts.uri.clone(),
                trace: RunTrace::from_headers(&parts.headers),
            }),
        })
    }

    /// What identifies a caller under this policy, for messages.
    fn identity(&self) -> String {
        match &self.inner.policy.scope {
            ScopeSource::Credential => "no Authorization header".to_owned(),
            ScopeSource::Header(name) => format!("no {name} header"),
            ScopeSource::Extension => "no scope from the application's authentication".to_owned(),
            ScopeSource::None => "every caller shares one scope".to_owned(),
        }
    }

    fn invalid_key(&self, err: &KeyError) -> Problem {
        Problem::new(
            ProblemKind::KeyInvalid,
            format!("{err}. The request was not processed."),
        )
    }

    /// A keyless request: the provisional window under `fingerprint:<window>`, else how it is
    /// passed through or refused.
    fn admit_keyless(&self) -> Result<Duration, Admission> {
        let header = &self.inner.policy.key_header;
        let required = || {
            let detail = format!(
                "this endpoint requires an {header} header; send a unique key (a UUIDv7 is a good choice) and reuse it on every retry of the same request"
            );
            Err(Admission::Refuse(
                Problem::new(ProblemKind::KeyMissing, detail),
                Outcome::Missing,
            ))
        };
        match self.inner.policy.missing_key {
            MissingKeyPolicy::Allow => Err(Admission::PassThrough {
                headers: HeaderMap::new(),
            }),
            MissingKeyPolicy::Require => required(),
            MissingKeyPolicy::Grace { until } if self.now() >= until => required(),
            MissingKeyPolicy::Grace { until } => {
                tracing::warn!(sunset = %until, "keyless request accepted during the grace period; keys become required at the sunset");
                let mut headers = HeaderMap::new();
                headers.insert("deprecation", HeaderValue::from_static("true"));
                let sunset = httpdate::fmt_http_date(until.to_system_time());
                headers.insert(
                    "sunset",
                    HeaderValue::from_str(&sunset).expect("an HTTP date is a valid header value"),
                );
                Err(Admission::PassThrough { headers })
            }
            MissingKeyPolicy::Fingerprint { window } => Ok(window),
        }
    }
}

/// `400 path-ambiguous` for a `path` that climbs out of `prefix` in some reading
/// ([`climbs_above_root`]), the detail naming both.
fn refuse_climb(prefix: &str, path: &str) -> Result<(), Problem> {
    if !climbs_above_root(path) {
        return Ok(());
    }
    let detail = format!(
        "the path {path} has a `..` segment (as sent, percent-encoded or with ;parameters) that climbs above the root: this service is reached under the path prefix {prefix}, and a server that normalises the path would read it as one outside that prefix. Send the path without it. The request was not processed."
    );
    Err(Problem::new(ProblemKind::PathAmbiguous, detail))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under `/api`: each path, and whether it climbs out (the spellings of `..` themselves are
    /// `climbs_above_root`'s tests).
    #[test]
    fn a_path_that_climbs_out_of_the_prefix_is_refused_as_ambiguous() {
        let cases = [
            ("/../admin", true),
            ("/%2e%2e/admin", true),
            ("/a/..%2F..%2Fadmin", true),
            ("/..;x/admin", true),
            ("/a/../pay", false),
            ("/pay", false),
            ("*", false),
        ];
        for (path, climbs) in cases {
            match refuse_climb("/api", path) {
                Ok(()) => assert!(!climbs, "{path} climbs out of /api, yet was admitted"),
                Err(refused) => {
                    assert!(climbs, "{path} stays inside /api, yet was refused: {refused:?}");
                    assert_eq!(refused.kind, ProblemKind::PathAmbiguous, "{path}");
                    assert_eq!(refused.kind.status(), http::StatusCode::BAD_REQUEST, "{path}");
                    assert!(
                        refused.detail.contains(path) && refused.detail.contains("/api"),
                        "{path}: the detail names the path and the prefix: {}",
                        refused.detail
                    );
                }
            }
        }
    }
}
