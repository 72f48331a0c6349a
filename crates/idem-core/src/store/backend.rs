//! What the store implementations share: the stored form of a record (its state as a word, its
//! times as integers) checked into a [`Record`], the claim rule ([`StoredRecord::on_begin`]) and
//! its table of cases ([`claim_rule_cases`]), the loop that waits for a claim to change, and
//! [`ReplayCounts`], which keeps a replay from being a write.
//! Stores still do their own atomic primitives; this only keeps them from writing the same
//! decoding and waiting three times.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::time::Instant;

pub use crate::scope::hex;
pub use crate::store::replay_counts::ReplayCounts;
use crate::trace_context::RunTrace;
use crate::{
    Fingerprint, IdempotencyKey, Scope, StoreError, UnixMillis,
    store::{ClaimState, FencingToken, Listed, ListedState, Origin, Record, RecordId, RecordState, WaitOutcome},
};

/// How long an in-flight record made before claims carried their own `purge_at` is kept once its
/// holder vanished (its lease ended and nobody retried); until then a retry takes it over, marked
/// recovered. Only a fallback for such old records: a claim today is kept until the `purge_at`
/// its request gives (the route's `tombstone-ttl`). One rule for every store.
pub const ABANDONED_CLAIM_RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// When the old claim (one without a `purge_at` of its own) of a holder whose lease ends at
/// `lease_until` is deleted if nobody took it over.
pub fn abandoned_purge_at(lease_until: UnixMillis) -> UnixMillis {
    lease_until.plus(ABANDONED_CLAIM_RETENTION)
}

/// The `purge_at` a store keeps for an in-flight claim: the request's, but never before the lease
/// ends, so that purging by `purge_at` alone never deletes a claim whose holder still runs. A
/// renewal moves it to the new lease's end if that is later.
pub fn claim_purge_at(purge_at: UnixMillis, lease_until: UnixMillis) -> UnixMillis {
    purge_at.max(lease_until)
}

/// Whether `taken`, a record that [`Existing::TakeOver`] applies to, is an in-flight claim whose
/// token says its run keeps every effect in the transaction that completes the record
/// ([`FencingToken::in_transaction`]). Such a claim, still in flight, did not complete, so its
/// transaction never committed: unless it recorded checkpoints, nothing of it stands, and the run
/// that takes it over is a new one, unflagged (`recovered: false`). Every other takeover is
/// recovered, a released (unknown) record's always. A store reads whether the record holds
/// checkpoints only when this is true, so that an ordinary takeover costs no read.
pub fn ran_in_transaction(taken: &StoredRecord) -> bool {
    taken.state == IN_FLIGHT
        && taken
            .token
            .as_deref()
            .and_then(|bytes| <[u8; 16]>::try_from(bytes).ok())
            .is_some_and(|bytes| FencingToken::from_bytes(bytes).in_transaction())
}

/// Where a claim stands, from its record's stored `state` and whether the claim's token is the
/// record's (`is_token`: the current claim's when in flight, the completing claim's when completed).
pub fn claim_state(state: &str, is_token: bool) -> ClaimState {
    match (state, is_token) {
        (IN_FLIGHT, true) => ClaimState::Current,
        (COMPLETED, true) => ClaimState::Completed,
        _ => ClaimState::Ended,
    }
}

/// The stored word of [`RecordState::InFlight`].
pub const IN_FLIGHT: &str = "in-flight";
/// The stored word of [`RecordState::Completed`].
pub const COMPLETED: &str = "completed";
/// The stored word of [`RecordState::Unknown`].
pub const UNKNOWN: &str = "unknown";

