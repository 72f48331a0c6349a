//! What `redis_specific.rs` takes from here: the Redis test servers, fresh key prefixes, stores
//! under them and the conformance harness, all of them in `idem_test_support::redis_store` (where
//! the other test binaries import them from).

pub(crate) use idem_test_support::redis_store::{RedisHarness, Server, connect, delete_keys, fresh_prefix};
