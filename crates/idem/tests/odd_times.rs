//! A record holding a time past the year 9999 (which RFC 3339 cannot write, and which no setting
//! idem accepts makes: one written by hand, or by a version that took `--ttl 8000y`), on each
//! store, through the real `idem list` and `idem inspect`: it is listed and inspected as
//! damaged, and the records beside it are listed as ever; never a panic, never a failed listing.

mod common;

use std::time::Duration;

use common::{Gateway, Upstream, describe, new_key, run_idem};
use idem_test_support::{postgres_store, redis_store};
use serde_json::Value;

const COMMAND_LIMIT: Duration = Duration::from_secs(30);

/// The year 11476, in Unix milliseconds: past what RFC 3339 writes.
const FAR: i64 = 300_000_000_000_000;

/// How a test damages one record of a store: sets `field` of the record of `key` to `millis`,
/// with the store's own client.
type Damage<'a> = &'a dyn Fn(&str, &str, i64);

/// Three completed records on `store`: one as the gateway wrote it, one created past the year
/// 9999 and one expiring (and purged) then, as `--ttl 8000y` made them.
async fn a_record_past_9999_is_shown_damaged(store: &str, damage: Damage<'_>) {
    let upstream = Upstream::start().await;
    let gw = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let (normal, born_late, kept_long) = (new_key(), new_key(), new_key());
    for key in [&normal, &born_late, &kept_long] {
        let reply = gw.post_json("/pay", Some(key), r#"{"amount":1}"#).await;
        assert_eq!(reply.status, 201, "{reply}");
    }
    damage(&born_late, "created_at", FAR);
    damage(&kept_long, "expires_at", FAR);
    damage(&kept_long, "purge_at", i64::MAX);

    let table = run_idem(&["list", "--store", store], COMMAND_LIMIT).await;
    assert!(table.status.success(), "{}", describe(&table));
    let text = String::from_utf8_lossy(&table.stdout);
    let line = |key: &str| {
        text.lines()
            .find(|line| line.ends_with(key))
            .unwrap_or_else(|| panic!("{key} is listed:\n{}", describe(&table)))
            .to_owned()
    };
    assert!(line(&normal).contains("completed"), "{}", describe(&table));
    for key in [&born_late, &kept_long] {
        assert!(line(key).contains("damaged"), "{key}:\n{}", describe(&table));
        let stderr = String::from_utf8_lossy(&table.stderr);
        assert!(
            stderr.contains(&format!("{key:?}")) && stderr.contains("past the year 9999"),
            "the operator is told which record and why:\n{}",
            describe(&table)
        );
    }

    let json = run_idem(&["list", "--store", store, "--json"], COMMAND_LIMIT).await;
    assert!(json.status.success(), "{}", describe(&json));
    let lines: Vec<Value> = String::from_utf8_lossy(&json.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 3, "{}", describe(&json));
    let listed = |key: &str| lines.iter().find(|line| line["key"] == key).expect("listed").clone();
    let cases = [
        (&normal, false, true),
        (&born_late, true, false),
        (&kept_long, true, true),
    ];
    for (key, damaged, created_written) in cases {
        let line = listed(key);
        assert_eq!(line["damaged"].is_string(), damaged, "{key}: {line}");
        assert_eq!(line["created_at"].is_string(), created_written, "{key}: {line}");
        assert_eq!(line["state"], "completed", "{key}: {line}");
    }

    for (key, damaged, _) in cases {
        let text = run_idem(&["inspect", "--store", store, key], COMMAND_LIMIT).await;
        assert!(text.status.success(), "{key}: {}", describe(&text));
        let shown = String::from_utf8_lossy(&text.stdout);
        assert_eq!(shown.contains("damaged:"), damaged, "{key}: {}", describe(&text));
        assert!(shown.contains("/pay"), "{key}: {}", describe(&text));

        let json = run_idem(&["inspect", "--store", store, "--json", key], COMMAND_LIMIT).await;
        assert!(json.status.success(), "{key}: {}", describe(&json));
        let record: Value = serde_json::from_slice(&json.stdout).expect("one JSON object");
        assert_eq!(record["damaged"].is_string(), damaged, "{key}: {record}");
        assert_eq!(record["state"], "completed", "{key}: {record}");
    }
    let record: Value = serde_json::from_slice(
        &run_idem(&["inspect", "--store", store, "--json", &kept_long], COMMAND_LIMIT)
            .await
            .stdout,
    )
    .expect("one JSON object");
    assert!(
        record["expires_at"].is_null() && record["completed_at"].is_string(),
        "a time RFC 3339 cannot write is null, the others are written: {record}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_record_past_9999_is_shown_damaged() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = common::store_url_in(dir.path());
    let file = store.strip_prefix("sqlite://").expect("a sqlite:// URL").to_owned();
    let damage = |key: &str, field: &str, millis: i64| {
        let db = rusqlite::Connection::open(&file).expect("open the SQLite file");
        let sql = format!("UPDATE idem_records SET {field} = ?1 WHERE key = ?2");
        let changed = db
            .execute(&sql, rusqlite::params![millis, key])
            .expect("damage the record");
        assert_eq!(changed, 1, "{key}");
    };
    a_record_past_9999_is_shown_damaged(&store, &damage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_record_past_9999_is_shown_damaged() {
    let store = postgres_store::store_url();
    let (_, schema) = store.split_once("?schema=").expect("a URL with a schema");
    let database = idem_test_support::servers::postgres_url();
    let damage = |key: &str, field: &str, millis: i64| {
        // The test's runtime is busy in the caller: a thread of its own, with a runtime of its own.
        let sql = format!("UPDATE \"{schema}\".idem_records SET {field} = $1 WHERE key = $2");
        let (database, key) = (database.clone(), key.to_owned());
        let changed = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async {
                let (client, connection) = tokio_postgres::connect(&database, tokio_postgres::NoTls)
                    .await
                    .expect("connect to PostgreSQL");
                tokio::spawn(connection);
                client.execute(&sql, &[&millis, &key]).await.expect("damage the record")
            })
        })
        .join()
        .expect("the damaging thread");
        assert_eq!(changed, 1);
    };
    a_record_past_9999_is_shown_damaged(&store, &damage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_record_past_9999_is_shown_damaged() {
    let store = redis_store::store_url();
    let (server, prefix) = store.split_once("/?prefix=").expect("a URL with a prefix");
    let redis_cli = |args: &[&str]| common::redis_cli(server, args);
    let damage = |key: &str, field: &str, millis: i64| {
        // The record's hash is named by a hash of its scope and key; its `origin` holds the key.
        let pattern = format!("{prefix}:*:rec");
        let scanned = redis_cli(&["--scan", "--pattern", &pattern]);
        let record = scanned
            .lines()
            .find(|record| redis_cli(&["HGET", record, "origin"]).contains(key))
            .unwrap_or_else(|| panic!("the record of {key} among {scanned}"));
        redis_cli(&["HSET", record, field, &millis.to_string()]);
    };
    a_record_past_9999_is_shown_damaged(&store, &damage).await;
}