/// A record's fields as a store keeps them (times in Unix milliseconds), before they are checked.
#[derive(Debug, Clone, Default)]
pub struct StoredRecord {
    /// [`IN_FLIGHT`], [`COMPLETED`] or [`UNKNOWN`].
    pub state: String,
    /// [`Fingerprint::encode`]'s output.
    pub fingerprint: Vec<u8>,
    /// The current claim's token when in flight; the completing claim's when completed (a store
    /// may keep it, for [`Store::claim_state`](crate::Store::claim_state)).
    pub token: Option<Vec<u8>>,
    /// The end of the current lease (in flight only).
    pub lease_until: Option<i64>,
    /// The encoded answer (completed, until it expires).
    pub response: Option<Vec<u8>>,
    /// When the record was first claimed.
    pub created_at: i64,
    /// When the handler finished (completed only).
    pub completed_at: Option<i64>,
    /// Until when the answer is replayable (completed), or until when the same request may run
    /// again, recovered (in flight, unknown). `None` in an in-flight or unknown record written
    /// before records kept it.
    pub expires_at: Option<i64>,
    /// When the record is deleted (required when completed or unknown).
    pub purge_at: Option<i64>,
    /// How many times the answer was replayed.
    pub replays: i64,
    /// The request's method ([`Origin`]); empty in a record written before records kept it.
    pub method: String,
    /// The request's path ([`Origin`]).
    pub path: String,
    /// The latest run's trace, as [`RunTrace`] writes it: `<trace id>-<span id>`, or a trace id
    /// alone in a record written before records kept the span ([`Origin`]).
    pub trace_id: Option<String>,
    /// Whether the latest run was recovered.
    pub recovered: bool,
    /// The stored answer's status.
    pub status: Option<i64>,
}

/// What [`Store::begin`](crate::Store::begin) does with a record that already exists, by the
/// trait's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Past its `purge_at`: gone in all but storage. Replace it with a new claim.
    Replace,
    /// An in-flight claim whose lease ended, or an unknown outcome, of the same request, before
    /// its `expires_at`: take it over (`recovered: true`).
    TakeOver,
    /// A live answer to the same request: count a replay and return it.
    Replay,
    /// Anything else (a claim whose lease runs, another request's record, a tombstone, a key
    /// expired without an answer): return it unchanged.
    Leave,
}

impl StoredRecord {
    /// The claim rule for this record at `now`; `same_request` says whether the claiming request's
    /// fingerprint digest equals the stored one.
    pub fn on_begin(&self, same_request: bool, now: i64) -> Existing {
        let lease_ended = self.lease_until.is_some_and(|until| until <= now);
        let lease_runs = self.state == IN_FLIGHT && !lease_ended;
        if self.purge_at.is_none_or(|purge_at| purge_at <= now) && !lease_runs {
            return Existing::Replace;
        }
        // Past its ttl a key without an answer is expired, as one with an answer is: never run
        // again. A record written before records kept `expires_at` has none, and is taken over
        // until its `purge_at`, as it was then.
        let expired = self.expires_at.is_some_and(|expires| expires <= now);
        let abandoned = ((self.state == IN_FLIGHT && lease_ended) || self.state == UNKNOWN) && !expired;
        let replayable =
            self.state == COMPLETED && self.response.is_some() && self.expires_at.is_some_and(|expires| now < expires);
        match (same_request, abandoned, replayable) {
            (true, true, _) => Existing::TakeOver,
            (true, false, true) => Existing::Replay,
            _ => Existing::Leave,
        }
    }

