//! Connecting and migrating: instances starting together on a new schema, instances upgrading
//! an older schema together (and making the scope salt at once), a schema from a newer version of
//! idem, and the errors of a server that cannot be reached.

use bytes::Bytes;
use idem_core::testkit::{DAY, LEASE, acquire, begin, completion, fingerprint, fresh_id};
use idem_core::{
    Fingerprint, Store, StoreError, UnixMillis,
    store::{Begin, Checkpoint, FencingToken, ListQuery, Origin, RecordId, RecordState, ScopeSalt},
};
use idem_postgres::{PostgresError, PostgresStore};
use idem_test_support::chain;
use idem_test_support::postgres_store::{TestSchema, base_url};
use tokio_postgres::types::ToSql;

/// The versions every migration of this crate records, in order.
const VERSIONS: [i32; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];

/// Version 1 of the schema, as the first release created it (`idem_schema_migrations`, then
/// migration 1), to check that a database made by it is upgraded in place.
const SCHEMA_V1: &str = "
CREATE TABLE idem_schema_migrations (
    version    INTEGER     PRIMARY KEY,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
INSERT INTO idem_schema_migrations (version) VALUES (1);
CREATE TABLE idem_records (
    scope        TEXT   NOT NULL,
    key          TEXT   NOT NULL,
    state        TEXT   NOT NULL CHECK (state IN ('in-flight', 'completed', 'unknown')),
    fingerprint  BYTEA  NOT NULL,
    digest       BYTEA  NOT NULL,
    token        BYTEA,
    lease_until  BIGINT,
    response     BYTEA,
    created_at   BIGINT NOT NULL,
    completed_at BIGINT,
    expires_at   BIGINT,
    purge_at     BIGINT NOT NULL,
    replays      BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, key)
);
ALTER TABLE idem_records ALTER COLUMN response SET STORAGE EXTERNAL;
CREATE INDEX idem_records_purge_at ON idem_records (purge_at);
CREATE INDEX idem_records_expires_at ON idem_records (expires_at) WHERE response IS NOT NULL;
";

/// What version 2 added to [`SCHEMA_V1`], as the second release migrated it.
const SCHEMA_V2_OVER_V1: &str = "
INSERT INTO idem_schema_migrations (version) VALUES (2);
ALTER TABLE idem_records
    ADD COLUMN checkpoint_names  TEXT[]  NOT NULL DEFAULT '{}',
    ADD COLUMN checkpoint_values BYTEA[] NOT NULL DEFAULT '{}';
";

