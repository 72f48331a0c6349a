//! The servers idem's tests run against — the machine's PostgreSQL, Redis and three-node Redis
//! Cluster (`bash .ci/services` starts them) — and the URL surgery to reach them through a relay.
//!
//! Each server's URL comes from the environment at run time (`IDEM_TEST_POSTGRES_URL`,
//! `IDEM_TEST_REDIS_URL`, `IDEM_TEST_REDIS_CLUSTER_URL`), with localhost defaults. A server that
//! does not answer fails the test with a message saying how to start it.

use std::hash::{BuildHasher, RandomState};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How to start every test server.
pub const HOW_TO_START: &str = "start the test servers with `bash .ci/services` (PostgreSQL on 127.0.0.1:5432, \
     Redis on 127.0.0.1:6379, the Redis Cluster on 127.0.0.1:7001-7003; it installs what is missing), \
     or point IDEM_TEST_POSTGRES_URL / IDEM_TEST_REDIS_URL / IDEM_TEST_REDIS_CLUSTER_URL at servers of your own";

/// The default PostgreSQL server (user `postgres`, trust authentication, database `test`).
pub const POSTGRES_DEFAULT: &str = "postgres://postgres@127.0.0.1:5432/test";
/// The default Redis server.
pub const REDIS_DEFAULT: &str = "redis://127.0.0.1:6379";
/// The default Redis Cluster.
pub const REDIS_CLUSTER_DEFAULT: &str = "redis+cluster://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003";

/// A test server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// PostgreSQL.
    Postgres,
    /// Redis, standalone.
    Redis,
    /// The Redis Cluster.
    RedisCluster,
}

impl Server {
    /// The environment variable that names this server.
    pub fn var(self) -> &'static str {
        match self {
            Self::Postgres => "IDEM_TEST_POSTGRES_URL",
            Self::Redis => "IDEM_TEST_REDIS_URL",
            Self::RedisCluster => "IDEM_TEST_REDIS_CLUSTER_URL",
        }
    }

    fn default_url(self) -> &'static str {
        match self {
            Self::Postgres => POSTGRES_DEFAULT,
            Self::Redis => REDIS_DEFAULT,
            Self::RedisCluster => REDIS_CLUSTER_DEFAULT,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Postgres => "PostgreSQL",
            Self::Redis => "Redis",
            Self::RedisCluster => "the Redis Cluster",
        }
    }

    /// The server's URL as configured, without checking that it answers.
    pub fn configured_url(self) -> String {
        std::env::var(self.var())
            .ok()
            .filter(|url| !url.trim().is_empty())
            .unwrap_or_else(|| self.default_url().to_owned())
    }

    /// The server's URL, once its first address answers.
    ///
    /// # Panics
    /// If it does not answer, with a message saying how to start it.
    pub fn url(self) -> String {
        let url = self.configured_url();
        let addr = socket_addrs(&url).into_iter().next();
        let reachable = addr.is_some_and(|addr| TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok());
        assert!(
            reachable,
            "{} is not reachable at {} ({}={url}); {HOW_TO_START}",
            self.name(),
            addr.map_or_else(|| "an address that does not resolve".to_owned(), |a| a.to_string()),
            self.var(),
        );
        url
    }
}

/// The machine's PostgreSQL (checked to answer).
pub fn postgres_url() -> String {
    Server::Postgres.url()
}

/// The machine's Redis (checked to answer).
pub fn redis_url() -> String {
    Server::Redis.url()
}

/// The machine's Redis Cluster (checked to answer).
pub fn redis_cluster_url() -> String {
    Server::RedisCluster.url()
}

/// `url` with more options in its query string (`name=value&…`).
pub fn with_options(url: &str, options: &str) -> String {
    if options.is_empty() {
        return url.to_owned();
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{options}")
}

/// A name no other test (in this or another process) uses: `prefix_<seconds>_<random>`. The
/// seconds let a later run recognise what a killed run left behind.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let random = RandomState::new().hash_one((n, std::process::id(), SystemTime::now())) >> 16;
    format!("{prefix}_{secs}_{random:012x}")
}

/// The parts of a URL: scheme, user information (with its `@`), the hosts, and the rest (path
/// and query).
fn split(url: &str) -> (&str, &str, &str, &str) {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => authority.split_at(at + 1),
        None => ("", authority),
    };
    (scheme, userinfo, hosts, tail)
}

/// Every `host:port` a URL names (a cluster URL names several), resolved.
///
/// # Panics
/// If a host does not resolve.
pub fn socket_addrs(url: &str) -> Vec<SocketAddr> {
    let (scheme, _, hosts, _) = split(url);
    let default_port = if scheme.starts_with("postgres") { 5432 } else { 6379 };
    hosts
        .split(',')
        .map(|host| {
            let host = host.trim();
            let with_port = if host
                .rsplit_once(':')
                .is_some_and(|(_, port)| port.parse::<u16>().is_ok())
            {
                host.to_owned()
            } else {
                format!("{host}:{default_port}")
            };
            with_port
                .to_socket_addrs()
                .ok()
                .and_then(|mut addrs| addrs.next())
                .unwrap_or_else(|| panic!("cannot resolve {with_port} (from {url})"))
        })
        .collect()
}

/// The first `host:port` a URL names.
pub fn socket_addr(url: &str) -> SocketAddr {
    socket_addrs(url)[0]
}

