//! What the store implementations share: the stored form of a record (its state as a word, its
//! times as integers) checked into a [`Record`], the loop that waits for a claim to change, and
//! [`ReplayCounts`], which keeps a replay from being a write.
//! Stores still do their own atomic primitives; this only keeps them from writing the same
//! decoding and waiting three times.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::time::Instant;

pub use crate::replay_counts::ReplayCounts;
pub use crate::scope::hex;
use crate::{FencingToken, Fingerprint, Record, RecordId, RecordState, StoreError, UnixMillis, WaitOutcome};

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
    /// The current claim's token (in flight only).
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
            id,
        })
    }
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
        assert_eq!(
            stored(IN_FLIGHT).on_begin(true, 300),
            Existing::Replace,
            "past purge_at, whoever asks"
        );
        assert_eq!(stored(COMPLETED).on_begin(false, 300), Existing::Replace);
        assert_eq!(
            stored(IN_FLIGHT).on_begin(true, 100),
            Existing::TakeOver,
            "the lease ended"
        );
        assert_eq!(
            stored(IN_FLIGHT).on_begin(true, 99),
            Existing::Leave,
            "the lease still runs"
        );
        assert_eq!(
            stored(IN_FLIGHT).on_begin(false, 150),
            Existing::Leave,
            "another request never takes over"
        );
        assert_eq!(stored(UNKNOWN).on_begin(true, 0), Existing::TakeOver);
        assert_eq!(stored(UNKNOWN).on_begin(false, 0), Existing::Leave);
        assert_eq!(stored(COMPLETED).on_begin(true, 199), Existing::Replay);
        assert_eq!(
            stored(COMPLETED).on_begin(true, 200),
            Existing::Leave,
            "an expired answer is no replay"
        );
        assert_eq!(
            stored(COMPLETED).on_begin(false, 100),
            Existing::Leave,
            "a mismatch is no replay"
        );
        let tombstone = StoredRecord {
            response: None,
            ..stored(COMPLETED)
        };
        assert_eq!(tombstone.on_begin(true, 100), Existing::Leave);
    }

    #[test]
    fn a_key_without_an_answer_expires_at_its_ttl() {
        assert_eq!(stored(UNKNOWN).on_begin(true, 199), Existing::TakeOver);
        assert_eq!(
            stored(UNKNOWN).on_begin(true, 200),
            Existing::Leave,
            "an unknown outcome past its ttl is a tombstone"
        );
        assert_eq!(
            stored(IN_FLIGHT).on_begin(true, 200),
            Existing::Leave,
            "an abandoned claim past its ttl is a tombstone"
        );
        assert_eq!(stored(UNKNOWN).on_begin(true, 300), Existing::Replace, "until purge_at");
        let old = |state| StoredRecord {
            expires_at: None,
            ..stored(state)
        };
        assert_eq!(
            old(IN_FLIGHT).on_begin(true, 250),
            Existing::TakeOver,
            "a claim written without expires_at is taken over until purge_at, as before"
        );
        assert_eq!(old(UNKNOWN).on_begin(true, 250), Existing::TakeOver);
        let long_run = StoredRecord {
            lease_until: Some(400),
            ..stored(IN_FLIGHT)
        };
        assert_eq!(
            long_run.on_begin(true, 300),
            Existing::Leave,
            "a claim whose lease still runs is never replaced"
        );
    }

    #[test]
    fn an_unknown_record_without_expires_at_expires_at_its_purge_at() {
        let id = RecordId {
            scope: crate::Scope::shared(),
            key: crate::IdempotencyKey::new("old").unwrap(),
        };
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
