//! What a record keeps about its request (method, path, trace, recovery, status), and how `list`
//! answers an operator's questions about the records under a path.

use std::time::Duration;

use super::Harness;
use super::helpers::{
    DAY, answered, assert_claimed, claim, completion, fingerprint, fresh_id, origin, run_trace, the_record, unknown_at,
};
use crate::store::{Begin, BeginRequest, Completion, FencingToken, ListQuery, Listed, ListedState, Origin, RecordId};
use crate::{Fingerprint, Store, UnixMillis};

/// A record keeps what it is about: the request's method and path and the trace id of its latest
/// run (a takeover's own), whether that run was recovered, and its answer's status; `get` and
/// `list` both show them.
pub async fn a_record_keeps_its_origin_status_and_recovery(h: &impl Harness) {
    let store = h.open().await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let first = Origin::new("POST", "/payments/pay_1", Some(run_trace(1)));
    let (begun, token) = begin_from(&*store, &id, &fp, now, &first).await;
    assert_claimed(&begun, false, "a new key");
    let record = the_record(store.get(&id).await, "the claim");
    assert_eq!((&record.origin, record.recovered, record.status), (&first, false, None));
    store.release(&id, token, unknown_at(now)).await.expect("release");

    // The same request again, in another trace: taken over, recovered; the record now names the
    // run that answers.
    let retry = Origin::new("POST", "/payments/pay_1", Some(run_trace(2)));
    let later = now.plus(Duration::from_secs(1));
    let (begun, token) = begin_from(&*store, &id, &fp, later, &retry).await;
    assert_claimed(&begun, true, "the retry takes the unknown outcome over");
    let declined = Completion {
        status: 402,
        ..completion(b"declined", later, DAY, 7 * DAY)
    };
    store.complete(&id, token, declined).await.expect("complete");
    let record = the_record(store.get(&id).await, "the record");
    assert_eq!(record.origin, retry, "the trace of the run that answered");
    assert!(record.recovered, "the answering run was recovered");
    assert_eq!(record.status, Some(402));
    assert_eq!(
        record.created_at, now,
        "a takeover keeps when the key was first claimed"
    );
    let listed = store
        .list(&ListQuery {
            path: Some("/payments/pay_1".into()),
            recovered: true,
            ..ListQuery::all(later, 1000)
        })
        .await
        .expect("list");
    let mine: Vec<_> = listed.iter().filter(|listed| listed.id == id).collect();
    assert_eq!(mine.len(), 1, "{listed:?}");
    assert_eq!(
        (
            mine[0].state,
            &mine[0].origin,
            mine[0].status,
            mine[0].recovered,
            mine[0].created_at
        ),
        (ListedState::Completed, &retry, Some(402), true, now)
    );

    // A copy that finds the answer is told which run made it (its span links to that run's).
    let copy = Origin::new("POST", "/payments/pay_1", Some(run_trace(3)));
    let (found, _) = begin_from(&*store, &id, &fp, later, &copy).await;
    let Begin::Existing(found) = found else {
        panic!("a completed record is found, not claimed: {found:?}");
    };
    assert_eq!(found.origin.trace, retry.trace, "the trace of the run that answered");

    // A record whose request carried no trace keeps none; its run was not recovered.
    let plain = fresh_id();
    answered(&*store, &plain, &fp, now, b"ok").await;
    let record = the_record(store.get(&plain).await, "the record");
    assert_eq!(
        (&record.origin, record.recovered, record.status),
        (origin(), false, Some(201))
    );
}

