//! Direct tests of the SQLite store's `Store` API against a file in a temporary directory. Times
//! are passed explicitly, as the protocol does, so leases expire without sleeping.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::testkit::{LEASE, begin, claim, fingerprint};
use idem_core::{
    Fingerprint, IdempotencyKey, Scope, Store, StoreError, UnixMillis,
    store::{
        Begin, BeginRequest, Checkpoint, Completion, FencingToken, ListQuery, ListedState, Origin, Purged, RecordId,
        RecordState, Release, ScopeSalt, WaitOutcome,
    },
};
use idem_sqlite::{SqliteError, SqliteStore};
use tokio::time::Instant;

const T0: UnixMillis = UnixMillis(1_700_000_000_000);

fn id(key: &str) -> RecordId {
    RecordId {
        scope: Scope::application("tenant-1"),
        key: IdempotencyKey::new(key).unwrap(),
    }
}

fn completion(now: UnixMillis, body: &'static [u8]) -> Completion {
    Completion {
        response: Bytes::from_static(body),
        status: 200,
        completed_at: now,
        expires_at: now.plus(Duration::from_secs(3600)),
        purge_at: now.plus(Duration::from_secs(7200)),
    }
}

async fn temp_store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.db")).await.unwrap();
    (dir, store)
}

/// Starts `store` waiting on `token` (for 10 s at most) in a task, and checks that it still waits
/// 300 ms later, while the claim is held.
async fn start_waiting(
    store: SqliteStore,
    id: &RecordId,
    token: FencingToken,
) -> tokio::task::JoinHandle<Result<WaitOutcome, StoreError>> {
    let id = id.clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    let waiter = tokio::spawn(async move { store.wait(&id, token, deadline).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "the claim is still held");
    waiter
}

/// Asserts that `waiter` returns `Changed` within 2 s: `what` woke it.
async fn assert_woken(waiter: tokio::task::JoinHandle<Result<WaitOutcome, StoreError>>, what: &str) {
    let outcome = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .expect(what)
        .unwrap()
        .unwrap();
    assert_eq!(outcome, WaitOutcome::Changed, "{what}");
}

/// Releases `id` as unknown (its outcome kept, until `purge_at`).
async fn release_unknown(store: &SqliteStore, id: &RecordId, token: FencingToken, purge_at: UnixMillis) {
    let release = Release::Unknown {
        expires_at: purge_at,
        purge_at,
    };
    store.release(id, token, release).await.unwrap();
}

/// Writes a claim of `id` as a store before ttls of their own wrote it (no `expires_at`), its lease
/// from [`T0`].
fn insert_old_claim(
    conn: &rusqlite::Connection,
    id: &RecordId,
    fp: &Fingerprint,
    token: FencingToken,
    purge_at: UnixMillis,
) {
    conn.execute(
        "INSERT INTO idem_records
             (scope, key, state, fingerprint, digest, token, lease_until, created_at, purge_at)
         VALUES (?1, ?2, 'in-flight', ?3, ?4, ?5, ?6, ?7, ?8)",
        rusqlite::params![
            id.scope.as_str(),
            id.key.as_str(),
            fp.encode(),
            &fp.digest()[..],
            &token.as_bytes()[..],
            T0.plus(LEASE).as_i64(),
            T0.as_i64(),
            purge_at.as_i64()
        ],
    )
    .unwrap();
}

/// Opens `path` again and asserts that its schema is still the newest (a fresh file's).
async fn reopen_unchanged(path: &std::path::Path) -> SqliteStore {
    let store = SqliteStore::open(path).await.unwrap();
    assert_eq!(
        schema_of(path),
        schema_of(&path.with_file_name("fresh.db")),
        "still the newest schema"
    );
    store
}

#[tokio::test]
async fn a_new_key_is_claimed_then_replayed_and_counted() {
    let (_dir, store) = temp_store().await;
    let (id, fp) = (id("k1"), fingerprint("body"));

    let (begun, token) = begin(&store, &id, &fp, T0).await;
    assert!(matches!(begun, Begin::Acquired { recovered: false }), "{begun:?}");
    let record = store.get(&id).await.unwrap().expect("the claim is stored");
    assert_eq!(record.fingerprint, fp);
    assert_eq!(record.created_at, T0);
    assert!(
        matches!(record.state, RecordState::InFlight { token: t, lease_until, .. } if t == token && lease_until == T0.plus(LEASE))
    );

    // In flight and within its lease: nobody else gets it.
    let (begun, _) = begin(&store, &id, &fp, T0.plus(Duration::from_secs(1))).await;
    assert!(matches!(&begun, Begin::Existing(r) if matches!(r.state, RecordState::InFlight { .. })));

    let done = T0.plus(Duration::from_secs(2));
    store.complete(&id, token, completion(done, b"answer")).await.unwrap();

    for expected in 1..=3 {
        let (begun, _) = begin(&store, &id, &fp, done.plus(Duration::from_secs(1))).await;
        let Begin::Existing(record) = begun else {
            panic!("a completed record is not claimed again")
        };
        assert_eq!(record.replays, expected);
        let RecordState::Completed {
            response, completed_at, ..
        } = record.state
        else {
            panic!("{record:?}")
        };
        assert_eq!(response.as_deref(), Some(&b"answer"[..]));
        assert_eq!(completed_at, done);
    }
    // A different request under the same key is reported, not counted as a replay.
    let (begun, _) = begin(&store, &id, &fingerprint("other"), done).await;
    assert!(matches!(&begun, Begin::Existing(r) if r.replays == 3 && r.fingerprint == fp));
    // Past its expiry the answer is not replayed, so not counted either.
    let (begun, _) = begin(&store, &id, &fp, done.plus(Duration::from_secs(3600))).await;
    assert!(matches!(&begun, Begin::Existing(r) if r.replays == 3));
    assert_eq!(store.get(&id).await.unwrap().unwrap().replays, 3);
}

#[tokio::test]
async fn a_stale_token_is_fenced_after_a_takeover() {
    let (_dir, store) = temp_store().await;
    let (id, fp) = (id("k2"), fingerprint("body"));
    let (_, old) = begin(&store, &id, &fp, T0).await;

    // A different request cannot take over an expired lease.
    let expired = T0.plus(LEASE);
    let (begun, _) = begin(&store, &id, &fingerprint("other"), expired).await;
    assert!(matches!(begun, Begin::Existing(_)), "{begun:?}");

    let (begun, new) = begin(&store, &id, &fp, expired).await;
    assert!(matches!(begun, Begin::Acquired { recovered: true }), "{begun:?}");
    let record = store.get(&id).await.unwrap().unwrap();
    assert_eq!(record.created_at, T0, "a takeover keeps the record's creation time");

    let later = expired.plus(Duration::from_secs(1));
    assert!(matches!(
        store.renew(&id, old, later.plus(LEASE)).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.complete(&id, old, completion(later, b"stale")).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.release(&id, old, Release::Forget).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store
            .release(
                &id,
                old,
                Release::Unknown {
                    expires_at: later,
                    purge_at: later
                }
            )
            .await,
        Err(StoreError::Fenced)
    ));

    store.renew(&id, new, later.plus(LEASE)).await.unwrap();
    store.complete(&id, new, completion(later, b"fresh")).await.unwrap();
    let record = store.get(&id).await.unwrap().unwrap();
    assert!(matches!(record.state, RecordState::Completed { response: Some(r), .. } if r == "fresh"));
    // Once completed, even the winning token cannot touch it again.
    assert!(matches!(store.renew(&id, new, later).await, Err(StoreError::Fenced)));
    assert!(matches!(
        store.release(&id, new, Release::Forget).await,
        Err(StoreError::Fenced)
    ));
}

#[tokio::test]
async fn a_renewed_lease_is_not_taken_over() {
    let (_dir, store) = temp_store().await;
    let (id, fp) = (id("k3"), fingerprint("body"));
    let (_, token) = begin(&store, &id, &fp, T0).await;
    store.renew(&id, token, T0.plus(LEASE * 2)).await.unwrap();
    let (begun, _) = begin(&store, &id, &fp, T0.plus(LEASE)).await;
    assert!(matches!(begun, Begin::Existing(_)), "{begun:?}");
}

#[tokio::test]
async fn releases_forget_or_remember_an_unknown_outcome() {
    let (_dir, store) = temp_store().await;
    let fp = fingerprint("body");

    let forgotten = id("forget");
    let (_, token) = begin(&store, &forgotten, &fp, T0).await;
    store.release(&forgotten, token, Release::Forget).await.unwrap();
    assert!(store.get(&forgotten).await.unwrap().is_none());
    let (begun, _) = begin(&store, &forgotten, &fp, T0).await;
    assert!(matches!(begun, Begin::Acquired { recovered: false }));

    let unknown = id("unknown");
    let purge_at = T0.plus(Duration::from_secs(3600));
    let (_, token) = begin(&store, &unknown, &fp, T0).await;
    release_unknown(&store, &unknown, token, purge_at).await;
    let record = store.get(&unknown).await.unwrap().unwrap();
    assert!(matches!(record.state, RecordState::Unknown { purge_at: p, .. } if p == purge_at));
    assert_eq!(record.fingerprint, fp);
    // Only the same request takes it over, and it is told that the first run may have had effects.
    let (begun, _) = begin(&store, &unknown, &fingerprint("other"), T0).await;
    assert!(matches!(begun, Begin::Existing(_)));
    let (begun, _) = begin(&store, &unknown, &fp, T0).await;
    assert!(matches!(begun, Begin::Acquired { recovered: true }));

    // Past its purge time a record is as good as gone, whatever the request.
    let gone = id("gone");
    let (_, token) = begin(&store, &gone, &fp, T0).await;
    release_unknown(&store, &gone, token, purge_at).await;
    let other = fingerprint("other");
    let (begun, _) = begin(&store, &gone, &other, purge_at).await;
    assert!(matches!(begun, Begin::Acquired { recovered: false }), "{begun:?}");
    let record = store.get(&gone).await.unwrap().unwrap();
    assert_eq!(record.fingerprint, other);
    assert_eq!(record.created_at, purge_at);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_claims_on_two_stores_acquire_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.db");
    let (a, b) = tokio::join!(SqliteStore::open(&path), SqliteStore::open(&path));
    let stores = [Arc::new(a.unwrap()), Arc::new(b.unwrap())];
    let (id, fp) = (Arc::new(id("race")), Arc::new(fingerprint("body")));
    let barrier = Arc::new(tokio::sync::Barrier::new(50));
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let (store, id, fp, barrier) = (
                Arc::clone(&stores[i % 2]),
                Arc::clone(&id),
                Arc::clone(&fp),
                Arc::clone(&barrier),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                begin(&store, &id, &fp, T0).await.0
            })
        })
        .collect();
    let mut acquired = 0;
    for task in tasks {
        match task.await.unwrap() {
            Begin::Acquired { recovered } => {
                assert!(!recovered);
                acquired += 1;
            }
            Begin::Existing(record) => assert!(matches!(record.state, RecordState::InFlight { .. })),
        }
    }
    assert_eq!(acquired, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_complete_on_another_store_object() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let holder = SqliteStore::open(&path).await.unwrap();
    let watcher = SqliteStore::open(&path).await.unwrap();
    let (id, fp) = (id("wait"), fingerprint("body"));
    let (_, token) = begin(&holder, &id, &fp, T0).await;

    let waiter = start_waiting(watcher, &id, token).await;
    holder.complete(&id, token, completion(T0, b"answer")).await.unwrap();
    assert_woken(waiter, "complete wakes the waiter").await;

    // A claim that is not current (or a record that is gone) does not wait at all.
    let outcome = holder
        .wait(&id, FencingToken::random(), Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(outcome, WaitOutcome::Changed);
}

#[tokio::test]
async fn a_wait_times_out_while_the_claim_is_held() {
    let (_dir, store) = temp_store().await;
    let (id, fp) = (id("held"), fingerprint("body"));
    let (_, token) = begin(&store, &id, &fp, T0).await;
    let started = Instant::now();
    let outcome = store
        .wait(&id, token, started + Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(outcome, WaitOutcome::TimedOut);
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// Another process cannot notify this one: a change made through a plain connection is found by
/// polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_notices_a_change_made_by_another_process() {
    let (dir, store) = temp_store().await;
    let (id, fp) = (id("elsewhere"), fingerprint("body"));
    let (_, token) = begin(&store, &id, &fp, T0).await;
    let waiter = start_waiting(store.clone(), &id, token).await;
    let conn = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
    conn.busy_timeout(Duration::from_secs(10)).unwrap();
    let deleted = conn
        .execute("DELETE FROM idem_records WHERE key = ?1", [id.key.as_str()])
        .unwrap();
    assert_eq!(deleted, 1);
    let changed = Instant::now();
    assert_woken(waiter, "polling notices the change").await;
    assert!(
        changed.elapsed() < Duration::from_millis(500),
        "{:?}",
        changed.elapsed()
    );
}

#[tokio::test]
async fn purge_drops_answers_then_records_in_batches() {
    let (_dir, store) = temp_store().await;
    let fp = fingerprint("body");
    for i in 0..5 {
        let id = id(&format!("p{i}"));
        let (_, token) = begin(&store, &id, &fp, T0).await;
        store.complete(&id, token, completion(T0, b"answer")).await.unwrap();
    }
    let (_, _held) = begin(&store, &id("in-flight"), &fp, T0).await;

    assert_eq!(store.purge(T0, 100).await.unwrap(), Purged::default());

    let expired = T0.plus(Duration::from_secs(3600));
    assert_eq!(
        store.purge(expired, 3).await.unwrap(),
        Purged {
            deleted: 0,
            tombstoned: 3
        }
    );
    assert_eq!(store.purge(expired, 3).await.unwrap().tombstoned, 2);
    assert_eq!(store.purge(expired, 3).await.unwrap(), Purged::default());
    // A tombstone still says the key was used.
    let record = store.get(&id("p0")).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::Completed { response: None, .. }),
        "{record:?}"
    );
    let (begun, _) = begin(&store, &id("p0"), &fp, expired).await;
    assert!(matches!(begun, Begin::Existing(r) if r.replays == 0));

    let purged = T0.plus(Duration::from_secs(7200));
    assert_eq!(store.purge(purged, 4).await.unwrap().deleted, 4);
    assert_eq!(store.purge(purged, 4).await.unwrap().deleted, 1);
    assert!(store.get(&id("p4")).await.unwrap().is_none());
    assert!(
        store.get(&id("in-flight")).await.unwrap().is_some(),
        "a live claim is never purged"
    );
}

