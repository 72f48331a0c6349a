//! Connecting and migrating: instances starting together on a new schema, a schema from a newer
//! version of idem, and the errors of a server that cannot be reached.

mod common;

use common::{TestSchema, acquire, base_url, fingerprint, fresh_id};
use idem_core::{Store, UnixMillis};
use idem_postgres::{PostgresError, PostgresStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_together_migrate_once() {
    let schema = TestSchema::new();
    let url = schema.url("pool_size=2");
    let starts: Vec<_> = (0..8)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { PostgresStore::connect(&url).await })
        })
        .collect();
    let mut stores = Vec::new();
    for start in starts {
        match start.await.expect("task") {
            Ok(store) => stores.push(store),
            Err(err) => panic!("a concurrent start failed: {}", common::chain(&err)),
        }
    }
    let client = schema.client().await;
    let versions: Vec<i32> = client
        .query("SELECT version FROM idem_schema_migrations ORDER BY version", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(versions, [1], "each migration is applied once");
    let tables: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename LIKE 'idem\\_%'",
            &[&schema.name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 2, "the tables are in the store's own schema");

    // Every store works, and migrating again changes nothing.
    for store in &stores {
        acquire(store, &fresh_id(), &fingerprint("a"), UnixMillis::now()).await;
        store.migrate().await.expect("migrating again");
    }
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
                supported: 1,
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
    let message = common::chain(&err);
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
    let message = common::chain(&err);
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
    // And the store is whole again once the schema is back.
    store.migrate().await.expect("migrate");
    assert!(store.get(&fresh_id()).await.expect("get").is_none());
}
