//! The Redis store of idem: records shared by every instance of a service, on one Redis server
//! (`redis://`), a primary that Sentinel watches (`redis+sentinel://`) or a Redis Cluster
//! (`redis+cluster://`).
//!
//! Every write is one Lua script, atomic and one round trip; a replay writes nothing (counts are
//! added in batches); retention is native key expiry; waiters are woken by (sharded) pub/sub and
//! poll as a fallback. How the keys are laid out, what survives a Redis restart and how waiting
//! and replies work: `docs/stores.md` in the repository; the store contract: `docs/design.md`.
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use idem_core::{Policy, Store, protocol::Protocol};
//! use idem_redis::RedisStore;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // One server, database 0, keys under "idem:" ...
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//! // ... or a cluster, given some of its nodes, with keys under "payments:".
//! let clustered =
//!     RedisStore::connect("redis+cluster://10.0.0.1:7001,10.0.0.2:7002,10.0.0.3:7003?prefix=payments").await?;
//! store.ping().await?;
//! let protocol = Protocol::new(Arc::new(store), Policy::default());
//! # let _ = (protocol, clustered);
//! # Ok(())
//! # }
//! ```
//!
//! Redis keeps everything in memory: run it with `appendonly yes` and `maxmemory-policy
//! noeviction`, or a restart or eviction loses records, and a lost record is a lost protection.
//! Redis also replicates asynchronously: on a primary with replicas, a write counts only once a
//! replica acknowledged it (`WAIT`; the URL's `replicas=`), so a failover loses no claim and no
//! answer. A primary behind Sentinel is named `redis+sentinel://sentinel:26379,.../primary-name`.
#![forbid(unsafe_code)]

mod ack;
mod ack_pool;
mod acknowledged;
mod call;
mod conn;
mod decode;
mod error;
mod keys;
mod notify;
mod origin;
mod script_load;
mod scripts;
mod sentinel;
mod store;
mod timeouts;
mod url;
mod write;

pub use acknowledged::is_unacknowledged;
pub use error::RedisError;
pub use keys::RecordKeys;
pub use store::RedisStore;