#[tokio::test]
async fn purge_takes_the_checkpoints_with_the_record() {
    let (_dir, store) = temp_store().await;
    let (id, fp) = (id("purged-run"), fingerprint("body"));
    let (_, token) = begin(&store, &id, &fp, T0).await;
    let step = Checkpoint {
        name: "charged".to_owned(),
        value: Bytes::from_static(b"ch_1"),
    };
    store.checkpoint(&id, token, step.clone()).await.unwrap();
    let purge_at = T0.plus(Duration::from_secs(60));
    release_unknown(&store, &id, token, purge_at).await;
    assert_eq!(
        store.checkpoints(&id).await.unwrap(),
        vec![step],
        "kept for the next run"
    );

    assert_eq!(store.purge(purge_at, 10).await.unwrap().deleted, 1);
    assert!(store.checkpoints(&id).await.unwrap().is_empty(), "gone with the record");
    let (begun, _) = begin(&store, &id, &fp, purge_at).await;
    assert!(matches!(begun, Begin::Acquired { recovered: false }), "{begun:?}");
    assert!(store.checkpoints(&id).await.unwrap().is_empty());
}

#[tokio::test]
async fn records_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let (id, fp) = (id("restart"), fingerprint("body"));
    {
        let store = SqliteStore::open(&path).await.unwrap();
        let (_, token) = begin(&store, &id, &fp, T0).await;
        store.complete(&id, token, completion(T0, b"kept")).await.unwrap();
    }
    let url = format!("sqlite://{}", path.display());
    assert!(url.starts_with("sqlite:///"), "an absolute path");
    let store = SqliteStore::from_url(&url).await.unwrap();
    store.migrate().await.unwrap();
    store.ping().await.unwrap();
    let record = store.get(&id).await.unwrap().unwrap();
    assert!(matches!(record.state, RecordState::Completed { response: Some(r), .. } if r == "kept"));
    let store = SqliteStore::from_url(&format!("sqlite:{}", path.display()))
        .await
        .unwrap();
    assert!(store.get(&id).await.unwrap().is_some());
}