    /// Checks the fields and builds the [`Record`]; anything missing or malformed is
    /// [`StoreError::Corrupt`], naming the record.
    pub fn into_record(self, id: RecordId) -> Result<Record, StoreError> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("record {} {}: {what}", id.scope, id.key));
        let fingerprint = Fingerprint::decode(&self.fingerprint).map_err(|_| corrupt("undecodable fingerprint"))?;
        let (origin, status) = (self.origin(), self.status());
        let millis = |value: Option<i64>, field: &str| {
            value
                .map(UnixMillis::from_i64)
                .ok_or_else(|| corrupt(&format!("{} record without {field}", self.state)))
        };
        let state = match self.state.as_str() {
            IN_FLIGHT => {
                let token = self
                    .token
                    .as_deref()
                    .and_then(|bytes| <[u8; 16]>::try_from(bytes).ok())
                    .ok_or_else(|| corrupt("in-flight record without a 16-byte token"))?;
                RecordState::InFlight {
                    token: FencingToken::from_bytes(token),
                    lease_until: millis(self.lease_until, "lease_until")?,
                    expires_at: self.expires_at.map(UnixMillis::from_i64),
                }
            }
            COMPLETED => RecordState::Completed {
                response: self.response.map(Bytes::from),
                completed_at: millis(self.completed_at, "completed_at")?,
                expires_at: millis(self.expires_at, "expires_at")?,
                purge_at: millis(self.purge_at, "purge_at")?,
            },
            UNKNOWN => {
                let purge_at = millis(self.purge_at, "purge_at")?;
                RecordState::Unknown {
                    // A record released before records kept `expires_at` was taken over until
                    // its `purge_at`, which was set to the ttl's end: the same thing.
                    expires_at: self.expires_at.map_or(purge_at, UnixMillis::from_i64),
                    purge_at,
                }
            }
            other => return Err(corrupt(&format!("unknown state {other:?}"))),
        };
        Ok(Record {
            fingerprint,
            created_at: UnixMillis::from_i64(self.created_at),
            replays: u64::try_from(self.replays).map_err(|_| corrupt("negative replay count"))?,
            state,
            origin,
            recovered: self.recovered,
            status,
            id,
        })
    }

    /// The record as [`Store::list`](crate::Store::list) returns it, judged at `now`; `None` if
    /// its stored state is no state at all (a corrupt record, which listing skips: the operator
    /// reads it with `idem inspect`). `has_answer`: whether a completed record still holds its
    /// answer, where the store can tell without reading it.
    pub fn listed(&self, id: RecordId, has_answer: bool, now: UnixMillis) -> Option<Listed> {
        let millis = |value: Option<i64>| value.map(UnixMillis::from_i64);
        let state = ListedState::at(
            &self.state,
            millis(self.expires_at),
            millis(self.purge_at),
            has_answer,
            now,
        )?;
        let created_at = UnixMillis::from_i64(self.created_at);
        let times = [
            Some(("created_at", created_at)),
            millis(self.expires_at).map(|at| ("expires_at", at)),
            millis(self.purge_at).map(|at| ("purge_at", at)),
        ];
        let times: Vec<(&str, UnixMillis)> = times.into_iter().flatten().collect();
        Some(Listed {
            id,
            state,
            origin: self.origin(),
            status: self.status(),
            created_at,
            replays: u64::try_from(self.replays).unwrap_or(0),
            recovered: self.recovered,
            damaged: UnixMillis::past_rfc3339(&times),
        })
    }

    /// The record a SQL store found under the scope and key of its row, as
    /// [`listed`](Self::listed) makes it; why it cannot be listed (its key is no key, its state no
    /// state), naming it, for the warning with which the listing skips it.
    pub fn listed_as(&self, scope: &str, key: &str, has_answer: bool, now: UnixMillis) -> Result<Listed, String> {
        let why = |detail: String| format!("record {scope} {key}: {detail}");
        let id = RecordId {
            scope: Scope::from_stored(scope),
            key: IdempotencyKey::new(key).map_err(|err| why(err.to_string()))?,
        };
        self.listed(id, has_answer, now)
            .ok_or_else(|| why(format!("no state {:?}", self.state)))
    }

    /// What the record keeps about its request. These fields decide nothing, so one that does not
    /// read (a trace id that is not one) is left out rather than making the record corrupt.
    fn origin(&self) -> Origin {
        Origin {
            method: self.method.clone(),
            path: self.path.clone(),
            trace: self.trace_id.as_deref().and_then(RunTrace::from_stored),
        }
    }

    fn status(&self) -> Option<u16> {
        self.status.and_then(|status| u16::try_from(status).ok())
    }
}

