//! Outages and lost replies: connection errors that say what is wrong, a store that rides out
//! Redis going away and coming back, and a `begin` resent after its reply was lost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::store::{Begin, FencingToken};
use idem_core::testkit::{self, DAY, Harness, LEASE, fingerprint, fresh_id};
use idem_core::{Store, StoreError, UnixMillis};
use idem_redis::{RedisError, RedisStore};
use idem_test_support::private::PrivateRedis;
use idem_test_support::servers::free_port;

use crate::common::RedisHarness;
use crate::{SLOW_POLLING, claim, completion, waiting, woken};

/// A server that is not there, and a URL the store does not understand: each error says which,
/// keeps its cause, and never shows a password.
#[tokio::test]
async fn connect_errors_say_what_is_wrong() {
    let port = free_port();
    let err = RedisStore::connect(&format!("redis://127.0.0.1:{port}"))
        .await
        .expect_err("nothing listens there");
    assert!(matches!(err, RedisError::Connect { .. }), "{err:?}");
    assert!(err.to_string().contains("refused"), "{err}");
    assert!(std::error::Error::source(&err).is_some(), "the cause is kept");

    let err = RedisStore::connect("redis://:hunter2@127.0.0.1:1?colour=blue")
        .await
        .expect_err("unknown option");
    assert!(matches!(err, RedisError::InvalidUrl { .. }), "{err:?}");
    assert!(!err.to_string().contains("hunter2"), "{err}");
}

/// Redis down for a while: every operation fails fast as unavailable; back (without its data),
/// both stores reconnect, and notifications work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_recovers_when_redis_comes_back() {
    let mut redis = PrivateRedis::start();
    let url = format!("{}?{SLOW_POLLING}", redis.url());
    let holder = RedisStore::connect(&url).await.expect("connect");
    let waiter = Arc::new(RedisStore::connect(&url).await.expect("connect"));
    let (id, now) = (fresh_id(), UnixMillis::now());
    claim(&holder, &id, now).await;

    redis.kill();
    // Down for a while: every operation fails, and fails fast, while the store keeps trying.
    let down = Instant::now();
    while down.elapsed() < Duration::from_secs(3) {
        let started = Instant::now();
        let err = holder.get(&id).await.expect_err("Redis is down");
        assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "fails fast: {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(waiter.ping().await.is_err());

    redis.restart();
    let back = Instant::now() + Duration::from_secs(20);
    for store in [&holder, &*waiter] {
        while let Err(err) = store.ping().await {
            assert!(Instant::now() < back, "the store did not reconnect: {err}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Nothing was persisted: the record is gone, and both stores work again, notifications
    // included.
    assert!(holder.get(&id).await.expect("get").is_none());
    let (id, now) = (fresh_id(), UnixMillis::now());
    let token = claim(&holder, &id, now).await;
    let wait = waiting(&waiter, &id, token);
    tokio::time::sleep(Duration::from_millis(100)).await;
    holder
        .complete(&id, token, completion(UnixMillis::now(), DAY, 7 * DAY))
        .await
        .expect("complete");
    woken(wait, "after the reconnection").await;
    drop(redis);
}

/// A `begin` sent again with its token (its reply was lost on the way) gets its own claim back,
/// a new one or a takeover, rather than finding the record in flight; another token does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_begin_gets_its_own_claim_back() {
    let harness = RedisHarness::standalone();
    let store = Harness::open(&harness).await;
    let (id, now, fp) = (fresh_id(), UnixMillis::now(), fingerprint("a"));
    let request = |token, now: UnixMillis| testkit::claim(&id, &fp, now, token);
    let first = FencingToken::random();
    for _ in 0..2 {
        assert!(matches!(
            store.begin(request(first, now)).await.expect("begin"),
            Begin::Acquired { recovered: false }
        ));
    }
    let later = now.plus(LEASE * 2);
    let second = FencingToken::random();
    for _ in 0..2 {
        assert!(matches!(
            store.begin(request(second, later)).await.expect("begin"),
            Begin::Acquired { recovered: true }
        ));
    }
    assert!(matches!(
        store
            .begin(request(FencingToken::random(), later))
            .await
            .expect("begin"),
        Begin::Existing(_)
    ));
}