/// The schema of version 1, as the store created it before checkpoints existed.
const SCHEMA_V1: &str = "
CREATE TABLE idem_records (
    scope        TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN ('in-flight', 'completed', 'unknown')),
    fingerprint  BLOB    NOT NULL,
    digest       BLOB    NOT NULL,
    token        BLOB,
    lease_until  INTEGER,
    response     BLOB,
    created_at   INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at   INTEGER,
    purge_at     INTEGER NOT NULL,
    replays      INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, key)
) STRICT;
CREATE INDEX idem_records_purge_at ON idem_records (purge_at);
CREATE INDEX idem_records_expires_at ON idem_records (expires_at) WHERE response IS NOT NULL;
PRAGMA user_version = 1;
";

/// Version 2 on a file of [`SCHEMA_V1`]: the checkpoints column, before there was a scope salt.
const SCHEMA_V2_FROM_V1: &str = "
ALTER TABLE idem_records ADD COLUMN checkpoints BLOB;
PRAGMA user_version = 2;
";

/// Version 3 on a file of [`SCHEMA_V2_FROM_V1`]: the scope salt, before records kept their origin.
const SCHEMA_V3_FROM_V2: &str = "
CREATE TABLE idem_scope_salt (
    id                  INTEGER PRIMARY KEY CHECK (id = 1),
    salt                BLOB    NOT NULL,
    created_at          INTEGER NOT NULL,
    older_records_until INTEGER
) STRICT;
PRAGMA user_version = 3;
";

