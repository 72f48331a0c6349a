//! The test servers and the conformance harness of idem-redis.
//!
//! The servers are found by `idem_test_support::servers` (`IDEM_TEST_REDIS_URL`,
//! `IDEM_TEST_REDIS_CLUSTER_URL`, local defaults), which also says how to start them. Every
//! harness works under a fresh random key prefix and deletes its keys when dropped.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::Store;
use idem_core::testkit::Harness;
use idem_redis::RedisStore;
pub use idem_test_support::servers::with_options;
use idem_test_support::servers::{self, HOW_TO_START};

/// Which server the tests run against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    Standalone,
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

    /// The plain `redis://` URLs of the nodes named in the base URL, for direct connections.
    pub fn node_urls(self) -> Vec<String> {
        servers::redis_nodes(&self.server().configured_url())
    }
}

/// A fresh key prefix, so that concurrent tests and earlier runs never meet.
pub fn fresh_prefix() -> String {
    servers::unique_name("idem-test")
}

/// Connects a store, or panics with a message saying how to start the server.
pub async fn connect(server: Server, prefix: &str, extra_options: &str) -> RedisStore {
    let url = with_options(&server.base_url(), &format!("prefix={prefix}"));
    let url = with_options(&url, extra_options);
    match tokio::time::timeout(Duration::from_secs(20), RedisStore::connect(&url)).await {
        Ok(Ok(store)) => store,
        Ok(Err(err)) => panic!("the {server:?} test Redis is unreachable: {err}; {HOW_TO_START}"),
        Err(_) => panic!("connecting to the {server:?} test Redis at {url} took more than 20 s; {HOW_TO_START}"),
    }
}

/// Deletes every key under `prefix` on every node named in the server's URL.
pub fn delete_keys(server: Server, prefix: &str) {
    servers::delete_redis_keys(&server.server().configured_url(), prefix);
}

/// Opens stores on one server under one fresh prefix; deletes the prefix's keys when dropped.
pub struct RedisHarness {
    server: Server,
    prefix: String,
}

impl RedisHarness {
    pub fn standalone() -> Self {
        Self::new(Server::Standalone)
    }

    pub fn cluster() -> Self {
        Self::new(Server::Cluster)
    }

    pub fn new(server: Server) -> Self {
        Self {
            server,
            prefix: fresh_prefix(),
        }
    }
}

impl Drop for RedisHarness {
    fn drop(&mut self) {
        delete_keys(self.server, &self.prefix);
    }
}

#[async_trait]
impl Harness for RedisHarness {
    async fn open(&self) -> Arc<dyn Store> {
        Arc::new(connect(self.server, &self.prefix, "").await)
    }

    /// Every key under the prefix deleted, on every node: what `FLUSHALL`, or a restart without
    /// persistence, does to the prefix.
    async fn lose_data(&self) {
        let (server, prefix) = (self.server, self.prefix.clone());
        tokio::task::spawn_blocking(move || delete_keys(server, &prefix))
            .await
            .expect("deleting the prefix's keys");
    }
}
