//! The test servers and the conformance harness of idem-redis.
//!
//! `IDEM_TEST_REDIS_URL` (default `redis://127.0.0.1:6379`) names one server and
//! `IDEM_TEST_REDIS_CLUSTER_URL` (default `redis+cluster://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003`)
//! a cluster. Every harness works under a fresh random key prefix and deletes its keys when dropped.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::Store;
use idem_core::testkit::Harness;
use idem_redis::RedisStore;
use redis::Commands;

const STANDALONE_DEFAULT: &str = "redis://127.0.0.1:6379";
const CLUSTER_DEFAULT: &str = "redis+cluster://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003";

/// Which server the tests run against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    Standalone,
    Cluster,
}

impl Server {
    pub fn base_url(self) -> String {
        let (var, default) = match self {
            Self::Standalone => ("IDEM_TEST_REDIS_URL", STANDALONE_DEFAULT),
            Self::Cluster => ("IDEM_TEST_REDIS_CLUSTER_URL", CLUSTER_DEFAULT),
        };
        std::env::var(var)
            .ok()
            .filter(|url| !url.trim().is_empty())
            .unwrap_or_else(|| default.to_owned())
    }

    fn how_to_start(self) -> &'static str {
        match self {
            Self::Standalone => {
                "start one with `redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no`, or point IDEM_TEST_REDIS_URL at one"
            }
            Self::Cluster => {
                "start one with `crates/idem-redis/scripts/start-cluster.sh` (three nodes on 127.0.0.1:7001-7003), or point IDEM_TEST_REDIS_CLUSTER_URL at one"
            }
        }
    }

    /// The plain `redis://` URLs of the nodes named in the base URL, for direct connections.
    pub fn node_urls(self) -> Vec<String> {
        let base = self.base_url();
        match self {
            Self::Standalone => vec![base.split('?').next().unwrap_or(&base).to_owned()],
            Self::Cluster => {
                let rest = base.split_once("://").map_or(base.as_str(), |(_, rest)| rest);
                let authority = rest.split(['/', '?']).next().unwrap_or(rest);
                let (userinfo, hosts) = match authority.rsplit_once('@') {
                    Some((userinfo, hosts)) => (format!("{userinfo}@"), hosts),
                    None => (String::new(), authority),
                };
                hosts
                    .split(',')
                    .map(|host| format!("redis://{userinfo}{}", host.trim()))
                    .collect()
            }
        }
    }
}

/// A fresh key prefix, so that concurrent tests and earlier runs never meet.
pub fn fresh_prefix() -> String {
    format!("idem-test-{}", uuid::Uuid::new_v4().simple())
}

/// `url` with more options in its query string.
pub fn with_options(url: &str, options: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{options}")
}

/// Connects a store, or panics with a message saying how to start the server.
pub async fn connect(server: Server, prefix: &str, extra_options: &str) -> RedisStore {
    let mut url = with_options(&server.base_url(), &format!("prefix={prefix}"));
    if !extra_options.is_empty() {
        url = with_options(&url, extra_options);
    }
    match tokio::time::timeout(Duration::from_secs(20), RedisStore::connect(&url)).await {
        Ok(Ok(store)) => store,
        Ok(Err(err)) => panic!(
            "the {server:?} test Redis is unreachable: {err}; {}",
            server.how_to_start()
        ),
        Err(_) => panic!(
            "connecting to the {server:?} test Redis at {url} took more than 20 s; {}",
            server.how_to_start()
        ),
    }
}

/// Deletes every key under `prefix` on every node named in the server's URL.
pub fn delete_keys(server: Server, prefix: &str) {
    for node in server.node_urls() {
        let Ok(client) = redis::Client::open(node.as_str()) else {
            continue;
        };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(1)) else {
            continue;
        };
        let keys: Vec<String> = match conn.scan_match::<_, String>(format!("{prefix}:*")) {
            Ok(iter) => iter.filter_map(Result::ok).collect(),
            Err(_) => continue,
        };
        for key in keys {
            // One key per command: on a cluster, keys of different slots cannot share one DEL.
            let _: redis::RedisResult<i64> = redis::cmd("UNLINK").arg(&key).query(&mut conn);
        }
    }
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
}
