//! What a copy of a store would show: every byte a store keeps for a test's records, read past
//! idem (the SQLite files, the PostgreSQL schema's rows, the Redis keys under a prefix), so that a
//! test can look for what must not be there in clear.

use std::path::Path;
use std::time::Duration;

/// The bytes of a SQLite database and its journal files (`PATH`, `PATH-wal`, `PATH-shm`).
pub fn sqlite_bytes(path: &Path) -> Vec<u8> {
    let mut bytes = Vec::new();
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        if let Ok(content) = std::fs::read(&file) {
            bytes.extend_from_slice(&content);
        }
    }
    bytes
}

/// Every value of every row of every table in the PostgreSQL `schema` (`url` without options):
/// `bytea` columns as their raw bytes, others as their text.
pub fn postgres_bytes(url: &str, schema: &str) -> Vec<u8> {
    let (base, _) = url.split_once('?').unwrap_or((url, ""));
    let (base, schema) = (base.to_owned(), schema.to_owned());
    let read = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            let (client, connection) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
                .await
                .unwrap_or_else(|err| panic!("connect to {base} (start it: bash .ci/services): {err}"));
            tokio::spawn(connection);
            let columns = client
                .query(
                    "SELECT table_name::text, column_name::text, data_type::text FROM information_schema.columns \
                     WHERE table_schema = $1 ORDER BY table_name, ordinal_position",
                    &[&schema],
                )
                .await
                .expect("list the schema's columns");
            let mut bytes = Vec::new();
            for column in columns {
                let (table, name, kind): (String, String, String) = (column.get(0), column.get(1), column.get(2));
                let quoted = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
                let target = format!("{}.{}", quoted(&schema), quoted(&table));
                if kind == "bytea" {
                    let sql = format!("SELECT {} FROM {target}", quoted(&name));
                    for row in client.query(&sql, &[]).await.expect("read a bytea column") {
                        let value: Option<Vec<u8>> = row.get(0);
                        bytes.extend(value.unwrap_or_default());
                    }
                } else {
                    let sql = format!("SELECT {}::text FROM {target}", quoted(&name));
                    for row in client.query(&sql, &[]).await.expect("read a column as text") {
                        let value: Option<String> = row.get(0);
                        bytes.extend(value.unwrap_or_default().into_bytes());
                    }
                }
            }
            bytes
        })
    });
    read.join().expect("the reading thread")
}

/// Every value under the keys `prefix:*` of the Redis servers at `nodes` (one for a standalone
/// Redis, every master of a cluster): strings, hashes (fields and values), lists, sets and
/// sorted sets, each as stored.
pub fn redis_bytes(nodes: &[String], prefix: &str) -> Vec<u8> {
    let mut bytes = Vec::new();
    for node in nodes {
        let client = redis::Client::open(node.as_str()).expect("a Redis URL");
        let mut conn = client
            .get_connection_with_timeout(Duration::from_secs(5))
            .unwrap_or_else(|err| panic!("connect to {node} (start it: bash .ci/services): {err}"));
        let keys: Vec<Vec<u8>> = redis::Commands::scan_match::<_, Vec<u8>>(&mut conn, format!("*{prefix}*"))
            .expect("scan the keys")
            .filter_map(Result::ok)
            .collect();
        for key in keys {
            bytes.extend_from_slice(&key);
            let kind: String = redis::cmd("TYPE").arg(&key).query(&mut conn).expect("TYPE");
            // The command that reads a collection of this type whole, and its arguments after the key.
            let whole: Option<(&str, &[i64])> = match kind.as_str() {
                "hash" => Some(("HGETALL", &[])),
                "list" => Some(("LRANGE", &[0, -1])),
                "set" => Some(("SMEMBERS", &[])),
                "zset" => Some(("ZRANGE", &[0, -1])),
                _ => None,
            };
            let values: Vec<Vec<u8>> = match (kind.as_str(), whole) {
                ("string", _) => vec![redis::cmd("GET").arg(&key).query(&mut conn).expect("GET")],
                (_, Some((command, args))) => redis::cmd(command)
                    .arg(&key)
                    .arg(args)
                    .query(&mut conn)
                    .unwrap_or_else(|err| panic!("{command}: {err}")),
                (_, None) => Vec::new(),
            };
            values.into_iter().for_each(|value| bytes.extend(value));
        }
    }
    bytes
}

/// Whether `needle` appears in `haystack`.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|window| window == needle)
}