/// The versions recorded in the test schema.
async fn versions(schema: &TestSchema) -> Vec<i32> {
    schema
        .client()
        .await
        .query("SELECT version FROM idem_schema_migrations ORDER BY version", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// `n` instances connecting to `url` at once; their stores, once every one is up. A start that
/// fails fails the test, saying it was a concurrent `what`.
async fn start_together(url: &str, n: usize, what: &str) -> Vec<PostgresStore> {
    let starts: Vec<_> = (0..n)
        .map(|_| {
            let url = url.to_owned();
            tokio::spawn(async move { PostgresStore::connect(&url).await })
        })
        .collect();
    let mut stores = Vec::new();
    for start in starts {
        match start.await.expect("task") {
            Ok(store) => stores.push(store),
            Err(err) => panic!("a concurrent {what} failed: {}", chain(&err)),
        }
    }
    stores
}

/// A plain connection to `schema`, which it creates and lays out as the releases `layouts` did.
async fn old_schema(schema: &TestSchema, layouts: &[&str]) -> tokio_postgres::Client {
    let client = schema.client().await;
    client
        .batch_execute(&format!("CREATE SCHEMA \"{}\"", schema.name))
        .await
        .unwrap();
    for layout in layouts {
        client.batch_execute(layout).await.unwrap();
    }
    client
}

/// Writes records into a schema of an older version, as its release wrote them: created at `now`
/// with fingerprint `fp`; the columns of version 2 (`checkpoints`) only if the schema has them.
struct OldRecords<'a> {
    client: &'a tokio_postgres::Client,
    fp: &'a Fingerprint,
    now: UnixMillis,
    checkpoints: bool,
}

impl OldRecords<'_> {
    /// A record of `id` in `state`, held by `token` (for a lease) if it has one, purged `purge_in`
    /// days from now. A completed one holds the answer `ok`, kept a day; one in flight holds the
    /// checkpoint `charged` when the schema has checkpoints.
    async fn insert(&self, id: &RecordId, state: &str, token: Option<FencingToken>, purge_in: u32) {
        let (fp, now) = (self.fp, self.now);
        let (scope, key) = (id.scope.as_str(), id.key.as_str());
        let completed = state == "completed";
        let token = token.map(|token| token.as_bytes().to_vec());
        let lease_until = token.as_ref().map(|_| now.plus(LEASE).as_i64());
        let response = completed.then(|| b"ok".to_vec());
        let (completed_at, expires_at) = if completed {
            (Some(now.as_i64()), Some(now.plus(DAY).as_i64()))
        } else {
            (None, None)
        };
        let (names, values) = if state == "in-flight" {
            (vec!["charged".to_owned()], vec![b"ch_1".to_vec()])
        } else {
            (Vec::new(), Vec::new())
        };
        let (fingerprint, digest) = (fp.encode(), fp.digest());
        let digest = &digest[..];
        let (created_at, purge_at) = (now.as_i64(), now.plus(DAY * purge_in).as_i64());
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![
            &scope,
            &key,
            &state,
            &fingerprint,
            &digest,
            &token,
            &lease_until,
            &response,
            &created_at,
            &completed_at,
            &expires_at,
            &purge_at,
        ];
        let sql = if self.checkpoints {
            params.extend([&names as &(dyn ToSql + Sync), &values]);
            "INSERT INTO idem_records
                 (scope, key, state, fingerprint, digest, token, lease_until, response, created_at,
                  completed_at, expires_at, purge_at, checkpoint_names, checkpoint_values)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"
        } else {
            "INSERT INTO idem_records
                 (scope, key, state, fingerprint, digest, token, lease_until, response, created_at,
                  completed_at, expires_at, purge_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"
        };
        self.client.execute(sql, &params).await.unwrap();
    }
}

fn step(name: &str, value: &[u8]) -> Checkpoint {
    Checkpoint {
        name: name.to_owned(),
        value: Bytes::copy_from_slice(value),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_together_migrate_once() {
    let schema = TestSchema::new();
    let stores = start_together(&schema.url("pool_size=2"), 8, "start").await;
    assert_eq!(versions(&schema).await, VERSIONS, "each migration is applied once");
    let client = schema.client().await;
    let tables: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename LIKE 'idem\\_%'",
            &[&schema.name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 3, "the tables are in the store's own schema");

    // Every store works, and migrating again changes nothing.
    for store in &stores {
        acquire(store, &fresh_id(), &fingerprint("a"), UnixMillis::now()).await;
        store.migrate().await.expect("migrating again");
    }
}

/// A database made by version 1, holding a record in flight and one released as unknown, is
/// upgraded in place by instances starting together; both records then take checkpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_together_upgrade_an_old_schema() {
    let schema = TestSchema::new();
    let client = old_schema(&schema, &[SCHEMA_V1]).await;
    let (fp, now) = (fingerprint("a"), UnixMillis::now());
    let (running, holder) = (fresh_id(), FencingToken::random());
    let released = fresh_id();
    let old = OldRecords {
        client: &client,
        fp: &fp,
        now,
        checkpoints: false,
    };
    old.insert(&running, "in-flight", Some(holder), 1).await;
    old.insert(&released, "unknown", None, 1).await;

    let stores = start_together(&schema.url("pool_size=2"), 4, "upgrade").await;
    assert_eq!(versions(&schema).await, VERSIONS, "each migration is applied once");
    let store = &stores[0];

    // The record that was in flight before the upgrade: its holder records checkpoints, nobody else.
    assert!(store.checkpoints(&running).await.expect("checkpoints").is_empty());
    store
        .checkpoint(&running, holder, step("charged", b"ch_1"))
        .await
        .expect("checkpoint");
    store
        .checkpoint(&running, holder, step("receipt", &[0, 0xff]))
        .await
        .expect("checkpoint");
    assert!(matches!(
        stores[1]
            .checkpoint(&running, FencingToken::random(), step("late", b"x"))
            .await,
        Err(StoreError::Fenced)
    ));
    assert_eq!(
        stores[1].checkpoints(&running).await.expect("checkpoints"),
        [step("charged", b"ch_1"), step("receipt", &[0, 0xff])]
    );
    store
        .complete(&running, holder, completion(b"ok", now, DAY, DAY))
        .await
        .expect("complete");
    assert!(store.checkpoints(&running).await.expect("checkpoints").is_empty());

    // The record released as unknown before the upgrade: taken over, then checkpointed.
    let (taken, token) = begin(store, &released, &fp, now).await;
    assert!(matches!(taken, Begin::Acquired { recovered: true }), "{taken:?}");
    store
        .checkpoint(&released, token, step("charged", b"ch_2"))
        .await
        .expect("checkpoint");
    assert_eq!(
        store.checkpoints(&released).await.expect("checkpoints"),
        [step("charged", b"ch_2")]
    );

    // And keys new since the upgrade work as before.
    acquire(store, &fresh_id(), &fp, now).await;
    store.migrate().await.expect("migrating again");
    assert_eq!(versions(&schema).await, VERSIONS);
}

/// A database made by version 2, holding records in every state, is upgraded in place by instances
/// starting together, each asking for the scope salt as soon as it is connected: they all get the
/// same salt, one of theirs, which says that the records written before it live until the latest
/// `purge_at` among them. The records are read as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_together_upgrade_a_version_2_schema_and_make_one_salt() {
    let schema = TestSchema::new();
    let client = old_schema(&schema, &[SCHEMA_V1, SCHEMA_V2_OVER_V1]).await;
    let (fp, now) = (fingerprint("a"), UnixMillis::now());
    let old = OldRecords {
        client: &client,
        fp: &fp,
        now,
        checkpoints: true,
    };
    let (running, holder) = (fresh_id(), FencingToken::random());
    let (done, latest, released) = (fresh_id(), fresh_id(), fresh_id());
    old.insert(&running, "in-flight", Some(holder), 7).await;
    old.insert(&done, "completed", None, 3).await;
    old.insert(&latest, "completed", None, 11).await;
    old.insert(&released, "unknown", None, 5).await;

    let url = schema.url("pool_size=2");
    let candidates: Vec<ScopeSalt> = (0..4).map(|_| ScopeSalt::random(now)).collect();
    let starts: Vec<_> = candidates
        .iter()
        .map(|&candidate| {
            let url = url.clone();
            tokio::spawn(async move {
                let store = PostgresStore::connect(&url).await?;
                let salt = store.scope_salt(candidate).await.expect("scope_salt");
                Ok::<_, PostgresError>((store, salt))
            })
        })
        .collect();
    let (mut stores, mut salts) = (Vec::new(), Vec::new());
    for start in starts {
        match start.await.expect("task") {
            Ok((store, salt)) => {
                stores.push(store);
                salts.push(salt);
            }
            Err(err) => panic!("a concurrent upgrade failed: {}", chain(&err)),
        }
    }
    assert_eq!(versions(&schema).await, VERSIONS, "each migration is applied once");
    let salt = idem_core::testkit::one_salt_of(&salts, &candidates);
    assert_eq!(
        salt.older_records_until,
        Some(now.plus(DAY * 11)),
        "the latest purge_at among the records written before the salt"
    );

    // The records written by version 2 read as before, without what records keep since version 7.
    let store = &stores[0];
    let record = store.get(&latest).await.expect("get").expect("the record");
    match &record.state {
        RecordState::Completed { response, .. } => assert_eq!(response.as_deref(), Some(&b"ok"[..])),
        other => panic!("expected the completed record, got {other:?}"),
    }
    assert_eq!(
        (record.origin, record.recovered, record.status),
        (Origin::default(), false, None)
    );
    let listed = store.list(&ListQuery::all(now, 10)).await.expect("list");
    assert_eq!(listed.len(), 4, "{listed:?}");
    assert_eq!(
        store.checkpoints(&running).await.expect("checkpoints"),
        [step("charged", b"ch_1")]
    );
    store
        .complete(&running, holder, completion(b"ok", now, DAY, DAY * 30))
        .await
        .expect("complete");

    // Records written since change nothing, nor does migrating again or another instance.
    store.migrate().await.expect("migrating again");
    let later = PostgresStore::connect(&url).await.expect("connect");
    assert_eq!(
        later.scope_salt(ScopeSalt::random(now)).await.expect("scope_salt"),
        salt
    );
    assert_eq!(versions(&schema).await, VERSIONS);
}

/// The functions the migrations install for other callers (an upstream's own connection) run on
/// the store's schema whatever the caller's `search_path`: `idem_complete`, replaced by version 7,
/// is pinned again. `idem_claim_insert` is called only by the store's claim statement, and finds
/// `idem_records` as that statement does, with the caller's rights (not a security definer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_functions_are_pinned_to_the_store_schema() {
    let schema = TestSchema::new();
    drop(schema.connect("").await);
    let rows = schema
        .client()
        .await
        .query(
            "SELECT p.oid::regprocedure::text, array_to_string(p.proconfig, ','), p.prosecdef
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = $1",
            &[&schema.name],
        )
        .await
        .unwrap();
    let mut functions: Vec<(String, Option<String>, bool)> =
        rows.iter().map(|row| (row.get(0), row.get(1), row.get(2))).collect();
    functions.sort();
    let pinned = Some(format!("search_path={}, pg_temp", schema.name));
    let mut expected = vec![(
        "idem_claim_insert(text,text,bytea,bytea,bytea,bigint,bigint,bigint,bigint,text,text,text)".to_owned(),
        None,
        false,
    )];
    // Version 10: `idem_complete` (both forms) runs with its owner's rights, pinned all the same.
    for (function, definer) in [
        ("idem_claim_lost(text,text,bytea)", false),
        ("idem_complete(text,integer,jsonb,bytea)", true),
        ("idem_complete(text,integer,text,bytea)", true),
        (
            "idem_complete_claim(text,text,bytea,bytea,bigint,bigint,bigint,text)",
            false,
        ),
        (
            "idem_complete_claim(text,text,bytea,bytea,bigint,bigint,bigint,text,integer)",
            false,
        ),
    ] {
        expected.push((function.to_owned(), pinned.clone(), definer));
    }
    assert_eq!(functions, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_is_refused() {
    let schema = TestSchema::new();
    drop(schema.connect("").await);
    let client = schema.client().await;
    client
        .execute("INSERT INTO idem_schema_migrations (version) VALUES (999)", &[])
        .await
        .unwrap();
    let err = PostgresStore::connect(&schema.url(""))
        .await
        .expect_err("a schema from the future");
    assert!(
        matches!(
            err,
            PostgresError::NewerSchema {
                found: 999,
                supported: 10,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("upgrade idem"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_servers_are_named_without_the_password() {
    // Nothing listens on port 1.
    let err = PostgresStore::connect("postgres://idem:hunter2@127.0.0.1:1/payments?connect_timeout=2")
        .await
        .expect_err("nothing listens on port 1");
    assert!(matches!(err, PostgresError::Connect { .. }), "{err:?}");
    let message = chain(&err);
    assert!(message.contains("idem@127.0.0.1:1/payments"), "{message}");
    assert!(message.to_lowercase().contains("refused"), "{message}");
    assert!(
        !message.contains("hunter2") && !format!("{err:?}").contains("hunter2"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_database_is_reported() {
    let base = base_url();
    let (prefix, _) = base.split_once('?').unwrap_or((&base, ""));
    let (server, _) = prefix.rsplit_once('/').expect("the URL names a database");
    let url = format!("{server}/idem_no_such_database");
    let err = PostgresStore::connect(&url).await.expect_err("no such database");
    let message = chain(&err);
    assert!(message.contains("/idem_no_such_database"), "{message}");
    assert!(message.contains("does not exist"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_operations_fail_as_unavailable_when_the_server_is_gone() {
    // A store whose server is gone after connecting: simulated by a schema that loses its tables.
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    store.ping().await.expect("ping");
    schema
        .client()
        .await
        .batch_execute(&format!("DROP SCHEMA \"{}\" CASCADE", schema.name))
        .await
        .unwrap();
    let err = store.get(&fresh_id()).await.expect_err("the table is gone");
    assert!(matches!(err, idem_core::StoreError::Unavailable(_)), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("idem_records") && message.contains("does not exist"),
        "{message}"
    );
    let err = store
        .scope_salt(ScopeSalt::random(UnixMillis::now()))
        .await
        .expect_err("the table is gone");
    assert!(matches!(err, idem_core::StoreError::Unavailable(_)), "{err:?}");
    let message = chain(&err);
    assert!(
        message.contains("scope_salt") && message.contains("does not exist"),
        "{message}"
    );
    // And the store is whole again once the schema is back.
    store.migrate().await.expect("migrate");
    assert!(store.get(&fresh_id()).await.expect("get").is_none());
}
