//! `Store::list` on SQLite, whose filters are SQL: held to `ListQuery::matches` over records of every
//! stored shape (old ones included) and paths that SQL could misread (`%`, `_`, case, characters
//! of several bytes).

use idem_core::Store;
use idem_core::store::{ListQuery, Listed, ListedState};
use idem_core::testkit::fingerprint;
use idem_core::{IdempotencyKey, UnixMillis};
use idem_sqlite::SqliteStore;

/// The queries' `now`.
const NOW: i64 = 1_000;

/// A row as written straight into the table: a state and its times, as any version of the store
/// could have left it.
struct Row {
    state: &'static str,
    response: bool,
    expires_at: Option<i64>,
    purge_at: i64,
}

/// Every stored shape a record can have, judged at [`NOW`]: live, at the boundary and past it.
const SHAPES: [Row; 9] = [
    row("in-flight", false, Some(2_000), 3_000),
    row("completed", true, Some(2_000), 3_000),
    row("completed", true, Some(NOW), 3_000),
    row("completed", false, Some(2_000), 3_000),
    row("completed", true, Some(999), 3_000),
    row("unknown", false, Some(2_000), 3_000),
    row("unknown", false, Some(NOW), 3_000),
    row("unknown", false, None, 3_000),
    row("unknown", false, None, NOW),
];

const fn row(state: &'static str, response: bool, expires_at: Option<i64>, purge_at: i64) -> Row {
    Row {
        state,
        response,
        expires_at,
        purge_at,
    }
}

/// Paths that only byte-exact prefixes tell apart, and one that only ASCII case does.
const PATHS: [&str; 13] = [
    "",
    "/",
    "/payments",
    "/payments/",
    "/payments/pay_1",
    "/payments-old/x",
    "/pay%/x",
    "/payXments",
    "/pay_/1",
    "/péage",
    "/péage/1",
    "/pé/x",
    "/PAYMENTS",
];

const ROUTES: [&str; 12] = [
    "",
    "/",
    "/payments",
    "/payments/",
    "/pay%",
    "/pay_",
    "/pay",
    "/pé",
    "/péage",
    "/p",
    "/PAYMENTS",
    "/payments/pay_1",
];

async fn store_with(rows: impl FnOnce(&rusqlite::Connection)) -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(&path).await.unwrap();
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.busy_timeout(std::time::Duration::from_secs(10)).unwrap();
    rows(&conn);
    (dir, store)
}

/// Inserts a record as a store would have written it.
#[allow(clippy::too_many_arguments)]
fn insert(
    conn: &rusqlite::Connection,
    scope: &str,
    key: &str,
    shape: &Row,
    created_at: i64,
    path: &str,
    recovered: bool,
    trace_id: Option<&str>,
    status: Option<i64>,
) {
    let fp = fingerprint("body");
    let in_flight = shape.state == "in-flight";
    conn.execute(
        "INSERT INTO idem_records
             (scope, key, state, fingerprint, digest, token, lease_until, response, created_at, completed_at,
              expires_at, purge_at, method, path, trace_id, recovered, status)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, 'POST', ?13, ?14, ?15, ?16)",
        rusqlite::params![
            scope,
            key,
            shape.state,
            fp.encode(),
            &fp.digest()[..],
            in_flight.then_some(&[7u8; 16][..]),
            in_flight.then_some(NOW + 10),
            shape.response.then_some(&b"answer"[..]),
            created_at,
            (shape.state == "completed").then_some(created_at),
            shape.expires_at,
            shape.purge_at,
            path,
            trace_id,
            recovered,
            status
        ],
    )
    .unwrap();
}

