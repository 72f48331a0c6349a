//! The store servers the gateway's tests run against: the machine's PostgreSQL and Redis (and
//! the three-node Redis Cluster that `bash .ci/services` starts; found, and their how-to-start
//! message given, by `idem_test_support::servers`), each test isolated in a schema or key prefix
//! of its own. Servers a test kills and restarts are `idem_test_support::private`'s.

#![allow(dead_code)]

/// A name no other test uses.
fn unique(prefix: &str) -> String {
    idem_test_support::servers::unique_name(prefix)
}

/// The machine's PostgreSQL, in a schema of this test's own. A server that does not answer fails
/// the test, saying how to start it (`bash .ci/services`).
pub(crate) fn postgres_url() -> String {
    let base = idem_test_support::servers::postgres_url();
    format!("{base}?schema={}", unique("e2e"))
}

/// The machine's Redis, under a key prefix of this test's own.
pub(crate) fn redis_url() -> String {
    let base = idem_test_support::servers::redis_url();
    format!("{base}/?prefix={}", unique("e2e"))
}

/// The three-node Redis Cluster, under a key prefix of this test's own.
pub(crate) fn redis_cluster_url() -> String {
    let base = idem_test_support::servers::redis_cluster_url();
    format!("{base}/?prefix={}", unique("e2e"))
}