/// One row of the claim rule's table: a record as a store keeps it, who claims its key and when,
/// and what [`StoredRecord::on_begin`] decides.
///
/// [`claim_rule_cases`] is the table, written once. idem-core's unit test holds `on_begin` to it,
/// and a store that runs the rule in its own language (the Redis store's `BEGIN` script) holds its
/// copy to the same rows, so the two cannot drift apart.
#[derive(Debug, Clone)]
pub struct ClaimRuleCase {
    /// What the row shows, for failure messages.
    pub why: &'static str,
    /// The record as stored. Well formed, so that a store can write it as it is and read it
    /// back: its fingerprint is [`claim_rule_fingerprint`]'s, an in-flight record has a token and a
    /// lease, a completed one its `completed_at`, and none has been replayed yet.
    pub record: StoredRecord,
    /// Whether the claiming request is the record's own (its fingerprint digest is the stored
    /// one); if not, it is another request under the same key.
    pub same_request: bool,
    /// The claim's `now`, in Unix milliseconds.
    pub now: i64,
    /// What `begin` does with the record.
    pub expected: Existing,
}

/// The fingerprint of every record in [`claim_rule_cases`], for claiming as the same request.
pub fn claim_rule_fingerprint() -> Fingerprint {
    Fingerprint::of(
        &http::Method::POST,
        &http::Uri::from_static("/pay"),
        &http::HeaderMap::new(),
        b"claim rule",
    )
}

/// The claim rule of [`Store::begin`](crate::Store::begin) as a table: every row a record, who
/// claims it and when, and what must happen (see [`ClaimRuleCase`]).
///
/// The records share one timeline: a lease that ends at 100, an answer or a ttl that runs until
/// 200, and deletion at 300 (Unix milliseconds), claimed just before, at or after each of them.
pub fn claim_rule_cases() -> Vec<ClaimRuleCase> {
    let fingerprint = claim_rule_fingerprint().encode();
    let record = |state: &str| {
        let (in_flight, completed) = (state == IN_FLIGHT, state == COMPLETED);
        StoredRecord {
            state: state.to_owned(),
            fingerprint: fingerprint.clone(),
            token: in_flight.then(|| vec![7; 16]),
            lease_until: in_flight.then_some(100),
            response: completed.then(|| b"answer".to_vec()),
            created_at: 0,
            completed_at: completed.then_some(50),
            expires_at: Some(200),
            purge_at: Some(300),
            replays: 0,
            ..StoredRecord::default()
        }
    };
    // Written before records kept `expires_at`.
    let old = |state: &str| StoredRecord {
        expires_at: None,
        ..record(state)
    };
    let tombstone = StoredRecord {
        response: None,
        ..record(COMPLETED)
    };
    let long_run = StoredRecord {
        lease_until: Some(400),
        ..record(IN_FLIGHT)
    };
    let case = |why, record, same_request, now, expected| ClaimRuleCase {
        why,
        record,
        same_request,
        now,
        expected,
    };
    use Existing::{Leave, Replace, Replay, TakeOver};
    vec![
        case("past purge_at, whoever asks", record(IN_FLIGHT), true, 300, Replace),
        case("past purge_at, another request", record(COMPLETED), false, 300, Replace),
        case("an unknown outcome until purge_at", record(UNKNOWN), true, 300, Replace),
        case("the lease ended", record(IN_FLIGHT), true, 100, TakeOver),
        case("the lease still runs", record(IN_FLIGHT), true, 99, Leave),
        case("another request never takes over", record(IN_FLIGHT), false, 150, Leave),
        case(
            "an unknown outcome of the same request",
            record(UNKNOWN),
            true,
            0,
            TakeOver,
        ),
        case(
            "an unknown outcome just before its ttl ends",
            record(UNKNOWN),
            true,
            199,
            TakeOver,
        ),
        case(
            "an unknown outcome of another request",
            record(UNKNOWN),
            false,
            0,
            Leave,
        ),
        case(
            "an unknown outcome past its ttl is a tombstone",
            record(UNKNOWN),
            true,
            200,
            Leave,
        ),
        case(
            "an abandoned claim past its ttl is a tombstone",
            record(IN_FLIGHT),
            true,
            200,
            Leave,
        ),
        case(
            "a live answer to the same request",
            record(COMPLETED),
            true,
            199,
            Replay,
        ),
        case("an expired answer is no replay", record(COMPLETED), true, 200, Leave),
        case("a mismatch is no replay", record(COMPLETED), false, 100, Leave),
        case("a tombstone is no replay", tombstone, true, 100, Leave),
        case(
            "a claim written without expires_at is taken over until purge_at, as before",
            old(IN_FLIGHT),
            true,
            250,
            TakeOver,
        ),
        case(
            "an unknown outcome written without expires_at, likewise",
            old(UNKNOWN),
            true,
            250,
            TakeOver,
        ),
        case(
            "a claim whose lease still runs is never replaced",
            long_run,
            true,
            300,
            Leave,
        ),
    ]
}

