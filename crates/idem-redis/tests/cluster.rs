//! The store conformance suite of `idem-core`, on a Redis Cluster (`IDEM_TEST_REDIS_CLUSTER_URL`,
//! default `redis+cluster://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003`; start one with
//! `crates/idem-redis/scripts/start-cluster.sh`).

mod cluster {
    use idem_test_support::redis_store::RedisHarness;

    idem_core::conformance_tests!(RedisHarness::cluster());
}

/// A cluster whose node that held the salt hash lost its data, while the other nodes kept theirs
/// (and their copies of the salt): the salt is made again from a surviving copy, not anew, so the
/// records the other nodes kept are still found under their callers' scopes, and instances of
/// before and after agree.
mod salt_node_lost {
    use idem_core::UnixMillis;
    use idem_core::store::{Begin, BeginRequest, FencingToken, ScopeSalt};
    use idem_core::testkit::{claim, fingerprint, fresh_id};

    use idem_test_support::redis_store::{Server, connect, delete_keys, fresh_prefix};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_salt_is_made_again_from_a_copy_a_slot_kept() {
        let prefix = fresh_prefix();
        let before = connect(Server::Cluster, &prefix, "").await;
        let (now, fp) = (UnixMillis::now(), fingerprint("{}"));
        let salt = idem_core::Store::scope_salt(&before, ScopeSalt::random(now))
            .await
            .expect("scope_salt");
        // Claims in many slots write the copies there.
        for _ in 0..32 {
            let id = fresh_id();
            let begun = idem_core::Store::begin(
                &before,
                BeginRequest {
                    identity: Some(salt.identity),
                    ..claim(&id, &fp, now, FencingToken::random())
                },
            )
            .await;
            assert!(matches!(begun, Ok(Begin::Acquired { recovered: false })), "{begun:?}");
        }
        let salt_key = format!("{prefix}:scope-salt");
        let nodes = Server::Cluster.node_urls();
        tokio::task::spawn_blocking(move || {
            for node in nodes {
                let mut conn = redis::Client::open(node.as_str())
                    .and_then(|c| c.get_connection())
                    .expect("a node");
                // Only the node that holds the key deletes it; the others answer MOVED, ignored.
                let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(&salt_key).query(&mut conn);
            }
        })
        .await
        .expect("the salt hash deleted");

        let after = connect(Server::Cluster, &prefix, "").await;
        let remade = idem_core::Store::scope_salt(&after, ScopeSalt::random(now))
            .await
            .expect("scope_salt");
        assert_eq!(remade, salt, "the salt is the copy's, not a new one");
        assert_eq!(
            idem_core::Store::scope_salt(&before, ScopeSalt::random(now))
                .await
                .expect("scope_salt"),
            salt
        );
        tokio::task::spawn_blocking(move || delete_keys(Server::Cluster, &prefix))
            .await
            .expect("the test's keys deleted");
    }
}