/// The schema version of the file and the columns of its tables (`table.column`), in order.
/// Opens the old file at `path` from two stores at once (two processes starting together: one
/// upgrades it, the other finds it done), and asserts that it is now of the newest version, with
/// the tables and columns of a new file.
async fn open_together_upgraded(path: &std::path::Path) -> (SqliteStore, SqliteStore) {
    let (store, other) = tokio::join!(SqliteStore::open(path), SqliteStore::open(path));
    let (store, other) = (store.unwrap(), other.unwrap());
    let (version, columns) = schema_of(path);
    assert_eq!(version, 5);
    let fresh = path.with_file_name("fresh.db");
    drop(SqliteStore::open(&fresh).await.unwrap());
    assert_eq!(columns, schema_of(&fresh).1, "upgraded tables are like new ones");
    (store, other)
}

fn schema_of(path: &std::path::Path) -> (i64, Vec<String>) {
    let conn = rusqlite::Connection::open(path).unwrap();
    let version = conn.pragma_query_value(None, "user_version", |row| row.get(0)).unwrap();
    let mut stmt = conn
        .prepare(
            "SELECT t.name || '.' || c.name FROM sqlite_schema t, pragma_table_info(t.name) c
             WHERE t.type = 'table' ORDER BY t.name, c.cid",
        )
        .unwrap();
    let columns = stmt
        .query_map([], |row| row.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    (version, columns)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_of_schema_version_1_is_upgraded_on_open_and_keeps_its_records() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let (id, fp, token) = (id("upgrade"), fingerprint("body"), FencingToken::random());
    {
        // A file made before checkpoints, holding a claim in flight.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        conn.execute_batch(SCHEMA_V1).unwrap();
        insert_old_claim(&conn, &id, &fp, token, T0.plus(Duration::from_secs(3600)));
    }
    let (version, columns) = schema_of(&path);
    assert_eq!(version, 1);
    assert!(!columns.iter().any(|c| c == "idem_records.checkpoints"), "{columns:?}");

    // Two processes starting together on the old file: one upgrades it, the other finds it done.
    let (store, other) = open_together_upgraded(&path).await;

    // The claim made before the upgrade is intact and records checkpoints.
    let record = store.get(&id).await.unwrap().expect("the old record");
    assert!(matches!(record.state, RecordState::InFlight { token: t, .. } if t == token));
    assert!(store.checkpoints(&id).await.unwrap().is_empty(), "an old row has none");
    let step = Checkpoint {
        name: "charged".to_owned(),
        value: Bytes::from_static(b"\0ch_1\xff"),
    };
    store.checkpoint(&id, token, step.clone()).await.unwrap();
    assert_eq!(other.checkpoints(&id).await.unwrap(), vec![step.clone()]);

    // Opening the upgraded file again changes nothing.
    drop((store, other));
    let store = reopen_unchanged(&path).await;
    assert_eq!(store.checkpoints(&id).await.unwrap(), vec![step]);
    store.complete(&id, token, completion(T0, b"done")).await.unwrap();
    assert!(store.checkpoints(&id).await.unwrap().is_empty(), "gone on completion");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_of_schema_version_2_is_upgraded_and_its_salt_says_how_long_its_records_live() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let fp = fingerprint("body");
    let day = Duration::from_secs(24 * 3600);
    let latest = T0.plus(day * 9);
    let kept = [
        ("old-1", T0.plus(day * 3)),
        ("old-2", latest),
        ("old-3", T0.plus(day * 5)),
    ];
    {
        // A file made before scope salts, holding records written without one.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        conn.execute_batch(SCHEMA_V1).unwrap();
        conn.execute_batch(SCHEMA_V2_FROM_V1).unwrap();
        for (key, purge_at) in kept {
            let id = id(key);
            conn.execute(
                "INSERT INTO idem_records (scope, key, state, fingerprint, digest, created_at, purge_at)
                 VALUES (?1, ?2, 'unknown', ?3, ?4, ?5, ?6)",
                rusqlite::params![
                    id.scope.as_str(),
                    id.key.as_str(),
                    fp.encode(),
                    &fp.digest()[..],
                    T0.as_i64(),
                    purge_at.as_i64()
                ],
            )
            .unwrap();
        }
    }
    assert_eq!(schema_of(&path).0, 2);

    // Two processes starting together on the old file, then asking for the salt together.
    let (store, other) = open_together_upgraded(&path).await;
    let (salt, other_salt) = tokio::join!(
        store.scope_salt(ScopeSalt::random(T0)),
        other.scope_salt(ScopeSalt::random(T0))
    );
    let salt = salt.unwrap();
    assert_eq!(other_salt.unwrap(), salt);
    assert_eq!(
        salt.older_records_until,
        Some(latest),
        "the older records live until the latest of their purge times"
    );
    let record = store.get(&id("old-2")).await.unwrap().expect("an old record");
    assert!(matches!(record.state, RecordState::Unknown { purge_at, .. } if purge_at == latest));

    // Retention takes the older records and leaves the salt; reopening changes nothing either.
    assert_eq!(store.purge(latest, 100).await.unwrap().deleted, kept.len() as u64);
    drop((store, other));
    let store = reopen_unchanged(&path).await;
    assert_eq!(store.scope_salt(ScopeSalt::random(latest)).await.unwrap(), salt);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_of_schema_version_3_is_upgraded_and_its_records_read_without_an_origin() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let fp = fingerprint("body");
    let purge_at = T0.plus(Duration::from_secs(7200));
    {
        // A file made before records kept their origin: an answer, and an unknown outcome.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        conn.execute_batch(SCHEMA_V1).unwrap();
        conn.execute_batch(SCHEMA_V2_FROM_V1).unwrap();
        conn.execute_batch(SCHEMA_V3_FROM_V2).unwrap();
        for (key, state, response) in [
            ("old-answer", "completed", Some(&b"kept"[..])),
            ("old-unknown", "unknown", None),
        ] {
            let id = id(key);
            conn.execute(
                "INSERT INTO idem_records
                     (scope, key, state, fingerprint, digest, response, created_at, completed_at, expires_at,
                      purge_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8, ?9)",
                rusqlite::params![
                    id.scope.as_str(),
                    id.key.as_str(),
                    state,
                    fp.encode(),
                    &fp.digest()[..],
                    response,
                    T0.as_i64(),
                    T0.plus(Duration::from_secs(3600)).as_i64(),
                    purge_at.as_i64()
                ],
            )
            .unwrap();
        }
    }
    assert_eq!(schema_of(&path).0, 3);

    let (store, other) = open_together_upgraded(&path).await;
    for key in ["old-answer", "old-unknown"] {
        let record = other.get(&id(key)).await.unwrap().expect("an old record");
        assert_eq!(
            (&record.origin, record.recovered, record.status),
            (&Origin::default(), false, None),
            "{key}: nothing was kept, and nothing is corrupt"
        );
    }
    let listed = store.list(&ListQuery::all(T0, 10)).await.unwrap();
    assert_eq!(
        listed
            .iter()
            .map(|listed| (listed.id.key.as_str(), listed.state))
            .collect::<Vec<_>>(),
        [
            ("old-answer", ListedState::Completed),
            ("old-unknown", ListedState::Unknown)
        ]
    );
    assert!(
        listed
            .iter()
            .all(|listed| listed.origin == Origin::default() && listed.status.is_none())
    );

    // Taken over now, the old unknown outcome names the run that holds it; it never had a method
    // or a path, and a takeover keeps those.
    let trace = Some(idem_core::testkit::run_trace(3));
    let request = Origin::new("POST", "/payments", trace);
    let token = FencingToken::random();
    let begun = store
        .begin(BeginRequest {
            origin: &request,
            ..claim(&id("old-unknown"), &fp, T0, token)
        })
        .await
        .unwrap();
    assert!(matches!(begun, Begin::Acquired { recovered: true }), "{begun:?}");
    let record = store.get(&id("old-unknown")).await.unwrap().unwrap();
    assert_eq!(
        (record.origin.path.as_str(), record.origin.trace, record.recovered),
        ("", trace, true)
    );
}

#[tokio::test]
async fn a_file_that_cannot_be_opened_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing").join("idem.db");
    let err = SqliteStore::open(&path).await.unwrap_err();
    assert!(matches!(err, SqliteError::Open { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains(&path.display().to_string()), "{message}");
    assert!(message.contains("does not exist"), "{message}");
    assert!(std::error::Error::source(&err).is_some());

    let err = SqliteStore::open(dir.path()).await.unwrap_err();
    assert!(err.to_string().contains("directory"), "{err}");

    let not_a_database = dir.path().join("notes.txt");
    std::fs::write(
        &not_a_database,
        "this is not a database, it is much longer than a header",
    )
    .unwrap();
    let err = SqliteStore::open(&not_a_database).await.unwrap_err();
    assert!(matches!(err, SqliteError::Setup { .. }), "{err:?}");
    assert!(err.to_string().contains("notes.txt"), "{err}");
}

#[tokio::test]
async fn a_corrupt_row_is_reported_as_corrupt() {
    let (dir, store) = temp_store().await;
    let (id, fp) = (id("corrupt"), fingerprint("body"));
    begin(&store, &id, &fp, T0).await;
    let conn = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
    conn.busy_timeout(Duration::from_secs(10)).unwrap();
    conn.execute("UPDATE idem_records SET fingerprint = x'00'", []).unwrap();
    assert!(matches!(store.get(&id).await, Err(StoreError::Corrupt(_))));
}

const CHILD_DB: &str = "IDEM_SQLITE_TEST_CHILD_DB";

/// The other side of `two_processes_and_this_one_claim_once`: 25 concurrent claims from a child
/// process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "run as a child process by two_processes_and_this_one_claim_once"]
async fn child_process_claims() {
    let path = std::env::var(CHILD_DB).expect("only run as a child process");
    let store = Arc::new(SqliteStore::open(path).await.unwrap());
    println!("ACQUIRED={}", claim_concurrently(&store, 25).await);
}

async fn claim_concurrently(store: &Arc<SqliteStore>, n: usize) -> usize {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let store = Arc::clone(store);
            tokio::spawn(async move {
                let (id, fp) = (id("processes"), fingerprint("body"));
                matches!(begin(&store, &id, &fp, T0).await.0, Begin::Acquired { .. })
            })
        })
        .collect();
    let mut acquired = 0;
    for task in tasks {
        acquired += usize::from(task.await.unwrap());
    }
    acquired
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_and_this_one_claim_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("processes.db");
    let children: Vec<_> = (0..2)
        .map(|_| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--ignored", "--exact", "child_process_claims", "--nocapture"])
                .env(CHILD_DB, &path)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // The children create the file too: opening a new database together must work as well.
    let store = Arc::new(SqliteStore::open(&path).await.unwrap());
    let mut acquired = claim_concurrently(&store, 25).await;
    for child in children {
        let output = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "child failed: {stdout}");
        let count = stdout
            .lines()
            .find_map(|line| line.strip_prefix("ACQUIRED="))
            .unwrap_or_else(|| panic!("no count in the child's output: {stdout}"));
        acquired += count.parse::<usize>().unwrap();
    }
    assert_eq!(acquired, 1, "75 claims in three processes");
}

