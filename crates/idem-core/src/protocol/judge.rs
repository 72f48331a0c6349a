//! Judgement: what a request gets from a record that exists, as a pure function of the record, the
//! request's fingerprint and the time on the store's clock — replayed, refused as another request's
//! key or as expired, or waited on. No store is needed to test it.

use bytes::Bytes;
use http::Response;

use super::Outcome;
use crate::content_coding::AcceptEncoding;
use crate::fingerprint::Fingerprint;
use crate::problem::{Problem, ProblemKind};
use crate::seal::Keyring;
use crate::store::{FencingToken, Record, RecordState};
use crate::time::UnixMillis;

/// What a request gets from an existing record.
pub(super) fn judge(
    record: &Record,
    fingerprint: &Fingerprint,
    now: UnixMillis,
    waited: bool,
    keyring: Option<&Keyring>,
    accept: &AcceptEncoding,
) -> Judgement {
    if let Some(used_at) = expired_at(record, now) {
        let detail = format!(
            "this key was used at {used_at} and its answer is no longer kept; it has expired. Send the request again with a new key."
        );
        return Judgement::problem(Problem::new(ProblemKind::KeyExpired, detail), Outcome::Expired);
    }
    if record.fingerprint.digest() != fingerprint.digest() {
        let first = &record.fingerprint;
        let differences = first.differences(fingerprint);
        let detail = format!(
            "this key was first used for {} {}; this request differs in its {}. Use a new key for a new request, or resend the original request unchanged.",
            first.method(),
            first.path(),
            differences.describe()
        );
        return Judgement::problem(Problem::new(ProblemKind::KeyMismatch, detail), Outcome::Mismatch);
    }
    match &record.state {
        RecordState::Completed {
            response: Some(bytes), ..
        } => match crate::seal::open_answer(keyring, &record.id, bytes) {
            Ok(stored) => {
                let outcome = if waited { Outcome::Waited } else { Outcome::Replayed };
                Judgement::Answer(stored.to_replay(accept), outcome)
            }
            Err(err) => {
                // Never run again: the request took effect, only its answer is lost to us.
                tracing::error!(scope = %record.id.scope, key = %record.id.key, error = %err, "the stored answer cannot be read");
                let detail = "this key's request was processed, but its stored answer cannot be read (an operator can tell why from the logs); it will not be processed again";
                Judgement::problem(Problem::new(ProblemKind::AnswerUnreadable, detail), Outcome::Unreadable)
            }
        },
        RecordState::InFlight { token, lease_until, .. } => Judgement::Wait {
            holder: *token,
            lease_until: *lease_until,
        },
        // The store only returns these when it did not claim the record, which for a matching
        // fingerprint means another caller claimed it in between: look again shortly.
        RecordState::Completed { response: None, .. } | RecordState::Unknown { .. } => Judgement::Wait {
            holder: FencingToken::random(),
            lease_until: now,
        },
    }
}

/// When the key of `record` was used, if it has expired at `now`: an answer past its ttl (or
/// dropped to a tombstone), an unknown outcome past its ttl, or a claim whose holder vanished
/// (its lease ended) past its ttl. None of them runs again.
fn expired_at(record: &Record, now: UnixMillis) -> Option<UnixMillis> {
    match &record.state {
        RecordState::Completed {
            response,
            expires_at,
            completed_at,
            ..
        } => (now >= *expires_at || response.is_none()).then_some(*completed_at),
        RecordState::Unknown { expires_at, .. } => (now >= *expires_at).then_some(record.created_at),
        RecordState::InFlight {
            lease_until,
            expires_at: Some(expires_at),
            ..
        } => (now >= *lease_until && now >= *expires_at).then_some(record.created_at),
        RecordState::InFlight { expires_at: None, .. } => None,
    }
}

pub(super) enum Judgement {
    /// Answer with this; nothing runs.
    Answer(Response<Bytes>, Outcome),
    /// Wait until the claim `holder` ends (or its lease does), then look again.
    Wait {
        holder: FencingToken,
        lease_until: UnixMillis,
    },
}

impl Judgement {
    fn problem(problem: Problem, outcome: Outcome) -> Self {
        Self::Answer(problem.to_response(), outcome)
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, Method, StatusCode};

    use super::*;
    use crate::key::IdempotencyKey;
    use crate::response::{HeaderAllowList, StoredResponse};
    use crate::scope::Scope;
    use crate::store::{Origin, RecordId};

    const NOW: i64 = 10_000_000;
    const CREATED: i64 = 1_000;

    fn at(ms: i64) -> UnixMillis {
        UnixMillis::from_i64(ms)
    }

    fn fingerprint(body: &str) -> Fingerprint {
        Fingerprint::of(
            &Method::POST,
            &"/pay".parse().unwrap(),
            &HeaderMap::new(),
            body.as_bytes(),
        )
    }

