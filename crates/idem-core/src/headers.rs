//! The protocol's header names, shared by the server half and by clients.

use http::HeaderName;

/// The default key header.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header that marks a replayed answer.
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotency-replayed");

/// The header that marks a replay whose body was not kept (`Idempotency-Replay: omitted`): the
/// answer was over `max-stored-body`, so an empty replay body does not mean an empty answer.
pub const REPLAY: HeaderName = HeaderName::from_static("idempotency-replay");
