//! What the conformance suite cannot see: that waiters are woken by notifications rather than by
//! polling, that a record's keys share one cluster slot, that expiry is native and relative to the
//! caller's clock, that checkpoints expire with their record, that waiters share one subscription,
//! that a store rides out an outage, that the scope salt counts the records on every node (and
//! only its prefix's), never expires and is checked when read, that replay counts are written
//! later, in batches, and that `list` leaves out the records it cannot name.
//!
//! The notification tests set `poll_interval=60s`: the first poll would come after 15 s, so a
//! waiter that returns within 10 s was woken by a message.
//!
//! This file holds what the parts share: a store under a fresh prefix and its cleanup, claims and
//! completions, direct commands to the server, and [`on_both_servers!`], which runs a case on the
//! standalone server and on the cluster. The cases are in `tests/redis_specific/`, by concern.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Server, connect, delete_keys, fresh_prefix};
use idem_core::testkit::{self, fingerprint};
use idem_core::{
    Store, UnixMillis,
    store::{Begin, Completion, FencingToken, RecordId, WaitOutcome},
};
use idem_redis::RedisStore;
use tokio::task::JoinHandle;

/// Generates, for each `case => standalone_test, cluster_test`, two tests: `case(Server)` run on
/// the standalone server, and on the cluster.
macro_rules! on_both_servers {
    ($($case:ident => $standalone:ident, $cluster:ident;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $standalone() {
                $case(crate::common::Server::Standalone).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $cluster() {
                $case(crate::common::Server::Cluster).await;
            }
        )*
    };
}

/// The cases, by concern: notifications, where keys live and when they expire, list and origins,
/// the scope salt, damaged data, outages, and what each call costs the server.
mod redis_specific {
    mod corruption;
    mod expiry;
    mod listing;
    mod notifications;
    mod outages;
    mod round_trips;
    mod salt;
}

const HOUR: Duration = Duration::from_secs(3600);
const SLOW_POLLING: &str = "poll_interval=60s";

/// Deletes the prefix's keys when the test ends, whatever happens.
struct Cleanup(Server, String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        delete_keys(self.0, &self.1);
    }
}

/// A store on `server` under a fresh prefix, with `options` added to its URL; the prefix's keys
/// are deleted when the [`Cleanup`] is dropped. Another store on the same prefix:
/// `connect(server, &cleanup.1, options)`.
async fn fresh_store(server: Server, options: &str) -> (RedisStore, Cleanup) {
    let prefix = fresh_prefix();
    let store = connect(server, &prefix, options).await;
    (store, Cleanup(server, prefix))
}

/// Claims `id` at `now` for `POST /pay` with body `a` (the suite's claim); returns the token.
async fn claim(store: &dyn Store, id: &RecordId, now: UnixMillis) -> FencingToken {
    let token = FencingToken::random();
    match store
        .begin(testkit::claim(id, &fingerprint("a"), now, token))
        .await
        .expect("begin")
    {
        Begin::Acquired { .. } => token,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// The answer `answer` completed at `at`, replayable for `ttl`, its record kept for `keep`.
fn completion(at: UnixMillis, ttl: Duration, keep: Duration) -> Completion {
    testkit::completion(b"answer", at, ttl, keep)
}

/// A completed record under `store`, kept until `keep` from now; returns its `purge_at`.
async fn completed(store: &RedisStore, id: &RecordId, keep: Duration) -> UnixMillis {
    let now = UnixMillis::now();
    let token = claim(store, id, now).await;
    let done = completion(now, HOUR, keep);
    let purge_at = done.purge_at;
    store.complete(id, token, done).await.expect("complete");
    purge_at
}

/// `waiter` waiting, in a task of its own, for `token`'s claim on `id` to end (30 s at most).
fn waiting(
    waiter: &Arc<RedisStore>,
    id: &RecordId,
    token: FencingToken,
) -> JoinHandle<Result<WaitOutcome, idem_core::StoreError>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let (waiter, id) = (Arc::clone(waiter), id.clone());
    tokio::spawn(async move { waiter.wait(&id, token, deadline).await })
}

/// Asserts that `wait` ([`waiting`]) returned [`WaitOutcome::Changed`] within 10 s: woken by a
/// message, since the first poll of a store with [`SLOW_POLLING`] comes later. `when` says after
/// what, for the message.
async fn woken(wait: JoinHandle<Result<WaitOutcome, idem_core::StoreError>>, when: &str) {
    let outcome = tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .unwrap_or_else(|_| panic!("the waiter was not woken within 10 s {when}: the notification was lost"))
        .expect("task")
        .expect("wait");
    assert_eq!(outcome, WaitOutcome::Changed);
}

/// Runs one command on the server (routed by key on a cluster).
fn query<T: redis::FromRedisValue>(server: Server, cmd: &redis::Cmd) -> T {
    let nodes = server.node_urls();
    match server {
        Server::Standalone => {
            let client = redis::Client::open(nodes[0].as_str()).expect("client");
            let mut conn = client.get_connection().expect("connection");
            cmd.query(&mut conn).expect("query")
        }
        Server::Cluster => {
            let client = redis::cluster::ClusterClient::new(nodes).expect("cluster client");
            let mut conn = client.get_connection().expect("cluster connection");
            cmd.query(&mut conn).expect("query")
        }
    }
}

/// The key's time to live in milliseconds (`-1`: none, `-2`: no key).
fn pttl(server: Server, key: &str) -> i64 {
    query(server, redis::cmd("PTTL").arg(key))
}

/// How many of `keys` exist.
fn present(server: Server, keys: &[&str]) -> i64 {
    query(server, redis::cmd("EXISTS").arg(keys))
}