/// Every query the filters can be combined into gives exactly the records that
/// `ListQuery::matches` keeps of the whole list, in its order, cut at the limit.
#[tokio::test]
async fn the_filters_in_sql_are_list_query_matches() {
    let scopes = ["app:a", "app:B", "shared"];
    let keys = ["a", "B", "_", "z"];
    let mut count = 0;
    let (_dir, store) = store_with(|conn| {
        for (i, (shape, path)) in SHAPES
            .iter()
            .flat_map(|shape| PATHS.map(|path| (shape, path)))
            .enumerate()
        {
            // Many records share a creation time, so that scope and key order them.
            let created_at = (i % 7) as i64 * 10;
            let key = format!("{}{i}", keys[i % keys.len()]);
            let status = shape.response.then_some(200 + i as i64);
            insert(
                conn,
                scopes[i % scopes.len()],
                &key,
                shape,
                created_at,
                path,
                i % 2 == 0,
                None,
                status,
            );
            count += 1;
        }
    })
    .await;
    let now = UnixMillis::from_i64(NOW);
    let all = store.list(&ListQuery::all(now, 10_000)).await.unwrap();
    assert_eq!(all.len(), count);
    assert!(
        all.is_sorted_by(|a, b| Listed::newest_first(a, b).is_le()),
        "newest first, then by scope and key"
    );
    for state in ListedState::ALL {
        assert!(all.iter().any(|listed| listed.state == state), "some record is {state}");
    }

    let mut queries = 0;
    for state in std::iter::once(None).chain(ListedState::ALL.map(Some)) {
        for recovered in [false, true] {
            for since in [None, Some(20), Some(61)] {
                for path in std::iter::once(None).chain(ROUTES.map(Some)) {
                    for limit in [0, 3, 10_000] {
                        let query = ListQuery {
                            now,
                            state,
                            recovered,
                            since: since.map(UnixMillis::from_i64),
                            path: path.map(str::to_owned),
                            limit,
                        };
                        let expected: Vec<_> = all.iter().filter(|l| query.matches(l)).take(limit).cloned().collect();
                        assert_eq!(store.list(&query).await.unwrap(), expected, "{query:?}");
                        queries += 1;
                    }
                }
            }
        }
    }
    assert_eq!(queries, 5 * 2 * 3 * 13 * 3);
}

/// A path filter is a prefix of bytes followed by `/`: neither a pattern nor a prefix of
/// characters, nor blind to case.
#[tokio::test]
async fn a_path_filter_is_no_pattern() {
    let (_dir, store) = store_with(|conn| {
        for (i, path) in PATHS.iter().enumerate() {
            insert(
                conn,
                "shared",
                &format!("k{i:02}"),
                &SHAPES[0],
                0,
                path,
                false,
                None,
                None,
            );
        }
    })
    .await;
    let under = |route: &str| {
        let store = store.clone();
        let query = ListQuery {
            path: Some(route.to_owned()),
            ..ListQuery::all(UnixMillis::from_i64(NOW), 100)
        };
        async move {
            let mut paths: Vec<_> = store
                .list(&query)
                .await
                .unwrap()
                .into_iter()
                .map(|listed| listed.origin.path)
                .collect();
            paths.sort();
            paths
        }
    };
    // A route is read as servers read paths, and compared without regard to ASCII case.
    let payments = ["/PAYMENTS", "/payments", "/payments/", "/payments/pay_1"];
    assert_eq!(under("/payments").await, payments);
    assert_eq!(under("/payments/").await, payments);
    assert_eq!(under("//%70ayments/.").await, payments);
    assert_eq!(under("/pay%").await, ["/pay%/x"]);
    assert_eq!(under("/pay_").await, ["/pay_/1"]);
    assert_eq!(under("/pay").await, Vec::<String>::new());
    assert_eq!(under("/pé").await, ["/pé/x"]);
    assert_eq!(under("/péage").await, ["/péage", "/péage/1"]);
    assert_eq!(under("/PAYMENTS").await, payments);
}

/// A record listing cannot read is left out, with a warning; the others are listed. What only
/// describes a record (a trace id that is not one, a status that is no status) is left empty.
#[tokio::test]
async fn a_record_that_cannot_be_listed_is_skipped() {
    let (_dir, store) = store_with(|conn| {
        insert(
            conn,
            "shared",
            "good",
            &SHAPES[1],
            2,
            "/p",
            false,
            Some("not a trace id"),
            Some(70_000),
        );
        // No key is empty: the row was not written by a store.
        insert(conn, "shared", "", &SHAPES[1], 1, "/p", false, None, Some(200));
        insert(conn, "shared", "also-good", &SHAPES[1], 0, "/p", false, None, Some(200));
    })
    .await;
    let listed = store
        .list(&ListQuery::all(UnixMillis::from_i64(NOW), 100))
        .await
        .unwrap();
    let keys: Vec<_> = listed.iter().map(|listed| listed.id.key.clone()).collect();
    assert_eq!(
        keys,
        [
            IdempotencyKey::new("good").unwrap(),
            IdempotencyKey::new("also-good").unwrap()
        ]
    );
    assert_eq!((listed[0].origin.trace, listed[0].status), (None, None));
    assert_eq!(listed[1].status, Some(200));
}
