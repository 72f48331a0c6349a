//! A Redis key prefix of one test's own on the machine's Redis or Redis Cluster, the idem store
//! opened under it, and the conformance harness of idem-core's testkit on it. Every key under the
//! prefix is deleted when the harness is dropped.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::Store;
use idem_core::testkit::Harness;
use idem_redis::RedisStore;

use crate::servers::{self, HOW_TO_START, with_options};

/// Which server the tests run against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// The machine's standalone Redis.
    Standalone,
    /// The three-node Redis Cluster.
    Cluster,
}

impl Server {
    /// The shared test server this names.
    fn server(self) -> servers::Server {
        match self {
            Self::Standalone => servers::Server::Redis,
            Self::Cluster => servers::Server::RedisCluster,
        }
    }

    /// The server's URL, once it answers (else a panic saying how to start it).
    pub fn base_url(self) -> String {
        self.server().url()
    }

    /// The server as a store URL for `idem serve --store`, under a key prefix no other test uses
    /// (`e2e_…`).
    pub fn store_url(self) -> String {
        format!("{}/?prefix={}", self.base_url(), servers::unique_name("e2e"))
    }

    /// The plain `redis://` URLs of the nodes named in the base URL, for direct connections.
    pub fn node_urls(self) -> Vec<String> {
        servers::redis_nodes(&self.server().configured_url())
    }
}

/// The machine's Redis as a store URL for `idem serve --store`, under a key prefix no other test
/// uses (`e2e_…`).
pub fn store_url() -> String {
    Server::Standalone.store_url()
}

/// The Redis Cluster as a store URL for `idem serve --store`, under a key prefix of its own.
pub fn cluster_store_url() -> String {
    Server::Cluster.store_url()
}

/// A fresh key prefix, so that concurrent tests and earlier runs never meet.
pub fn fresh_prefix() -> String {
    servers::unique_name("idem-test")
}

/// Connects a store, or panics with a message saying how to start the server.
pub async fn connect(server: Server, prefix: &str, extra_options: &str) -> RedisStore {
    let url = with_options(&server.base_url(), &format!("prefix={prefix}"));
    connect_url(&with_options(&url, extra_options)).await
}

/// Connects a store on `url` (a prefix of the caller's in it), within 20 s, or panics with a
/// message saying how to start the server.
pub async fn connect_url(url: &str) -> RedisStore {
    match tokio::time::timeout(Duration::from_secs(20), RedisStore::connect(url)).await {
        Ok(Ok(store)) => store,
        Ok(Err(err)) => panic!("the test Redis at {url} is unreachable: {err}; {HOW_TO_START}"),
        Err(_) => panic!("connecting to the test Redis at {url} took more than 20 s; {HOW_TO_START}"),
    }
}

/// Deletes every key under `prefix` on every node named in the server's URL.
pub fn delete_keys(server: Server, prefix: &str) {
    servers::delete_redis_keys(&server.server().configured_url(), prefix);
}

/// A key prefix of one test's own on a server ([`fresh_prefix`]), whose keys are deleted when it
/// is dropped, however the test ends.
#[derive(Debug)]
pub struct TestPrefix {
    server: Server,
    name: String,
}

impl TestPrefix {
    /// A fresh prefix on `server`.
    pub fn new(server: Server) -> Self {
        Self {
            server,
            name: fresh_prefix(),
        }
    }

    /// The prefix.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connects a store under this prefix with `extra_options` ([`connect`]).
    pub async fn connect(&self, extra_options: &str) -> RedisStore {
        connect(self.server, &self.name, extra_options).await
    }
}

impl Drop for TestPrefix {
    fn drop(&mut self) {
        delete_keys(self.server, &self.name);
    }
}

/// Opens stores on one server under one fresh prefix; deletes the prefix's keys when dropped.
#[derive(Debug)]
pub struct RedisHarness {
    prefix: TestPrefix,
}

impl RedisHarness {
    /// On the standalone Redis.
    pub fn standalone() -> Self {
        Self::new(Server::Standalone)
    }

    /// On the Redis Cluster.
    pub fn cluster() -> Self {
        Self::new(Server::Cluster)
    }

    /// On `server`, under a fresh prefix.
    pub fn new(server: Server) -> Self {
        Self {
            prefix: TestPrefix::new(server),
        }
    }
}

#[async_trait]
impl Harness for RedisHarness {
    async fn open(&self) -> Arc<dyn Store> {
        Arc::new(self.prefix.connect("").await)
    }

    /// Every key under the prefix deleted, on every node: what `FLUSHALL`, or a restart without
    /// persistence, does to the prefix.
    async fn lose_data(&self) {
        let (server, prefix) = (self.prefix.server, self.prefix.name.clone());
        tokio::task::spawn_blocking(move || delete_keys(server, &prefix))
            .await
            .expect("deleting the prefix's keys");
    }
}
