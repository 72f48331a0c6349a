//! What the integration tests share: the test server's URL, a private PostgreSQL schema per test
//! (dropped afterwards), and small helpers for records.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, Method};
use idem_core::{
    Fingerprint, IdempotencyKey, Scope, Store, UnixMillis,
    store::{Begin, BeginRequest, Completion, FencingToken, RecordId},
};
use idem_postgres::PostgresStore;

/// The server the tests use unless `IDEM_TEST_POSTGRES_URL` names another.
pub(crate) const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

const HOW_TO_START: &str = "the PostgreSQL store tests need a running PostgreSQL server: start it with \
     `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`, \
     or set IDEM_TEST_POSTGRES_URL to the URL of another one";

/// Test schemas left behind by a killed run are dropped by later runs once this old.
const STALE_AFTER: Duration = Duration::from_secs(6 * 3600);

pub(crate) fn base_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
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
        let random = uuid::Uuid::new_v4().simple().to_string();
        Self {
            name: format!("idem_test_{}_{}", unix_secs(), &random[..12]),
        }
    }

    /// The test server's URL with this schema and `options` (`name=value&...`) added.
    pub(crate) fn url(&self, options: &str) -> String {
        let base = base_url();
        let separator = if base.contains('?') { '&' } else { '?' };
        let mut url = format!("{base}{separator}schema={}", self.name);
        if !options.is_empty() {
            url.push('&');
            url.push_str(options);
        }
        url
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
    let config: tokio_postgres::Config = base_url().parse().expect("the test URL");
    let host = match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(host) => host.clone(),
        #[allow(unreachable_patterns)]
        _ => panic!("the fault tests need a TCP server, not a socket path"),
    };
    let server_port = config.get_ports().first().copied().unwrap_or(5432);
    let upstream = format!("{host}:{server_port}")
        .parse()
        .or_else(|_| format!("127.0.0.1:{server_port}").parse())
        .unwrap();
    let proxied = url.replacen(&format!("{host}:{server_port}"), &format!("127.0.0.1:{port}"), 1);
    assert_ne!(proxied, url, "the test URL names host:port explicitly");
    (upstream, proxied)
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
        let (name, url) = (self.name.clone(), base_url());
        // Drop runs inside the test's runtime, which cannot block on itself: use a thread.
        let cleanup = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let Ok((client, connection)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await else {
                    return;
                };
                tokio::spawn(connection);
                let _ = client.batch_execute("SET lock_timeout = '10s'").await;
                let _ = client
                    .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                    .await;
                // Schemas of runs that were killed before they could clean up.
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
                        let _ = client
                            .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{stale}\" CASCADE"))
                            .await;
                    }
                }
            });
        });
        let _ = cleanup.join();
    }
}

pub(crate) const LEASE: Duration = Duration::from_secs(60);
pub(crate) const DAY: Duration = Duration::from_secs(24 * 3600);

/// A fresh record id in a scope of its own.
pub(crate) fn fresh_id() -> RecordId {
    RecordId {
        scope: Scope::application(uuid::Uuid::new_v4().to_string()),
        key: IdempotencyKey::new(&uuid::Uuid::now_v7().to_string()).unwrap(),
    }
}

pub(crate) fn fingerprint(body: &str) -> Fingerprint {
    Fingerprint::of(
        &Method::POST,
        &"/pay".parse().unwrap(),
        &HeaderMap::new(),
        body.as_bytes(),
    )
}

pub(crate) async fn begin(
    store: &dyn Store,
    id: &RecordId,
    fp: &Fingerprint,
    now: UnixMillis,
) -> (Begin, FencingToken) {
    let token = FencingToken::random();
    let request = BeginRequest {
        id,
        fingerprint: fp,
        now,
        lease_until: now.plus(LEASE),
        expires_at: now.plus(std::time::Duration::from_secs(24 * 3600)),
        purge_at: now.plus(std::time::Duration::from_secs(7 * 24 * 3600)),
        token,
    };
    (store.begin(request).await.expect("begin"), token)
}

/// Claims a new key, or panics.
pub(crate) async fn acquire(store: &dyn Store, id: &RecordId, fp: &Fingerprint, now: UnixMillis) -> FencingToken {
    match begin(store, id, fp, now).await {
        (Begin::Acquired { recovered: false }, token) => token,
        (other, _) => panic!("expected a new claim, got {other:?}"),
    }
}

pub(crate) fn completion(body: &[u8], at: UnixMillis, ttl: Duration, keep: Duration) -> Completion {
    Completion {
        response: Bytes::copy_from_slice(body),
        completed_at: at,
        expires_at: at.plus(ttl),
        purge_at: at.plus(keep),
    }
}
