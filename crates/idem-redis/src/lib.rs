//! The Redis store of idem: records shared by every instance of a service, on one Redis server
//! (`redis://`) or a Redis Cluster (`redis+cluster://`).
//!
//! Every write (`begin`, `complete`, `release`, `renew`, `checkpoint`) is one Lua script, so it is atomic and
//! costs one round trip; a replay is answered by `begin` itself, and writes nothing: the store
//! counts replays in memory and adds them to their records every 500 ms, so `replays` read from
//! another instance may lag by that much, and an instance that dies loses at most its last
//! interval's counts. Retention is native: keys expire by themselves, relative to the caller's
//! clock. Waiters are woken by pub/sub (sharded pub/sub on a cluster) and poll as a fallback.
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use idem_core::{Policy, Protocol, Store};
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
//! # Keys
//!
//! A record is three keys and a channel that share one cluster hash tag, the hex SHA-256 of the
//! length-prefixed scope and key (see [`RecordKeys`]):
//!
//! * `PREFIX:{TAG}:rec`, a hash: `state` (`in-flight`, `completed` or `unknown`), `fingerprint`,
//!   `digest`, `token`, `lease_until`, `recovered`, `created_at`, `completed_at`, `expires_at`,
//!   `purge_at`, `replays` (times in Unix milliseconds; `recovered` says whether the current claim
//!   is a takeover, so that a `begin` the client resends after losing its reply gets its own claim
//!   back). It expires at `purge_at`: the tombstone's end of the claim, or of the unknown outcome it
//!   was released as (never before a running lease ends; a claim written before claims carried a
//!   `purge_at` of their own, 7 days after its lease ends);
//! * `PREFIX:{TAG}:body`, the stored answer, which expires at `expires_at`: a completed record
//!   then remains as a tombstone (its fingerprint, no answer) until `purge_at`;
//! * `PREFIX:{TAG}:checkpoints`, a hash of the run's checkpoints, present once one is written:
//!   `count` (how many names), `name:<i>` (the i-th name first written, from 1) and
//!   `value:<name>` (its latest value). It outlives a takeover and a release as unknown, and
//!   goes when the record completes, is forgotten or deleted, or is claimed anew; it always has
//!   the record's own expiry (`PEXPIREAT` to the record's `PEXPIRETIME`, whenever that is set or
//!   moved), so it never outlives the record;
//! * `PREFIX:{TAG}:wake`, the channel that `complete`, `release` and a takeover publish on
//!   (`SPUBLISH` on a cluster, from inside the script: the channel lives on the record's shard).
//!
//! [`Store::purge`](idem_core::Store::purge) therefore has nothing to do and reports nothing.
//! Expiries are set relative to the `now` the caller passes (`begin`), or `completed_at`
//! (`complete`); `release` and `renew` move the existing expiry by as much as `purge_at` moves.
//! The scripts also compare the stored times with the caller's `now` (`get`, which has none,
//! with this process's clock), so a record is not used after its time even while Redis still
//! holds it: native expiry may lag by as long as the write took to reach Redis.
//!
//! Besides its records, a store has one key of its own: `PREFIX:scope-salt`, a hash holding the
//! [`ScopeSalt`](idem_core::ScopeSalt) that keys the hash of credential scopes: `salt` (32
//! bytes), `created_at` and, if the store held records when it was made, `older_records_until`
//! (the latest `purge_at` among them, found by a `SCAN` of every node, every primary of a cluster).
//! A script makes it only if the key does not exist, so instances that race all get the same one.
//! It has no expiry and no operation deletes it.
//!
//! # Durability
//!
//! Redis keeps everything in memory. What survives a restart of Redis depends on its
//! persistence settings, not on this crate:
//!
//! * `appendonly yes` with `appendfsync everysec` (the usual choice) loses at most about one
//!   second of writes when the machine crashes, nothing when only Redis restarts;
//!   `appendfsync always` loses nothing, at the cost of an fsync per write.
//! * RDB snapshots only (`save 60 1000` and the like) lose every write since the last snapshot:
//!   minutes of records.
//! * Neither (`save ""`, `appendonly no`, as in the tests): a restart loses every record.
//!
//! A lost record is a lost protection: a retry of a request whose record was lost runs again,
//! and a lost tombstone turns `key-expired` into a silent re-run. A lost scope salt is worse: a
//! new one is made, and every record stored under a credential scope is no longer found. Keep
//! `maxmemory-policy` at `noeviction` (or a `volatile-*` policy on a Redis used for nothing else:
//! those never evict the salt, which has no expiry), or Redis may evict live records under memory
//! pressure; with replicas, a failover can lose the writes the replica
//! had not received yet (`WAIT` is not used).
//!
//! # Waiting
//!
//! `wait` subscribes to the record's channel before it checks the record, then sleeps until a
//! message, a poll (the first after a quarter of `poll_interval`, doubling up to
//! `poll_interval`, default 250 ms) or the deadline. All waiters of a store share one pub/sub
//! connection (on a cluster, one per node), never the one that runs commands: the first waiter of
//! a channel subscribes, the last unsubscribes. Messages published while that connection was down
//! are lost: once it is back (on one server), every waiter looks at its record again, and polling
//! covers the rest.
//!
//! # Replies
//!
//! Every script's reply starts with the key of the record and a nonce of the call it answers. A
//! reply that reaches another call (a connection whose replies are shifted, as a redis crate
//! resubscription can leave one) is an error, [`StoreError::Unavailable`](idem_core::StoreError),
//! never an answer, and the connection is replaced.
#![forbid(unsafe_code)]

mod conn;
mod error;
mod keys;
mod notify;
mod scripts;
mod store;
mod url;

pub use error::RedisError;
pub use keys::RecordKeys;
pub use store::RedisStore;
