//! A store that lost its data (restarted without persistence, flushed, failed over to an empty
//! node, its schema migrated anew) under running `idem serve` instances, on every store:
//! * an instance that read the salt before the loss and one started after it agree on every
//!   caller's scope, so a key sent through one and retried through the other runs once;
//! * no instance replays from its memory an answer the store no longer holds.

mod common;

use common::{Gateway, Reply, Upstream, count, lose_store_data, new_key, send};
use idem_core::replay_cache::IDENTITY_CHECK;
use idem_test_support::{postgres_store, redis_store};

const BODY: &str = r#"{"amount":4200}"#;

async fn pay(gw: &Gateway, key: &str, caller: &str) -> Reply {
    let request = gw
        .post("/pay", BODY)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {caller}"))
        .header("idempotency-key", key);
    send(request).await
}

/// Gateway `a` reads the salt; the store loses its data; gateway `c` starts and makes a new salt.
/// Every key sent through one after the loss and retried through the other runs once, for every
/// caller: `a` finds at its first claim that the store is not the one it knew and reads the salt
/// again.
async fn instances_of_before_and_after_agree(store: &str) {
    let upstream = Upstream::start().await;
    let a = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let first = pay(&a, &new_key(), "alice").await;
    assert_eq!(first.status, 201, "{first}");

    lose_store_data(store).await;
    let c = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let runs = count(&upstream.state.pay);
    for (through, then) in [(&a, &c), (&c, &a)] {
        for caller in ["alice", "bob"] {
            let key = new_key();
            let ran = pay(through, &key, caller).await;
            assert_eq!((ran.status, ran.replayed()), (201, false), "{ran}");
            let retried = pay(then, &key, caller).await;
            assert_eq!((retried.status, retried.replayed()), (201, true), "{retried}");
            assert_eq!(retried.charge(), ran.charge(), "the retry got the first run's answer");
        }
    }
    assert_eq!(
        count(&upstream.state.pay),
        runs + 4,
        "every key ran once at the upstream"
    );
}

/// Gateways `a` and `b` both answered a key (`b` from its replay cache the second time); the
/// store loses its data; past the identity check, `a` runs the key again (its record is gone) and
/// `b` then replays that run, never the one the store no longer holds.
async fn no_instance_replays_what_the_store_lost(store: &str) {
    let upstream = Upstream::start().await;
    let a = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let b = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let key = new_key();
    let before = pay(&a, &key, "alice").await;
    assert_eq!(before.status, 201, "{before}");
    for _ in 0..2 {
        let replayed = pay(&b, &key, "alice").await;
        assert_eq!(
            (replayed.replayed(), replayed.charge()),
            (true, before.charge()),
            "{replayed}"
        );
    }

    lose_store_data(store).await;
    tokio::time::sleep(IDENTITY_CHECK * 3).await;
    let again = pay(&a, &key, "alice").await;
    assert_eq!((again.status, again.replayed()), (201, false), "{again}");
    assert_ne!(again.charge(), before.charge(), "a lost record runs again");
    let replayed = pay(&b, &key, "alice").await;
    assert_eq!(
        (replayed.replayed(), replayed.charge()),
        (true, again.charge()),
        "b replays the run the store holds, not the one it lost: {replayed}"
    );
}

/// The stores, each in a test of its own (SQLite in a file the test's gateways share).
macro_rules! on_every_store {
    ($($name:ident => $url:expr),* $(,)?) => {
        $(
            mod $name {
                use super::*;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn instances_of_before_and_after_agree_on_every_scope() {
                    let dir = tempfile::tempdir().expect("a temp dir");
                    let url: fn(&std::path::Path) -> String = $url;
                    instances_of_before_and_after_agree(&url(dir.path())).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn no_instance_replays_what_the_store_lost() {
                    let dir = tempfile::tempdir().expect("a temp dir");
                    let url: fn(&std::path::Path) -> String = $url;
                    super::no_instance_replays_what_the_store_lost(&url(dir.path())).await;
                }
            }
        )*
    };
}

on_every_store! {
    sqlite => common::store_url_in,
    postgres => |_| postgres_store::store_url(),
    redis => |_| redis_store::store_url(),
    redis_cluster => |_| redis_store::cluster_store_url(),
}
