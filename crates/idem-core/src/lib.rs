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

mod canonical_json;
mod codec;
mod coding;
mod fingerprint;
mod key;
mod policy;
mod problem;
mod protocol;
mod response;
mod run;
mod scope;
mod store;
mod store_clock;
pub mod stored;
mod time;

#[cfg(feature = "testkit")]
pub mod testkit;

pub use coding::AcceptEncoding;
pub use fingerprint::{Differences, Fingerprint, FingerprintDecodeError};
pub use key::{IdempotencyKey, KeyError, KeyTimeFormats, KeyTimeFormatsError, MAX_KEY_LEN};
pub use policy::{
    AnonymousPolicy, AnonymousPolicyError, IDEMPOTENCY_KEY, MissingKeyPolicy, MissingKeyPolicyError, Policy,
    PolicyError,
};
pub use problem::{Problem, ProblemKind};
pub use protocol::{Admission, Claim, Decision, Disposition, Keyed, Outcome, Protocol};
pub use response::{HOP_BY_HOP, HeaderAllowList, REPLAY, REPLAYED, ResponseDecodeError, StoredResponse};
pub use run::{MAX_PENDING_BYTES, PendingAnswer, RunTimedOut, Unstored};
pub use scope::{Scope, ScopeError, ScopeSource, ScopeSourceError};
pub use store::{
    Begin, BeginRequest, Completion, FencingToken, Purged, Record, RecordId, RecordState, Release, Store, StoreError,
    WaitOutcome,
};
pub use store_clock::{RESYNC_EVERY, StoreClock};
pub use time::{Clock, ManualClock, SystemClock, UnixMillis};
