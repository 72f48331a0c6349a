//! Notifications: a waiter on another connection is woken by a message when its claim ends
//! (completed, or taken over after its lease), the waiters of one store share one subscription
//! and leave none behind, and a delete made while the pub/sub connection is down is not missed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::store::{Begin, FencingToken};
use idem_core::testkit::{self, DAY, LEASE, fingerprint, fresh_id};
use idem_core::{Store, UnixMillis};
use idem_redis::RedisStore;
use idem_test_support::private::PrivateRedis;

use crate::common::{Server, connect};
use crate::{SLOW_POLLING, claim, completion, fresh_store, query, waiting, woken};

/// How a held claim ends for its waiter.
#[derive(Debug, Clone, Copy)]
enum Ending {
    /// Its holder completes it.
    Completion,
    /// Its lease ended, and the same request takes it over.
    Takeover,
}

/// A waiter on one connection is woken by the end of a claim made on another, in each way a
/// claim ends for it, without polling.
async fn a_waiter_is_woken_without_polling(server: Server) {
    let (holder, cleanup) = fresh_store(server, SLOW_POLLING).await;
    let waiter = Arc::new(connect(server, &cleanup.1, SLOW_POLLING).await);
    for ending in [Ending::Completion, Ending::Takeover] {
        let (id, now) = (fresh_id(), UnixMillis::now());
        let token = claim(&holder, &id, now).await;
        let wait = waiting(&waiter, &id, token);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !wait.is_finished(),
            "{ending:?}: the waiter waits while the claim is held"
        );
        let started = Instant::now();
        match ending {
            Ending::Completion => holder
                .complete(&id, token, completion(UnixMillis::now(), DAY, 7 * DAY))
                .await
                .expect("complete"),
            Ending::Takeover => {
                let later = now.plus(LEASE * 2);
                let taken = holder
                    .begin(testkit::claim(&id, &fingerprint("a"), later, FencingToken::random()))
                    .await
                    .expect("begin");
                assert!(matches!(taken, Begin::Acquired { recovered: true }), "{taken:?}");
            }
        }
        woken(wait, &format!("after the {ending:?}")).await;
        eprintln!("{server:?}: woken {:?} after the {ending:?}", started.elapsed());
    }
}

on_both_servers! {
    a_waiter_is_woken_without_polling =>
        standalone_a_completion_or_a_takeover_wakes_a_waiter_without_polling,
        cluster_a_completion_or_a_takeover_wakes_a_waiter_without_polling;
}

/// The number of subscribers of `channel` on the standalone server.
fn subscribers(channel: &str) -> i64 {
    let (_, count): (String, i64) = query(Server::Standalone, redis::cmd("PUBSUB").arg("NUMSUB").arg(channel));
    count
}

/// Waits until `channel` has no subscriber left (5 s at most); `who` says whose leaving it waits for.
async fn until_unsubscribed(channel: &str, who: &str) {
    let gone = Instant::now() + Duration::from_secs(5);
    while subscribers(channel) != 0 {
        assert!(Instant::now() < gone, "{who} unsubscribes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_one_store_share_one_subscription_and_leave_none() {
    let server = Server::Standalone;
    let (holder, cleanup) = fresh_store(server, "").await;
    let waiter = Arc::new(connect(server, &cleanup.1, SLOW_POLLING).await);
    let (id, now) = (fresh_id(), UnixMillis::now());
    let token = claim(&holder, &id, now).await;
    let channel = holder.record_keys(&id).channel;

    let waits: Vec<_> = (0..5).map(|_| waiting(&waiter, &id, token)).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(subscribers(&channel), 1, "five waiters of one store, one subscription");
    holder
        .complete(&id, token, completion(UnixMillis::now(), DAY, 7 * DAY))
        .await
        .expect("complete");
    for wait in waits {
        woken(wait, "after the completion").await;
    }
    until_unsubscribed(&channel, "the last waiter").await;

    // A waiter that gives up (its future is dropped) unsubscribes too.
    let (id, now) = (fresh_id(), UnixMillis::now());
    let token = claim(&holder, &id, now).await;
    let channel = holder.record_keys(&id).channel;
    let far = tokio::time::Instant::now() + Duration::from_secs(30);
    let abandoned = tokio::time::timeout(Duration::from_millis(300), waiter.wait(&id, token, far)).await;
    assert!(abandoned.is_err(), "the wait was still waiting");
    until_unsubscribed(&channel, "a cancelled waiter").await;
}

/// The pub/sub connection killed by the server (`CLIENT KILL TYPE pubsub`) and a delete made
/// before it is back: the replay cache does not keep the deleted answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_while_the_pubsub_connection_is_down_is_not_missed_by_the_replay_cache() {
    let redis = PrivateRedis::start();
    let here = RedisStore::connect(&redis.url()).await.expect("connect");
    let there = RedisStore::connect(&redis.url()).await.expect("connect");
    let url = redis.url();
    let cut = async move {
        let client = redis::Client::open(url.as_str()).expect("the private server's URL");
        let mut admin = client.get_multiplexed_async_connection().await.expect("connect");
        let killed: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("pubsub")
            .query_async(&mut admin)
            .await
            .expect("CLIENT KILL");
        assert!(killed >= 2, "both stores' pub/sub connections: {killed}");
    };
    testkit::a_delete_while_the_channel_is_down_is_not_missed(Arc::new(here), Arc::new(there), cut).await;
}