/// `url` with its hosts replaced by `addr` (user, database and options kept): the same server,
/// reached through a relay.
pub fn with_addr(url: &str, addr: SocketAddr) -> String {
    let (scheme, userinfo, _, tail) = split(url);
    format!("{scheme}://{userinfo}{addr}{tail}")
}

/// A loopback port that was free a moment ago.
///
/// # Panics
/// If no port can be bound.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind an ephemeral loopback port")
        .port()
}

/// Drops a PostgreSQL schema (a test's private one) and everything in it; errors are ignored, as
/// this is cleanup. Runs on a thread of its own, so it may be called from a test's runtime or a
/// `Drop`.
pub fn drop_postgres_schema(url: &str, schema: &str) {
    let (base, _) = url.split_once('?').unwrap_or((url, ""));
    let schema = schema.replace('"', "");
    clean_up_postgres(base.to_owned(), |client| async move {
        let _ = client.batch_execute("SET lock_timeout = '10s'").await;
        let _ = client
            .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .await;
    });
}

/// Runs `cleanup` with a client of the PostgreSQL server at `url`, on a thread and a runtime of
/// its own (so that it may be called from a test's runtime or a `Drop`), and waits until it is
/// done. A server that cannot be reached is left alone: this is cleanup.
pub(crate) fn clean_up_postgres<F, Fut>(url: String, cleanup: F)
where
    F: FnOnce(tokio_postgres::Client) -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let thread = std::thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
            return;
        };
        runtime.block_on(async move {
            let Ok((client, connection)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await else {
                return;
            };
            tokio::spawn(connection);
            cleanup(client).await;
        });
    });
    let _ = thread.join();
}

/// Cleanup that runs however a test ends: what a test made on a shared server, removed when this
/// guard is dropped.
#[derive(Debug)]
pub enum Cleanup {
    /// A PostgreSQL schema ([`drop_postgres_schema`]).
    PostgresSchema {
        /// The server's URL.
        url: String,
        /// The schema.
        schema: String,
    },
    /// The keys under a Redis prefix ([`delete_redis_keys`]).
    RedisKeys {
        /// The server's URL (a cluster's names its nodes).
        url: String,
        /// The prefix, without its `:`.
        prefix: String,
    },
}

impl Cleanup {
    /// Drops `schema` on the PostgreSQL server of `url` when dropped.
    pub fn postgres_schema(url: &str, schema: &str) -> Self {
        Self::PostgresSchema {
            url: url.to_owned(),
            schema: schema.to_owned(),
        }
    }

    /// Deletes the keys under `prefix:` on every node of the Redis `url` when dropped.
    pub fn redis_keys(url: &str, prefix: &str) -> Self {
        Self::RedisKeys {
            url: url.to_owned(),
            prefix: prefix.to_owned(),
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        match self {
            Self::PostgresSchema { url, schema } => drop_postgres_schema(url, schema),
            Self::RedisKeys { url, prefix } => delete_redis_keys(url, prefix),
        }
    }
}

/// The plain `redis://` URL of every node a Redis URL names (one for a standalone Redis, each
/// seed node of a cluster), user information kept, for direct connections.
pub fn redis_nodes(url: &str) -> Vec<String> {
    let (_, userinfo, _, _) = split(url);
    socket_addrs(url)
        .into_iter()
        .map(|addr| format!("redis://{userinfo}{addr}"))
        .collect()
}

/// Deletes the keys under `prefix:` on every node a Redis URL names (cleanup: errors are
/// ignored). One key per command: on a cluster, keys of different slots cannot share one `UNLINK`.
pub fn delete_redis_keys(url: &str, prefix: &str) {
    for node in redis_nodes(url) {
        let Ok(client) = redis::Client::open(node.as_str()) else {
            continue;
        };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(2)) else {
            continue;
        };
        let keys: Vec<String> = match redis::Commands::scan_match::<_, String>(&mut conn, format!("{prefix}:*")) {
            Ok(iter) => iter.filter_map(Result::ok).collect(),
            Err(_) => continue,
        };
        for key in keys {
            let _: redis::RedisResult<i64> = redis::cmd("UNLINK").arg(&key).query(&mut conn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_rerouted_with_their_user_database_and_options() {
        let relay: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(
            with_addr("postgres://postgres@127.0.0.1:5432/test?schema=a", relay),
            "postgres://postgres@127.0.0.1:4000/test?schema=a"
        );
        assert_eq!(with_addr("redis://127.0.0.1:6379", relay), "redis://127.0.0.1:4000");
        assert_eq!(
            socket_addrs("redis+cluster://u:p@127.0.0.1:7001,127.0.0.1:7002/?prefix=x"),
            vec![
                "127.0.0.1:7001".parse::<SocketAddr>().unwrap(),
                "127.0.0.1:7002".parse().unwrap()
            ]
        );
        assert_eq!(socket_addr("postgres://u@127.0.0.1/test").port(), 5432);
        assert_eq!(with_options("redis://h:1", "a=b"), "redis://h:1?a=b");
        assert_eq!(with_options("redis://h:1/?x=y", "a=b"), "redis://h:1/?x=y&a=b");
        assert_ne!(unique_name("t"), unique_name("t"));
        assert_eq!(
            redis_nodes("redis+cluster://u:p@127.0.0.1:7001,127.0.0.1:7002/?prefix=x"),
            ["redis://u:p@127.0.0.1:7001", "redis://u:p@127.0.0.1:7002"]
        );
        assert_eq!(
            redis_nodes("redis://127.0.0.1:6379/?prefix=x"),
            ["redis://127.0.0.1:6379"]
        );
    }
}