/// Records written before claims carried a ttl of their own (no `expires_at`) keep the rules they
/// were written under: an abandoned claim is taken over, marked recovered, until its `purge_at`
/// (7 days after its lease), and an operator's delete of such a claim leaves it unknown until then.
#[tokio::test]
async fn records_written_without_a_ttl_keep_their_old_rules() {
    let (dir, store) = temp_store().await;
    let fp = fingerprint("body");
    let insert_old_claim = |key: &str| {
        let conn = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
        let id = id(key);
        let purge_at = idem_core::store::backend::abandoned_purge_at(T0.plus(LEASE));
        insert_old_claim(&conn, &id, &fp, FencingToken::random(), purge_at);
        id
    };
    let day = Duration::from_secs(24 * 3600);

    let abandoned = insert_old_claim("old-abandoned");
    let (taken, _) = begin(&store, &abandoned, &fp, T0.plus(day * 6)).await;
    assert!(
        matches!(taken, Begin::Acquired { recovered: true }),
        "taken over days later, as before: {taken:?}"
    );

    let deleted = insert_old_claim("old-deleted");
    store.delete(&deleted).await.unwrap().expect("the old claim");
    let purge_at = idem_core::store::backend::abandoned_purge_at(T0.plus(LEASE));
    let record = store.get(&deleted).await.unwrap().expect("left unknown");
    assert!(
        matches!(record.state, RecordState::Unknown { expires_at, purge_at: p } if expires_at == purge_at && p == purge_at),
        "{record:?}"
    );
    let (taken, _) = begin(&store, &deleted, &fp, T0.plus(day * 6)).await;
    assert!(matches!(taken, Begin::Acquired { recovered: true }), "{taken:?}");
}
