//! The idempotency protocol of idem: keys, scopes, fingerprints, policies, routes, the record
//! state machine, the [`Store`] trait and RFC 9457 problem responses.
//!
//! The root holds what a user configures and sees: keys and header names, [`Policy`] and
//! [`Routes`], scopes, fingerprints, problems, sealing keys. Two modules hold the rest:
//!
//! * [`store`]: the [`Store`] trait and its types, for store authors, with what the stores share
//!   ([`store::backend`]) and the store's clock;
//! * [`protocol`]: the engine that decides every outcome ([`protocol::Protocol`]), for the tower
//!   layer and the gateway.
//!
//! With the `testkit` feature this crate also carries the conformance suite that every store must
//! pass. The design, with the function that decides each row of the outcome table, is
//! `docs/design.md` in the repository.
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
mod policy;
#[cfg(feature = "server")]
pub mod protocol;
#[cfg(feature = "server")]
mod redact;
#[cfg(feature = "server")]
pub mod replay_cache;
#[cfg(feature = "server")]
mod response;
#[cfg(feature = "server")]
mod route;
#[cfg(feature = "server")]
mod scope;
#[cfg(feature = "server")]
pub mod seal;
#[cfg(feature = "server")]
pub mod spans;
#[cfg(feature = "server")]
pub mod store;
pub mod trace_context;

#[cfg(feature = "testkit")]
pub mod testkit;

pub use headers::{
    IDEMPOTENCY_KEY, IDEMPOTENCY_RECOVERED, IDEMPOTENCY_REPLAY, IDEMPOTENCY_REPLAYED, IDEMPOTENCY_TOKEN,
};
pub use key::{IdempotencyKey, KeyError, KeyTimeFormats, KeyTimeFormatsError, MAX_KEY_LEN};
pub use problem::{Problem, ProblemKind};
pub use time::{Clock, ManualClock, SystemClock, UnixMillis};

#[cfg(feature = "server")]
pub use credential::{MIN_SECRET_LEN, ScopeSecret, ScopeSecretError, ScopeSecrets};
#[cfg(feature = "server")]
pub use fingerprint::{Differences, Fingerprint, FingerprintDecodeError};
#[cfg(feature = "server")]
pub use policy::{AnonymousPolicy, AnonymousPolicyError, MissingKeyPolicy, MissingKeyPolicyError, Policy, PolicyError};
#[cfg(feature = "server")]
pub use redact::{redact_url, redact_urls_in, url_userinfo_end};
#[cfg(feature = "server")]
pub use response::{HOP_BY_HOP, HeaderAllowList, ResponseDecodeError, StoredResponse};
#[cfg(feature = "server")]
pub use route::{
    PathAmbiguous, PathReadings, PathReadingsError, Route, RouteError, RoutePattern, RoutePatternError, RouteRule,
    Routes,
};
#[cfg(feature = "server")]
pub use scope::{Scope, ScopeError, ScopeSource, ScopeSourceError};
#[cfg(feature = "server")]
pub use seal::{Keyring, KeyringError, Unreadable};
#[cfg(feature = "server")]
pub use store::{Store, StoreError};
