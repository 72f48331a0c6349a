//! A PostgreSQL schema of one test's own on the machine's server, the idem store opened on it, and
//! plain connections to it. The schema is dropped when the test ends (and schemas a killed run left
//! behind, by a later run).

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::store::RecordId;
use idem_postgres::PostgresStore;

use crate::chain;
use crate::servers::{self, HOW_TO_START};

/// Test schemas left behind by a killed run are dropped by later runs once this old.
const STALE_AFTER: Duration = Duration::from_secs(6 * 3600);

/// The test server's URL (`IDEM_TEST_POSTGRES_URL`, or the local default), checked to answer.
pub fn base_url() -> String {
    servers::postgres_url()
}

/// The machine's PostgreSQL as a store URL for `idem serve --store`, in a schema no other test uses
/// (`e2e_…`, created by the first instance that connects).
pub fn store_url() -> String {
    format!("{}?schema={}", base_url(), servers::unique_name("e2e"))
}

/// A PostgreSQL schema of its own for one test, so that tests sharing the database never see each
/// other's records or purges. Created by the first store that connects; dropped on drop.
#[derive(Debug)]
pub struct TestSchema {
    /// The schema's name (`idem_test_<seconds>_<random>`).
    pub name: String,
}

impl TestSchema {
    /// A schema no other test uses (not created yet).
    pub fn new() -> Self {
        Self {
            name: servers::unique_name("idem_test"),
        }
    }

    /// The test server's URL with this schema and `options` (`name=value&...`) added.
    pub fn url(&self, options: &str) -> String {
        let url = servers::with_options(&base_url(), &format!("schema={}", self.name));
        servers::with_options(&url, options)
    }

    /// Connects a store on this schema, or panics saying how to start PostgreSQL.
    pub async fn connect(&self, options: &str) -> PostgresStore {
        match PostgresStore::connect(&self.url(options)).await {
            Ok(store) => store,
            Err(err @ idem_postgres::PostgresError::Connect { .. }) => panic!("{}; {HOW_TO_START}", chain(&err)),
            Err(err) => panic!("cannot open the PostgreSQL store: {}", chain(&err)),
        }
    }

    /// A plain connection whose search_path is this schema.
    pub async fn client(&self) -> tokio_postgres::Client {
        raw_client(&self.url("")).await
    }

    /// A connection in a transaction of its own that holds the row of `id` with `lock` (`FOR
    /// UPDATE`, `FOR NO KEY UPDATE`), as a handler's transaction or an operator's statement does,
    /// until it rolls back (`ROLLBACK`) or is dropped.
    ///
    /// # Panics
    /// If the record has no row.
    pub async fn hold_row(&self, id: &RecordId, lock: &str) -> tokio_postgres::Client {
        let holder = self.client().await;
        holder.batch_execute("BEGIN").await.unwrap();
        let locked = holder
            .execute(
                &format!("SELECT 1 FROM idem_records WHERE scope = $1 AND key = $2 {lock}"),
                &[&id.scope.as_str(), &id.key.as_str()],
            )
            .await
            .unwrap();
        assert_eq!(locked, 1, "the row of {id:?}");
        holder
    }

    /// The test server's address, and the URL of this schema (with `options`) through a relay on
    /// loopback `port`.
    pub fn through(&self, port: u16, options: &str) -> (SocketAddr, String) {
        let url = self.url(options);
        let relay = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        (servers::socket_addr(&url), servers::with_addr(&url, relay))
    }
}

impl Default for TestSchema {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        let url = servers::Server::Postgres.configured_url();
        servers::drop_postgres_schema(&url, &self.name);
        drop_stale_schemas(url);
    }
}

/// A plain tokio-postgres connection to a URL that may carry idem's `schema=NAME` (then its
/// search_path), or panics saying how to start PostgreSQL.
pub async fn raw_client(url: &str) -> tokio_postgres::Client {
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

/// The connections named `application_name` on the server of `url` that run a statement or wait
/// on a lock now, as `state wait_event_type: query` (the query's first 70 characters).
pub async fn busy_connections(url: &str, application_name: &str) -> Vec<String> {
    raw_client(url)
        .await
        .query(
            "SELECT state || ' ' || coalesce(wait_event_type, '-') || ': ' || left(regexp_replace(query, '\\s+', ' ', 'g'), 70)
             FROM pg_stat_activity
             WHERE application_name = $1 AND (state = 'active' OR wait_event_type = 'Lock')",
            &[&application_name],
        )
        .await
        .expect("read pg_stat_activity")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Drops the schemas of runs that were killed before they could clean up (errors are ignored:
/// this is cleanup). Runs on a thread of its own: a `Drop` inside the test's runtime cannot block
/// on it.
fn drop_stale_schemas(url: String) {
    servers::clean_up_postgres(url.clone(), |client| async move {
        let Ok(rows) = client
            .query(
                "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idem\\_test\\_%'",
                &[],
            )
            .await
        else {
            return;
        };
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let oldest = now.saturating_sub(STALE_AFTER.as_secs());
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
}
