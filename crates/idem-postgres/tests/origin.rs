//! What a record keeps for the operator (its origin, its answer's status, whether its latest run
//! was recovered) and how `list` reads it, where PostgreSQL has ways of its own: rows written
//! before migration 7, a key claimed anew past its `purge_at`, completions in a transaction (both
//! forms of `idem_complete_claim`, and `idem_complete`), paths holding `LIKE`'s special
//! characters, ties ordered by bytes whatever the columns' collation, and a row that does not read.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::protocol::{Admission, Decision, InTransaction, Protocol};
use idem_core::testkit::{DAY, LEASE, acquire, claim, completion, fingerprint, fresh_id, unknown_at};
use idem_core::trace_context::RunTrace;
use idem_core::{
    Fingerprint, IdempotencyKey, Policy, Scope, Store, UnixMillis,
    store::{Begin, BeginRequest, Completion, FencingToken, ListQuery, Listed, ListedState, Origin, RecordId},
};
use idem_postgres::PostgresStore;
use idem_test_support::postgres_store::TestSchema;

/// A trace id made of `n`.
fn trace_id(n: u8) -> RunTrace {
    idem_core::testkit::run_trace(n)
}

/// Claims `id` with `origin` at `now`; returns what the store decided and the token.
async fn begin_as(store: &PostgresStore, id: &RecordId, origin: &Origin, now: UnixMillis) -> (Begin, FencingToken) {
    let (fp, token) = (fingerprint("a"), FencingToken::random());
    let begun = store
        .begin(BeginRequest {
            origin,
            ..claim(id, &fp, now, token)
        })
        .await
        .expect("begin");
    (begun, token)
}

/// Every record the store lists at `now`, newest first.
async fn list_all(store: &PostgresStore, now: UnixMillis) -> Vec<Listed> {
    store.list(&ListQuery::all(now, 1000)).await.expect("list")
}

/// Rows written as version 6 wrote them, without the columns of version 7, read as records that
/// keep no origin, were not recovered and have no status; they are listed, and a takeover names
/// its run in them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_written_before_records_kept_their_origin_read_and_list() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let client = schema.client().await;
    let (fp, now) = (fingerprint("a"), UnixMillis::now());
    let [done, released] = std::array::from_fn(|_| fresh_id());
    for (id, completed) in [(&done, true), (&released, false)] {
        client
            .execute(
                "INSERT INTO idem_records
                     (scope, key, state, fingerprint, digest, response, created_at, completed_at, expires_at,
                      purge_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                &[
                    &id.scope.as_str(),
                    &id.key.as_str(),
                    &if completed { "completed" } else { "unknown" },
                    &fp.encode(),
                    &&fp.digest()[..],
                    &completed.then(|| b"ok".to_vec()),
                    &now.as_i64(),
                    &completed.then(|| now.as_i64()),
                    &now.plus(DAY).as_i64(),
                    &now.plus(DAY * 7).as_i64(),
                ],
            )
            .await
            .unwrap();
    }
    let record = store.get(&done).await.expect("get").expect("the record");
    assert_eq!(
        (record.origin, record.recovered, record.status),
        (Origin::default(), false, None)
    );
    let listed = list_all(&store, now).await;
    let states: Vec<_> = listed
        .iter()
        .map(|listed| (listed.id.clone(), listed.state, listed.origin.clone(), listed.status))
        .collect();
    assert!(
        states.contains(&(done.clone(), ListedState::Completed, Origin::default(), None)),
        "{listed:?}"
    );
    assert!(
        states.contains(&(released.clone(), ListedState::Unknown, Origin::default(), None)),
        "{listed:?}"
    );

    // Taken over: the record names the run that holds it now, and keeps its (unknown) request.
    let retry = Origin::new("POST", "/payments/pay_1", Some(trace_id(3)));
    let (begun, _) = begin_as(&store, &released, &retry, now).await;
    assert!(matches!(begun, Begin::Acquired { recovered: true }), "{begun:?}");
    let record = store.get(&released).await.expect("get").expect("the record");
    assert_eq!(
        (record.origin, record.recovered),
        (
            Origin {
                trace: Some(trace_id(3)),
                ..Origin::default()
            },
            true
        )
    );
}