    fn answer() -> Bytes {
        let stored = StoredResponse::capture(
            StatusCode::CREATED,
            &HeaderMap::new(),
            &HeaderAllowList::default(),
            Some(Bytes::from_static(b"{\"charge\":\"ch_1\"}")),
        );
        stored.encode().into()
    }

    fn record(state: RecordState) -> Record {
        Record {
            id: RecordId {
                scope: Scope::application("tenant"),
                key: IdempotencyKey::new("k-1").unwrap(),
            },
            fingerprint: fingerprint("a"),
            created_at: at(CREATED),
            replays: 0,
            state,
            origin: Origin::default(),
            recovered: false,
            status: None,
        }
    }

    fn completed(response: Option<Bytes>, expires_at: i64) -> RecordState {
        RecordState::Completed {
            response,
            completed_at: at(CREATED),
            expires_at: at(expires_at),
            purge_at: at(NOW + 1_000_000),
        }
    }

    fn in_flight(lease_until: i64, expires_at: Option<i64>) -> RecordState {
        RecordState::InFlight {
            token: FencingToken::from_bytes([7; 16]),
            lease_until: at(lease_until),
            expires_at: expires_at.map(at),
        }
    }

    fn unknown(expires_at: i64) -> RecordState {
        RecordState::Unknown {
            expires_at: at(expires_at),
            purge_at: at(NOW + 1_000_000),
        }
    }

    /// What the request gets, in a word: the outcome of an answer, or `wait`.
    fn verdict(state: RecordState, body: &str, waited: bool) -> (String, Option<u16>) {
        let accept = AcceptEncoding::from_headers(&HeaderMap::new());
        match judge(&record(state), &fingerprint(body), at(NOW), waited, None, &accept) {
            Judgement::Answer(response, outcome) => (outcome.as_str().to_owned(), Some(response.status().as_u16())),
            Judgement::Wait { .. } => ("wait".to_owned(), None),
        }
    }

    #[test]
    fn an_existing_record_is_judged_as_the_outcome_table_says() {
        let live = NOW + 1;
        let past = NOW - 1;
        // (case, the record's state, the request's body, waited, outcome, status)
        type Case = (&'static str, RecordState, &'static str, bool, &'static str, Option<u16>);
        let cases: Vec<Case> = vec![
            (
                "completed, same request",
                completed(Some(answer()), live),
                "a",
                false,
                "replayed",
                Some(201),
            ),
            (
                "completed, same request, after waiting",
                completed(Some(answer()), live),
                "a",
                true,
                "waited",
                Some(201),
            ),
            (
                "completed, another body",
                completed(Some(answer()), live),
                "b",
                false,
                "mismatch",
                Some(422),
            ),
            (
                "completed past its ttl",
                completed(Some(answer()), past),
                "a",
                false,
                "expired",
                Some(422),
            ),
            ("a tombstone", completed(None, live), "a", false, "expired", Some(422)),
            (
                "a tombstone, another body",
                completed(None, live),
                "b",
                false,
                "expired",
                Some(422),
            ),
            (
                "in flight, same request",
                in_flight(live, Some(live)),
                "a",
                false,
                "wait",
                None,
            ),
            (
                "in flight, another body",
                in_flight(live, Some(live)),
                "b",
                false,
                "mismatch",
                Some(422),
            ),
            (
                "abandoned within its ttl",
                in_flight(past, Some(live)),
                "a",
                false,
                "wait",
                None,
            ),
            (
                "abandoned past its ttl",
                in_flight(past, Some(past)),
                "a",
                false,
                "expired",
                Some(422),
            ),
            (
                "running past its ttl",
                in_flight(live, Some(past)),
                "a",
                false,
                "wait",
                None,
            ),
            (
                "abandoned, written before claims had a ttl",
                in_flight(past, None),
                "a",
                false,
                "wait",
                None,
            ),
            ("unknown within its ttl", unknown(live), "a", false, "wait", None),
            (
                "unknown, another body",
                unknown(live),
                "b",
                false,
                "mismatch",
                Some(422),
            ),
            ("unknown past its ttl", unknown(past), "a", false, "expired", Some(422)),
        ];
        for (case, state, body, waited, outcome, status) in cases {
            assert_eq!(verdict(state, body, waited), (outcome.to_owned(), status), "{case}");
        }
    }

    #[test]
    fn an_answer_sealed_under_no_configured_key_is_unreadable_and_never_run_again() {
        let sealed = Bytes::from_static(b"\x00garbage that no decoder takes");
        let (outcome, status) = verdict(completed(Some(sealed), NOW + 1), "a", false);
        assert_eq!((outcome.as_str(), status), ("answer-unreadable", Some(500)));
    }
}
