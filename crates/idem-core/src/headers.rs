//! The protocol's header names, shared by the server half and by clients.

use http::HeaderName;

/// The default key header.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header that marks a replayed answer.
pub const IDEMPOTENCY_REPLAYED: HeaderName = HeaderName::from_static("idempotency-replayed");

/// The header that marks a replay whose body was not kept (`Idempotency-Replay: omitted`): the
/// answer was over `max-stored-body`, so an empty replay body does not mean an empty answer.
pub const IDEMPOTENCY_REPLAY: HeaderName = HeaderName::from_static("idempotency-replay");

/// The header that tells a handler (or the gateway's upstream) that an earlier run of this key may
/// have had effects: check before acting again.
pub const IDEMPOTENCY_RECOVERED: HeaderName = HeaderName::from_static("idempotency-recovered");

/// The header that carries a run's completion token to the gateway's upstream, on a PostgreSQL
/// store: the upstream passes it to `idem_complete(token, status, headers, body)` inside its own
/// transaction ([`InTransaction::completion_token`](crate::protocol::InTransaction::completion_token)).
/// The gateway removes any a client sends.
pub const IDEMPOTENCY_TOKEN: HeaderName = HeaderName::from_static("idempotency-token");