/// A key claimed anew past its `purge_at` keeps nothing of the record before it: not its origin,
/// its recovery or its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_claimed_anew_keeps_nothing_of_its_old_record() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let (id, now) = (fresh_id(), UnixMillis::now());
    let first = Origin::new("POST", "/payments/pay_1", Some(trace_id(1)));
    let (_, token) = begin_as(&store, &id, &first, now).await;
    store.release(&id, token, unknown_at(now)).await.expect("release");
    let (begun, token) = begin_as(&store, &id, &first, now).await;
    assert!(matches!(begun, Begin::Acquired { recovered: true }), "{begun:?}");
    let declined = Completion {
        status: 402,
        ..completion(b"declined", now, DAY, DAY * 7)
    };
    store.complete(&id, token, declined).await.expect("complete");
    let record = store.get(&id).await.expect("get").expect("the record");
    assert_eq!((record.recovered, record.status), (true, Some(402)));

    let later = now.plus(DAY * 8);
    let second = Origin::new("PUT", "/refunds/re_1", None);
    let (begun, _) = begin_as(&store, &id, &second, later).await;
    assert!(matches!(begun, Begin::Acquired { recovered: false }), "{begun:?}");
    let record = store.get(&id).await.expect("get").expect("the record");
    assert_eq!(
        (record.origin, record.recovered, record.status, record.created_at),
        (second, false, None, later)
    );
}

/// The run that completes in its own transaction keeps its answer's status, as `complete` does:
/// through `complete_in_client` (the nine-argument `idem_complete_claim`) and through
/// `idem_complete`. The eight-argument form, which callers deployed before it still call,
/// completes as it did, without a status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_in_a_transaction_keep_the_status() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let protocol = Protocol::new(Arc::new(store.clone()), Policy::default());
    let run = |key: &'static str| {
        let protocol = protocol.clone();
        async move {
            let request = http::Request::post("/payments/pay_9")
                .header("idempotency-key", key)
                .header("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
                .body(())
                .unwrap();
            let (parts, ()) = request.into_parts();
            let Admission::Keyed(keyed) = protocol.admit(&parts) else {
                panic!("a keyed POST is admitted");
            };
            let fp = Fingerprint::of(&parts.method, &parts.uri, &parts.headers, b"{}");
            match protocol.begin(keyed, &fp).await {
                Decision::Run(claim) => InTransaction::new(protocol.clone(), claim),
                other => panic!("expected to run, got {other:?}"),
            }
        }
    };
    let traced = Origin::new(
        "POST",
        "/payments/pay_9",
        RunTrace::from_stored("0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"),
    );

    let mut client = schema.client().await;
    let first = run("in-transaction-1").await;
    let tx = client.transaction().await.unwrap();
    let mut answer = http::Response::builder()
        .status(201)
        .body(Bytes::from_static(b"{\"id\":\"pay_9\"}"))
        .unwrap();
    store
        .complete_in_client(&tx, &first, &mut answer)
        .await
        .expect("complete_in_client");
    tx.commit().await.unwrap();
    let record = store.get(first.id()).await.expect("get").expect("the record");
    assert_eq!((&record.origin, record.status), (&traced, Some(201)));

    let second = run("in-transaction-2").await;
    client
        .execute(
            "SELECT idem_complete($1, 202, '{}'::jsonb, 'ok'::bytea)",
            &[&second.completion_token()],
        )
        .await
        .expect("idem_complete");
    let record = store.get(second.id()).await.expect("get").expect("the record");
    assert_eq!((&record.origin, record.status), (&traced, Some(202)));

    let (deployed, now) = (fresh_id(), UnixMillis::now());
    let token = acquire(&store, &deployed, &fingerprint("a"), now).await;
    client
        .execute(
            "SELECT idem_complete_claim($1, $2, $3, $4, $5, $6, $7, $8)",
            &[
                &deployed.scope.as_str(),
                &deployed.key.as_str(),
                &&token.as_bytes()[..],
                &&b"stored"[..],
                &now.as_i64(),
                &now.plus(DAY).as_i64(),
                &now.plus(DAY * 7).as_i64(),
                &"notice",
            ],
        )
        .await
        .expect("the eight-argument idem_complete_claim");
    let record = store.get(&deployed).await.expect("get").expect("the record");
    assert!(
        matches!(record.state, idem_core::store::RecordState::Completed { .. }),
        "{record:?}"
    );
    assert_eq!(record.status, None);
}