/// `list` answers an operator's questions about the records under one path: by state, judged at
/// the query's `now` (a tombstone is an answer past its `expires_at`), by recovery, by creation
/// time, newest first, at most `limit`; a path filter takes the path and what lies below it only.
pub async fn lists_records_by_state_time_path_and_recovery(h: &impl Harness) {
    let store = h.open().await;
    let route = format!("/list-{}", uuid::Uuid::new_v4());
    let fp = fingerprint("a");
    let base = UnixMillis::now();
    let at = |ms: u64| base.plus(Duration::from_millis(ms));
    let origin_of = |name: &str| Origin::new("POST", &format!("{route}/{name}"), Some(run_trace(7)));
    let claim_as =
        async |id: &RecordId, name: &str, now: UnixMillis| begin_from(&*store, id, &fp, now, &origin_of(name)).await;
    let [in_flight, completed, unknown, tombstone, recovered, outside] = std::array::from_fn(|_| fresh_id());
    claim_as(&in_flight, "in-flight", at(0)).await;
    let (_, token) = claim_as(&completed, "completed", at(1)).await;
    store
        .complete(&completed, token, completion(b"ok", at(1), DAY, 7 * DAY))
        .await
        .expect("complete");
    let (_, token) = claim_as(&unknown, "unknown", at(2)).await;
    store
        .release(&unknown, token, unknown_at(at(2)))
        .await
        .expect("release");
    let (_, token) = claim_as(&tombstone, "tombstone", at(3)).await;
    let short = Completion {
        expires_at: at(5),
        ..completion(b"old", at(3), DAY, 7 * DAY)
    };
    store.complete(&tombstone, token, short).await.expect("complete");
    let (_, token) = claim_as(&recovered, "recovered", at(4)).await;
    store
        .release(&recovered, token, unknown_at(at(4)))
        .await
        .expect("release");
    let (begun, token) = claim_as(&recovered, "recovered", at(5)).await;
    assert_claimed(&begun, true, "the retry takes the unknown outcome over");
    store
        .complete(&recovered, token, completion(b"ok", at(5), DAY, 7 * DAY))
        .await
        .expect("complete");
    // Its path starts like the route's, but is not under it.
    let stranger = Origin::new("POST", &format!("{route}-old/x"), None);
    begin_from(&*store, &outside, &fp, at(6), &stranger).await;

    let now = at(10);
    let query = ListQuery {
        path: Some(route.clone()),
        ..ListQuery::all(now, 1000)
    };
    let ids = |listed: Vec<Listed>| listed.into_iter().map(|listed| listed.id).collect::<Vec<_>>();
    let list = |query: ListQuery| {
        let store = store.clone();
        async move { ids(store.list(&query).await.expect("list")) }
    };
    let everything = store.list(&query).await.expect("list");
    assert_eq!(
        everything
            .iter()
            .map(|listed| (listed.id.clone(), listed.state))
            .collect::<Vec<_>>(),
        [
            (recovered.clone(), ListedState::Completed),
            (tombstone.clone(), ListedState::Tombstone),
            (unknown.clone(), ListedState::Unknown),
            (completed.clone(), ListedState::Completed),
            (in_flight.clone(), ListedState::InFlight),
        ],
        "every record under {route}, newest first, judged at the query's now"
    );
    let first = &everything[0];
    assert_eq!(
        (first.origin.method.as_str(), first.origin.trace),
        ("POST", Some(run_trace(7)))
    );
    assert_eq!((first.status, first.recovered), (Some(201), true));
    assert_eq!(everything[4].status, None, "no answer yet");
    // Each question, the query that asks it, and the records that answer it, newest first.
    let ask = |change: &dyn Fn(&mut ListQuery)| {
        let mut asked = query.clone();
        change(&mut asked);
        asked
    };
    let a_day_later = base.plus(DAY + Duration::from_secs(1));
    let questions = [
        (
            "in flight",
            ask(&|q| q.state = Some(ListedState::InFlight)),
            vec![&in_flight],
        ),
        (
            "unknown",
            ask(&|q| q.state = Some(ListedState::Unknown)),
            vec![&unknown],
        ),
        (
            "completed",
            ask(&|q| q.state = Some(ListedState::Completed)),
            vec![&recovered, &completed],
        ),
        (
            "tombstones",
            ask(&|q| q.state = Some(ListedState::Tombstone)),
            vec![&tombstone],
        ),
        ("recovered", ask(&|q| q.recovered = true), vec![&recovered]),
        (
            "since",
            ask(&|q| q.since = Some(at(2))),
            vec![&recovered, &tombstone, &unknown],
        ),
        ("the first two", ask(&|q| q.limit = 2), vec![&recovered, &tombstone]),
        (
            "one path",
            ask(&|q| q.path = Some(format!("{route}/unknown"))),
            vec![&unknown],
        ),
        (
            "a path that starts alike",
            ask(&|q| q.path = Some(format!("{route}-old"))),
            vec![&outside],
        ),
        // A day later on the store's clock, every answer and unknown outcome is past its ttl.
        (
            "tombstones a day later",
            ask(&|q| (q.state, q.now) = (Some(ListedState::Tombstone), a_day_later)),
            vec![&recovered, &tombstone, &unknown, &completed],
        ),
    ];
    for (question, query, expected) in questions {
        let expected: Vec<RecordId> = expected.into_iter().cloned().collect();
        assert_eq!(list(query).await, expected, "{question}");
    }
}

/// Begins `id` at `at` for a request that came as `origin` ([`claim`] otherwise); returns what the
/// store decided and the token.
async fn begin_from(
    store: &dyn Store,
    id: &RecordId,
    fp: &Fingerprint,
    at: UnixMillis,
    origin: &Origin,
) -> (Begin, FencingToken) {
    let token = FencingToken::random();
    let request = BeginRequest {
        origin,
        ..claim(id, fp, at, token)
    };
    (store.begin(request).await.expect("begin"), token)
}
