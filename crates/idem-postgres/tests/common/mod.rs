//! What the integration tests share: the test server (found, and its how-to-start message given,
//! by `idem_test_support::servers`), a private PostgreSQL schema per test (dropped afterwards),
//! and its reach through a relay. The record helpers come from idem-core's testkit.
#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_postgres::PostgresStore;
use idem_test_support::servers::{self, HOW_TO_START};

/// Test schemas left behind by a killed run are dropped by later runs once this old.
const STALE_AFTER: Duration = Duration::from_secs(6 * 3600);

/// The test server's URL (`IDEM_TEST_POSTGRES_URL`, or the local default), checked to answer.
pub(crate) fn base_url() -> String {
    servers::postgres_url()
}

fn unix_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

/// An error and its causes, for panic messages.
pub(crate) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cause = err.source();
    while let Some(err) = cause {
        out.push_str(": ");
        out.push_str(&err.to_string());
        cause = err.source();
    }
    out
}

/// A PostgreSQL schema of its own for one test, so that tests sharing the database never see each
/// other's records or purges. Created by the first store that connects; dropped on drop.
#[derive(Debug)]
pub(crate) struct TestSchema {
    pub(crate) name: String,
}

impl TestSchema {
    pub(crate) fn new() -> Self {
        Self {
            name: servers::unique_name("idem_test"),
        }
    }

    /// The test server's URL with this schema and `options` (`name=value&...`) added.
    pub(crate) fn url(&self, options: &str) -> String {
        let url = servers::with_options(&base_url(), &format!("schema={}", self.name));
        servers::with_options(&url, options)
    }

    /// Connects a store on this schema, or panics saying how to start PostgreSQL.
    pub(crate) async fn connect(&self, options: &str) -> PostgresStore {
        match PostgresStore::connect(&self.url(options)).await {
            Ok(store) => store,
            Err(err @ idem_postgres::PostgresError::Connect { .. }) => panic!("{}; {HOW_TO_START}", chain(&err)),
            Err(err) => panic!("cannot open the PostgreSQL store: {}", chain(&err)),
        }
    }

    /// A plain connection whose search_path is this schema.
    pub(crate) async fn client(&self) -> tokio_postgres::Client {
        raw_client(&self.url("")).await
    }
}

impl Default for TestSchema {
    fn default() -> Self {
        Self::new()
    }
}

/// The host and port of the test server, and the URL of the same database through `port`.
pub(crate) fn through(port: u16, schema: &TestSchema, options: &str) -> (SocketAddr, String) {
    let url = schema.url(options);
    let relay = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    (servers::socket_addr(&url), servers::with_addr(&url, relay))
}

/// A plain tokio-postgres connection to a URL that may carry this crate's `schema=NAME`.
pub(crate) async fn raw_client(url: &str) -> tokio_postgres::Client {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut schema = None;
    let rest: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.strip_prefix("schema=") {
            Some(name) => {
                schema = Some(name.to_owned());
                false
            }
            None => !pair.is_empty(),
        })
        .collect();
    let url = if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    let (client, connection) = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
        Ok(pair) => pair,
        Err(err) => panic!("cannot connect to {url}: {}; {HOW_TO_START}", chain(&err)),
    };
    tokio::spawn(connection);
    if let Some(schema) = schema {
        client
            .batch_execute(&format!("SET search_path TO \"{schema}\""))
            .await
            .unwrap();
    }
    client
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        let url = servers::Server::Postgres.configured_url();
        servers::drop_postgres_schema(&url, &self.name);
        drop_stale_schemas(url);
    }
}

/// Drops the schemas of runs that were killed before they could clean up (errors are ignored:
/// this is cleanup). Runs on a thread of its own: a `Drop` inside the test's runtime cannot block
/// on it.
fn drop_stale_schemas(url: String) {
    let cleanup = std::thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
            return;
        };
        runtime.block_on(async move {
            let Ok((client, connection)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await else {
                return;
            };
            tokio::spawn(connection);
            let Ok(rows) = client
                .query(
                    "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idem\\_test\\_%'",
                    &[],
                )
                .await
            else {
                return;
            };
            let oldest = unix_secs().saturating_sub(STALE_AFTER.as_secs());
            for row in rows {
                let stale: String = row.get(0);
                let created = stale
                    .strip_prefix("idem_test_")
                    .and_then(|rest| rest.split('_').next())
                    .and_then(|secs| secs.parse::<u64>().ok());
                if created.is_some_and(|secs| secs < oldest) {
                    servers::drop_postgres_schema(&url, &stale);
                }
            }
        });
    });
    let _ = cleanup.join();
}
