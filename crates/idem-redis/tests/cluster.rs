//! The store conformance suite of `idem-core`, on a Redis Cluster (`IDEM_TEST_REDIS_CLUSTER_URL`,
//! default `redis+cluster://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003`; start one with
//! `crates/idem-redis/scripts/start-cluster.sh`).

mod common;

mod cluster {
    use super::common::RedisHarness;

    idem_core::conformance_tests!(RedisHarness::cluster());
}
