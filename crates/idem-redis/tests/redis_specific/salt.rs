//! The scope salt on Redis: `older_records_until` counts the records on every node, and only
//! its own prefix's; the salt never expires, outlives the records it counted, and is checked when
//! read; a record too damaged to count is left out.

use std::time::Duration;

use idem_core::store::ScopeSalt;
use idem_core::testkit::{DAY, fresh_id};
use idem_core::{Store, StoreError, UnixMillis};

use crate::common::{Server, connect, fresh_prefix};
use crate::{Cleanup, HOUR, claim, completed, completion, fresh_store, pttl, query};

/// Whether the node at `node_url` (one server, or one node of a cluster) holds `key` itself.
fn held_by(node_url: &str, key: &str) -> bool {
    let client = redis::Client::open(node_url).expect("client");
    let mut conn = client.get_connection().expect("connection");
    // A cluster node answers MOVED for a key of another node's slot.
    redis::cmd("EXISTS").arg(key).query::<i64>(&mut conn) == Ok(1)
}

/// The salt's `older_records_until` is exactly the latest `purge_at` of the store's records
/// wherever that record lives: one round per node (on a cluster, per primary), with the latest
/// record on that node. Records of neighbouring prefixes that a careless `SCAN MATCH` would take
/// for the store's own (a glob character in the prefix, a longer prefix starting with it) are not
/// counted. The salt's key has no expiry, and deleting records leaves it be.
async fn scope_salt_counts_every_node_and_only_its_prefix(server: Server) {
    for node in server.node_urls() {
        let prefix = format!("{}*", fresh_prefix());
        let _cleanup = Cleanup(server, prefix.clone());
        let neighbours = [prefix.replace('*', "x"), format!("{prefix}:sub")];
        let _cleanups: Vec<Cleanup> = neighbours.iter().map(|n| Cleanup(server, n.clone())).collect();
        for neighbour in &neighbours {
            let store = connect(server, neighbour, "").await;
            completed(&store, &fresh_id(), 90 * DAY).await;
        }

        let store = connect(server, &prefix, "").await;
        let (mut latest, mut written, mut on_node) = (None, 0, None);
        while on_node.is_none() || written < 6 {
            let id = fresh_id();
            let now = UnixMillis::now();
            let token = claim(&store, &id, now).await;
            written += 1;
            // The first record that lands on this node is kept longest; the others shorter.
            let the_latest = on_node.is_none() && held_by(&node, &store.record_keys(&id).record);
            let keep = if the_latest {
                30 * DAY
            } else {
                DAY + Duration::from_secs(60 * written)
            };
            let done = completion(now, HOUR, keep);
            if the_latest {
                (on_node, latest) = (Some(id.clone()), Some(done.purge_at));
            }
            store.complete(&id, token, done).await.expect("complete");
            assert!(written < 200, "no record landed on {node}");
        }

        let salt = store
            .scope_salt(ScopeSalt::random(UnixMillis::now()))
            .await
            .expect("scope_salt");
        assert_eq!(
            salt.older_records_until, latest,
            "{server:?}: the latest record is on {node}"
        );
        let key = format!("{prefix}:scope-salt");
        assert_eq!(pttl(server, &key), -1, "the salt never expires");
        let stored: Vec<u8> = query(server, redis::cmd("HGET").arg(&key).arg("salt"));
        assert_eq!(stored, salt.salt, "{key} holds the salt");

        store
            .delete(&on_node.expect("a record on the node"))
            .await
            .expect("delete");
        store
            .purge(UnixMillis::now().plus(365 * DAY), 1000)
            .await
            .expect("purge");
        let again = store
            .scope_salt(ScopeSalt::random(UnixMillis::now()))
            .await
            .expect("scope_salt");
        assert_eq!(again, salt, "the salt outlives the records it counted");
        assert_eq!(pttl(server, &key), -1);
    }
}

/// A salt of the wrong length is reported as corrupt, never used. A record too corrupt to have a
/// `purge_at` (or not even a hash) is left out of `older_records_until` instead of keeping the
/// salt from being made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_scope_salt_is_reported_and_a_corrupt_record_left_out() {
    let server = Server::Standalone;
    let (store, cleanup) = fresh_store(server, "").await;
    let key = format!("{}:scope-salt", cleanup.1);
    let _: i64 = query(
        server,
        redis::cmd("HSET")
            .arg(&key)
            .arg("salt")
            .arg("too short")
            .arg("created_at")
            .arg(1),
    );
    let err = store
        .scope_salt(ScopeSalt::random(UnixMillis::now()))
        .await
        .expect_err("a salt of 9 bytes");
    assert!(
        matches!(err, StoreError::Corrupt(ref why) if why.contains("9 bytes")),
        "{err:?}"
    );

    let (store, _cleanup) = fresh_store(server, "").await;
    let broken = store.record_keys(&fresh_id());
    let _: i64 = query(
        server,
        redis::cmd("HSET")
            .arg(&broken.record)
            .arg("state")
            .arg("completed")
            .arg("purge_at")
            .arg("soon"),
    );
    let not_a_hash = store.record_keys(&fresh_id());
    let _: () = query(server, redis::cmd("SET").arg(&not_a_hash.record).arg("20991231"));
    let purge_at = completed(&store, &fresh_id(), 3 * DAY).await;
    let salt = store
        .scope_salt(ScopeSalt::random(UnixMillis::now()))
        .await
        .expect("scope_salt");
    assert_eq!(salt.older_records_until, Some(purge_at));
}

on_both_servers! {
    scope_salt_counts_every_node_and_only_its_prefix =>
        standalone_scope_salt_counts_every_node_and_only_its_prefix,
        cluster_scope_salt_counts_every_node_and_only_its_prefix;
}
