//! Two gateways on one SQLite file, as two pods behind a load balancer: concurrent copies of one
//! request, split between them, reach the upstream once.

mod common;

use std::time::Duration;

use common::{Gateway, Upstream, count, new_key, send, try_send, wait_for_count};

const COPIES: usize = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_copies_across_two_instances_run_once() {
    let upstream = Upstream::start().await;
    let a = Gateway::start(&upstream.url(), &[]).await;
    let b = Gateway::start_on_store(&upstream.url(), &a.store, &[]).await;
    let key = new_key();
    let body = r#"{"amount":4200,"currency":"EUR"}"#;

    let mut tasks = Vec::with_capacity(COPIES);
    for i in 0..COPIES {
        let gw = if i % 2 == 0 { &a } else { &b };
        let request = gw
            .post("/pay?delay=300", body)
            .header("content-type", "application/json")
            .header("idempotency-key", key.as_str());
        tasks.push(tokio::spawn(send(request)));
    }
    let mut replies = Vec::with_capacity(COPIES);
    for task in tasks {
        replies.push(task.await.expect("a copy's task"));
    }

    for (i, reply) in replies.iter().enumerate() {
        assert_eq!(
            reply.status,
            201,
            "copy {i} (instance {}): {reply}",
            if i % 2 == 0 { "a" } else { "b" }
        );
    }
    let first = &replies[0].body;
    for (i, reply) in replies.iter().enumerate() {
        assert_eq!(&reply.body, first, "copy {i} got another body: {reply}");
    }
    let replayed = replies.iter().filter(|r| r.replayed()).count();
    assert_eq!(replayed, COPIES - 1, "all copies but the one that ran are replays");
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_holders_key_is_taken_over_and_the_rerun_is_marked_recovered() {
    let upstream = Upstream::start().await;
    let mut a = Gateway::start(&upstream.url(), &["--lease", "1s"]).await;
    let b = Gateway::start_on_store(&upstream.url(), &a.store, &["--lease", "1s"]).await;
    let key = new_key();
    let body = r#"{"amount":7}"#;
    let request = |gw: &Gateway| {
        gw.post("/pay?delay=2000", body)
            .header("content-type", "application/json")
            .header("idempotency-key", key.as_str())
    };

    let lost = tokio::spawn(try_send(request(&a)));
    wait_for_count(&upstream.state.pay, 1, Duration::from_secs(10)).await;
    // Instance a crashes while it holds the key.
    a.kill().await;
    assert!(lost.await.unwrap().is_err(), "the crashed instance sent no answer");

    // Once the lease has run out, the other instance takes the key over.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let retry = send(request(&b)).await;
    assert_eq!(retry.status, 201, "{retry}");
    assert!(!retry.replayed(), "{retry}");
    assert_eq!(count(&upstream.state.pay), 2);
    let seen = upstream.state.seen("pay");
    assert_eq!(seen[0].recovered, None, "{seen:?}");
    assert_eq!(
        seen[1].recovered.as_deref(),
        Some("true"),
        "the re-run of a crashed holder's key is marked recovered: {seen:?}"
    );

    let replay = send(request(&b)).await;
    assert!(replay.replayed(), "{replay}");
    assert_eq!(replay.body, retry.body);
    assert_eq!(count(&upstream.state.pay), 2);
}
