//! The idempotency protocol of idem: keys, scopes, fingerprints, policies, the record state
//! machine, the [`Store`] trait and RFC 9457 problem responses.
//!
//! The protocol is decided here, in [`Protocol`]; stores only provide atomic primitives, and the
//! tower layer and the gateway only move bytes and call the protocol. With the `testkit` feature
//! this crate also carries the conformance suite that every store must pass.
//!
//! ```
//! use idem_core::{Fingerprint, IdempotencyKey};
//! use http::{HeaderMap, Method};
//!
//! let key = IdempotencyKey::from_header_value(&"\"8e03978e-40d5-43e8-bc93-6894a57f9324\"".parse()?)?;
//! assert_eq!(key.as_str(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
//!
//! let mut headers = HeaderMap::new();
//! headers.insert("content-type", "application/json".parse()?);
//! let a = Fingerprint::of(&Method::POST, &"/pay".parse()?, &headers, br#"{"amount":10,"currency":"EUR"}"#);
//! let b = Fingerprint::of(&Method::POST, &"/pay".parse()?, &headers, br#"{ "currency": "EUR", "amount": 10 }"#);
//! assert_eq!(a, b); // key order and whitespace of a JSON body do not count
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

// What a client needs too: keys, header names, problem kinds, time.
mod headers;
mod key;
mod problem;
mod time;

// The server half (feature `server`, on by default): the protocol, fingerprints, stored answers
// and the store interface. A client (`idem-client`) builds without it.
#[cfg(feature = "server")]
mod canonical_json;
#[cfg(feature = "server")]
mod content_coding;
#[cfg(feature = "server")]
mod credential;
#[cfg(feature = "server")]
mod fingerprint;
#[cfg(feature = "server")]
mod length_prefixed;
#[cfg(feature = "server")]
pub mod metric_names;
#[cfg(feature = "server")]
mod observed;
#[cfg(feature = "server")]
mod policy;
#[cfg(feature = "server")]
mod protocol;
#[cfg(feature = "server")]
mod redact;
#[cfg(feature = "server")]
mod replay_counts;
#[cfg(feature = "server")]
mod response;
#[cfg(feature = "server")]
mod route;
#[cfg(feature = "server")]
mod scope;
#[cfg(feature = "server")]
pub mod seal;
#[cfg(feature = "server")]
mod store;
#[cfg(feature = "server")]
mod store_clock;
#[cfg(feature = "server")]
pub mod stored;

#[cfg(feature = "testkit")]
pub mod testkit;

pub use headers::{IDEMPOTENCY_KEY, IDEMPOTENCY_RECOVERED, IDEMPOTENCY_REPLAY, IDEMPOTENCY_REPLAYED};
pub use key::{IdempotencyKey, KeyError, KeyTimeFormats, KeyTimeFormatsError, MAX_KEY_LEN};
pub use problem::{Problem, ProblemKind};
pub use time::{Clock, ManualClock, SystemClock, UnixMillis};

#[cfg(feature = "server")]
pub use content_coding::AcceptEncoding;
#[cfg(feature = "server")]
pub use credential::{CredentialScopes, MIN_SECRET_LEN, ScopeHashing, ScopeSecret, ScopeSecretError, ScopeSecrets};
#[cfg(feature = "server")]
pub use fingerprint::{Differences, Fingerprint, FingerprintDecodeError};
#[cfg(feature = "server")]
pub use observed::{Observed, Observer, StoreOperation};
#[cfg(feature = "server")]
pub use policy::{AnonymousPolicy, AnonymousPolicyError, MissingKeyPolicy, MissingKeyPolicyError, Policy, PolicyError};
#[cfg(feature = "server")]
pub use protocol::{
    Admission, Claim, Decision, IdempotencyInfo, Keep, Keyed, MAX_PENDING_BYTES, NoAnswer, Outcome, PendingAnswer,
    Protocol, Reply, RunEnd, RunTimedOut, Settlement, Unstored, body_incomplete, internal_error, no_answer_problem,
};
#[cfg(feature = "server")]
pub use redact::redact_url;
#[cfg(feature = "server")]
pub use response::{HOP_BY_HOP, HeaderAllowList, ResponseDecodeError, StoredResponse};
#[cfg(feature = "server")]
pub use route::{
    PathAmbiguous, PathReadings, PathReadingsError, Route, RouteError, RoutePattern, RoutePatternError, RouteRule,
    Routes,
};
#[cfg(feature = "server")]
pub use scope::{Caller, Scope, ScopeError, ScopeSource, ScopeSourceError};
#[cfg(feature = "server")]
pub use seal::{Keyring, KeyringError, Unreadable};
#[cfg(feature = "server")]
pub use store::{
    Begin, BeginRequest, Checkpoint, Completion, FencingToken, Purged, Record, RecordId, RecordState, Release,
    ScopeSalt, Store, StoreError, WaitOutcome,
};
#[cfg(feature = "server")]
pub use store_clock::{RESYNC_EVERY, StoreClock};
