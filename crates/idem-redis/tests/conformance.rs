//! The store conformance suite of `idem-core`, on one Redis server (`IDEM_TEST_REDIS_URL`,
//! default `redis://127.0.0.1:6379`). Every case works under its own random key prefix.

use idem_test_support::redis_store::RedisHarness;

idem_core::conformance_tests!(RedisHarness::standalone());
