//! What `list` and `get` make of the origin a record keeps: a record written before origins (or
//! with one that does not read, or names another record) is read but left out of `list`, and a
//! takeover names its own run, even of a record written before origins.

use idem_core::store::{Begin, BeginRequest, FencingToken, ListQuery, Origin, RecordId, RecordState};
use idem_core::testkit::{self, DAY, Harness, fingerprint, fresh_id};
use idem_core::{Store, UnixMillis};

use crate::common::{RedisHarness, Server};
use crate::{claim, completed, fresh_store, query};

/// A record written before records kept their scope, key and origin (no `origin`, `trace_id`,
/// `status` or `recovered` in its hash) still reads, with none of them; `list` cannot name it and
/// leaves it out, as it leaves out one whose `origin` does not read or names another record, and
/// lists the rest without failing.
async fn list_leaves_out_the_records_it_cannot_name(server: Server) {
    let (store, _cleanup) = fresh_store(server, "").await;
    let [named, old, garbled, impostor] = std::array::from_fn(|_| fresh_id());
    for id in [&named, &old, &garbled, &impostor] {
        completed(&store, id, 7 * DAY).await;
    }
    let record = |id: &RecordId| store.record_keys(id).record;
    let _: i64 = query(
        server,
        redis::cmd("HDEL")
            .arg(record(&old))
            .arg(&["origin", "trace_id", "status", "recovered"]),
    );
    let _: i64 = query(
        server,
        redis::cmd("HSET")
            .arg(record(&garbled))
            .arg("origin")
            .arg("not an origin"),
    );
    let named_origin: Vec<u8> = query(server, redis::cmd("HGET").arg(record(&named)).arg("origin"));
    let _: i64 = query(
        server,
        redis::cmd("HSET")
            .arg(record(&impostor))
            .arg("origin")
            .arg(named_origin),
    );

    // Each still reads: what does not read (or is not there) is left out, the rest is read.
    for (id, what, status) in [(&old, "an old record", None), (&garbled, "a garbled origin", Some(201))] {
        let record = store.get(id).await.expect(what).expect("it is there");
        assert_eq!(
            (&record.origin, record.recovered, record.status),
            (&Origin::default(), false, status),
            "{what}"
        );
        assert!(
            matches!(record.state, RecordState::Completed { response: Some(_), .. }),
            "{what}: {record:?}"
        );
    }

    let listed = store.list(&ListQuery::all(UnixMillis::now(), 100)).await.expect("list");
    let ids: Vec<_> = listed.into_iter().map(|listed| listed.id).collect();
    assert_eq!(ids, [named], "only the record the list can name, once");
}

/// A takeover names its own run: a request without a trace leaves none of the run before it, and
/// the record says the run was recovered after a release as unknown and a delete in flight too;
/// the request's method and path stay the first claim's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_names_its_own_run() {
    let harness = RedisHarness::standalone();
    let store = Harness::open(&harness).await;
    let (id, fp, now) = (fresh_id(), fingerprint("a"), UnixMillis::now());
    let traced = Origin::new("PUT", "/orders/1", Some(testkit::run_trace(9)));
    let (_, token) = begin_from(&*store, &id, now, &traced).await;
    store
        .release(&id, token, testkit::unknown_at(now))
        .await
        .expect("release");
    // `testkit::origin()` is another method and path, and no trace.
    let token = FencingToken::random();
    let taken = store.begin(testkit::claim(&id, &fp, now, token)).await.expect("begin");
    assert!(matches!(taken, Begin::Acquired { recovered: true }), "{taken:?}");
    let record = store.get(&id).await.expect("get").expect("the record");
    let untraced = Origin {
        trace: None,
        ..traced.clone()
    };
    assert_eq!((&record.origin, record.recovered), (&untraced, true));
    store
        .release(&id, token, testkit::unknown_at(now))
        .await
        .expect("release");
    let record = store.get(&id).await.expect("get").expect("the record");
    assert_eq!(
        (&record.origin, record.recovered),
        (&untraced, true),
        "a release keeps them"
    );
    begin_from(&*store, &id, now, &traced).await;
    store.delete(&id).await.expect("delete");
    let record = store.get(&id).await.expect("get").expect("unknown now");
    assert_eq!(
        (&record.origin, record.recovered),
        (&traced, true),
        "a delete in flight keeps them"
    );
}

/// An unknown outcome written before records kept their origin, taken over by a retry after the
/// upgrade, is named by that takeover: the recovered run an investigation looks for is listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_names_a_record_written_before_origins() {
    let (store, _cleanup) = fresh_store(Server::Standalone, "").await;
    let (id, now) = (fresh_id(), UnixMillis::now());
    let token = claim(&store, &id, now).await;
    store
        .release(&id, token, testkit::unknown_at(now))
        .await
        .expect("release");
    let record = store.record_keys(&id).record;
    let _: i64 = query(
        Server::Standalone,
        redis::cmd("HDEL")
            .arg(&record)
            .arg(&["origin", "trace_id", "recovered"]),
    );
    assert!(store.list(&ListQuery::all(now, 100)).await.expect("list").is_empty());

    let retry = Origin::new("POST", "/payments/7", Some(testkit::run_trace(4)));
    let (taken, _) = begin_from(&store, &id, now, &retry).await;
    assert!(matches!(taken, Begin::Acquired { recovered: true }), "{taken:?}");
    let listed = store
        .list(&ListQuery {
            recovered: true,
            ..ListQuery::all(now, 100)
        })
        .await
        .expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        (&listed[0].id, &listed[0].origin, listed[0].recovered),
        (&id, &retry, true)
    );
}

on_both_servers! {
    list_leaves_out_the_records_it_cannot_name =>
        standalone_list_leaves_out_the_records_it_cannot_name,
        cluster_list_leaves_out_the_records_it_cannot_name;
}

/// Begins `id` at `now` for the suite's request, as it came from `origin`; returns what the store
/// decided and the token.
async fn begin_from(store: &dyn Store, id: &RecordId, now: UnixMillis, origin: &Origin) -> (Begin, FencingToken) {
    let (token, fp) = (FencingToken::random(), fingerprint("a"));
    let request = BeginRequest {
        origin,
        ..testkit::claim(id, &fp, now, token)
    };
    (store.begin(request).await.expect("begin"), token)
}