/// A path filter compares characters as they are (but for ASCII case): `_` and `%`, which `LIKE`
/// would take for wildcards, match only themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_filter_has_no_wildcards() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let now = UnixMillis::now();
    let paths = ["/a_b", "/a_b/1", "/axb/1", "/a%/1", "/a%b/1", "/a\\/1"];
    let mut ids = Vec::new();
    for path in paths {
        let id = fresh_id();
        begin_as(&store, &id, &Origin::new("POST", path, None), now).await;
        ids.push((path, id));
    }
    for (route, expected) in [
        ("/a_b", &["/a_b", "/a_b/1"][..]),
        // A route is read as servers read paths, and compared without regard to ASCII case.
        ("/a_b/", &["/a_b", "/a_b/1"][..]),
        ("/A_B", &["/a_b", "/a_b/1"][..]),
        ("/a%", &["/a%/1"][..]),
        ("/a\\", &["/a\\/1"][..]),
        ("/a", &[][..]),
    ] {
        let query = ListQuery {
            path: Some(route.to_owned()),
            ..ListQuery::all(now, 1000)
        };
        let mut found: Vec<_> = store
            .list(&query)
            .await
            .expect("list")
            .into_iter()
            .map(|listed| listed.origin.path)
            .collect();
        found.sort();
        assert_eq!(found, expected, "under {route}");
    }
}

/// Records created at the same time are listed by scope, then key, in the order of their bytes
/// (Rust's order of strings), even when the columns have a collation that orders them otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ties_are_listed_by_bytes_whatever_the_collation() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let client = schema.client().await;
    let icu: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_collation WHERE collname = 'und-x-icu')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(icu, "this test needs a server built with ICU (the und-x-icu collation)");
    // ICU puts punctuation first, then letters regardless of case: `_z`, `a`, `B`, `Z`.
    client
        .batch_execute(
            "ALTER TABLE idem_records
                 ALTER COLUMN scope TYPE TEXT COLLATE \"und-x-icu\",
                 ALTER COLUMN key TYPE TEXT COLLATE \"und-x-icu\"",
        )
        .await
        .unwrap();
    let now = UnixMillis::now();
    let ids: Vec<RecordId> = [
        ("app:a", "k"),
        ("app:B", "k"),
        ("app:B", "_z"),
        ("app:B", "a"),
        ("app:B", "Z"),
    ]
    .into_iter()
    .map(|(scope, key)| RecordId {
        scope: Scope::from_stored(scope),
        key: IdempotencyKey::new(key).unwrap(),
    })
    .collect();
    for id in &ids {
        begin_as(&store, id, &Origin::new("POST", "/ties", None), now).await;
    }
    let listed: Vec<_> = list_all(&store, now)
        .await
        .into_iter()
        .map(|listed| (listed.id.scope.to_string(), listed.id.key.as_str().to_owned()))
        .collect();
    let expected = [
        ("app:B", "Z"),
        ("app:B", "_z"),
        ("app:B", "a"),
        ("app:B", "k"),
        ("app:a", "k"),
    ];
    assert_eq!(listed, expected.map(|(scope, key)| (scope.to_owned(), key.to_owned())),);
}

/// A row that does not read (here a key that is not one) is left out of a listing, which lists
/// the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_skips_a_row_that_does_not_read() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let (fp, now) = (fingerprint("a"), UnixMillis::now());
    let good = fresh_id();
    acquire(&store, &good, &fp, now).await;
    schema
        .client()
        .await
        .execute(
            "INSERT INTO idem_records
                 (scope, key, state, fingerprint, digest, token, lease_until, created_at, purge_at)
             VALUES ('app:x', 'not a key', 'in-flight', '\\x00', '\\x00', '\\x00', $1, $2, $3)",
            &[
                &now.plus(LEASE).as_i64(),
                &now.plus(Duration::from_secs(1)).as_i64(),
                &now.plus(DAY).as_i64(),
            ],
        )
        .await
        .unwrap();
    let listed = list_all(&store, now).await;
    assert_eq!(listed.into_iter().map(|listed| listed.id).collect::<Vec<_>>(), [good]);
}