/// The waiting loop of [`Store::wait`](crate::Store::wait): until `holds()` says the claim is no
/// longer current, or `deadline`.
///
/// Each round enables a wake-up from `notify` (when the store has notifications) *before* it
/// checks, so that a change between the check and the sleep still wakes it; between checks it
/// polls, backing off from `first_poll` to `max_poll`, for changes no notification reports.
pub async fn wait_for_change<F, Fut>(
    notify: Option<&Notify>,
    deadline: Instant,
    first_poll: Duration,
    max_poll: Duration,
    mut holds: F,
) -> Result<WaitOutcome, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, StoreError>>,
{
    let mut poll = first_poll.max(Duration::from_millis(1));
    loop {
        let mut notified = std::pin::pin!(notify.map(Notify::notified));
        if let Some(notified) = notified.as_mut().as_pin_mut() {
            notified.enable();
        }
        if !holds().await? {
            return Ok(WaitOutcome::Changed);
        }
        if Instant::now() >= deadline {
            return Ok(WaitOutcome::TimedOut);
        }
        let woken = async {
            match notified.as_mut().as_pin_mut() {
                Some(notified) => notified.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = woken => {}
            () = tokio::time::sleep(poll) => poll = (poll * 2).min(max_poll),
            () = tokio::time::sleep_until(deadline) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(state: &str) -> StoredRecord {
        StoredRecord {
            state: state.to_owned(),
            lease_until: Some(100),
            response: Some(b"answer".to_vec()),
            expires_at: Some(200),
            purge_at: Some(300),
            ..StoredRecord::default()
        }
    }

    #[test]
    fn the_claim_rules_of_begin() {
        let cases = claim_rule_cases();
        for expected in [Existing::Replace, Existing::TakeOver, Existing::Replay, Existing::Leave] {
            assert!(
                cases.iter().any(|case| case.expected == expected),
                "the table shows {expected:?}"
            );
        }
        for case in cases {
            assert_eq!(
                case.record.on_begin(case.same_request, case.now),
                case.expected,
                "{}: {:?}",
                case.why,
                case.record
            );
        }
    }

    #[test]
    fn the_records_of_the_claim_rules_are_well_formed() {
        for case in claim_rule_cases() {
            let id = RecordId::new(crate::Scope::shared(), crate::IdempotencyKey::new("rule").unwrap());
            let record = case.record.clone().into_record(id);
            assert!(record.is_ok(), "{}: {record:?}", case.why);
        }
    }

    #[test]
    fn an_unknown_record_without_expires_at_expires_at_its_purge_at() {
        let id = RecordId::new(crate::Scope::shared(), crate::IdempotencyKey::new("old").unwrap());
        let fingerprint = Fingerprint::of(
            &http::Method::POST,
            &"/pay".parse().unwrap(),
            &http::HeaderMap::new(),
            b"body",
        );
        let old = StoredRecord {
            fingerprint: fingerprint.encode(),
            expires_at: None,
            ..stored(UNKNOWN)
        };
        let record = old.into_record(id).unwrap();
        assert!(
            matches!(record.state, RecordState::Unknown { expires_at, purge_at } if expires_at == purge_at && purge_at == UnixMillis(300)),
            "{record:?}"
        );
    }
}
