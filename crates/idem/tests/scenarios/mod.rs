//! Scenarios every store must pass behind several `idem serve` processes, written once and run per
//! store: concurrent copies spread over instances, a crashed holder taken over, an outage of the
//! store in the middle of traffic, and the operator's commands.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::common::{Gateway, Upstream, count, describe, new_key, run_idem, send, try_send, wait_for_count};

/// `copies` simultaneous copies of one keyed request, spread round-robin over `instances`
/// gateways sharing `store`: the upstream runs once and every client gets the same 2xx body.
pub(crate) async fn copies_run_once(store: &str, instances: usize, copies: usize) {
    let upstream = Upstream::start().await;
    let mut gateways = Vec::with_capacity(instances);
    for _ in 0..instances {
        gateways.push(Gateway::start_on_store(&upstream.url(), store, &[]).await);
    }
    let key = new_key();
    let body = r#"{"amount":4200,"currency":"EUR"}"#;
    let tasks: Vec<_> = (0..copies)
        .map(|i| {
            let request = gateways[i % instances]
                .post("/pay?delay=300", body)
                .header("content-type", "application/json")
                .header("idempotency-key", key.as_str());
            tokio::spawn(send(request))
        })
        .collect();
    let mut replies = Vec::with_capacity(copies);
    for task in tasks {
        replies.push(task.await.expect("a copy's task"));
    }
    for (i, reply) in replies.iter().enumerate() {
        assert_eq!(reply.status, 201, "copy {i} (instance {}): {reply}", i % instances);
        assert_eq!(reply.body, replies[0].body, "copy {i} got another body: {reply}");
    }
    let replayed = replies.iter().filter(|r| r.replayed()).count();
    assert_eq!(replayed, copies - 1, "all copies but the one that ran are replays");
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
}

/// An instance killed with SIGKILL while it holds a key: once the lease has run out, a retry on
/// another instance takes the key over and the upstream sees `Idempotency-Recovered: true`.
pub(crate) async fn crashed_holder_is_taken_over(store: &str) {
    let upstream = Upstream::start().await;
    let mut a = Gateway::start_on_store(&upstream.url(), store, &["--lease", "1s"]).await;
    let b = Gateway::start_on_store(&upstream.url(), store, &["--lease", "1s"]).await;
    let key = new_key();
    let request = |gw: &Gateway| {
        gw.post("/pay?delay=2000", r#"{"amount":7}"#)
            .header("content-type", "application/json")
            .header("idempotency-key", key.as_str())
    };

    let lost = tokio::spawn(try_send(request(&a)));
    wait_for_count(&upstream.state.pay, 1, Duration::from_secs(10)).await;
    a.kill().await;
    assert!(
        lost.await.expect("task").is_err(),
        "the crashed instance sent no answer"
    );

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
        "the re-run is marked recovered: {seen:?}"
    );

    let replay = send(request(&b)).await;
    assert!(replay.replayed(), "{replay}");
    assert_eq!(replay.body, retry.body);
    assert_eq!(
        count(&upstream.state.pay),
        2,
        "the upstream ran twice in all: the lost run and the takeover"
    );
}

/// Two gateways on one store, the second with its clock 45 s ahead: a retry on the second while
/// the first still runs the request within its lease must wait for it and replay its answer. On
/// the second gateway's own clock that lease ran out long ago; on the store's it has not.
pub(crate) async fn a_skewed_clock_never_takes_over_a_healthy_run(store: &str) {
    let upstream = Upstream::start().await;
    let args = ["--lease", "20s", "--wait", "15s"];
    let a = Gateway::start_on_store(&upstream.url(), store, &args).await;
    let ahead = Gateway::start_skewed(&upstream.url(), store, "+45s", &args).await;
    let key = new_key();
    let request = |gw: &Gateway| {
        gw.post("/pay?delay=4000", r#"{"amount":9}"#)
            .header("content-type", "application/json")
            .header("idempotency-key", key.as_str())
    };
    let first = tokio::spawn(send(request(&a)));
    wait_for_count(&upstream.state.pay, 1, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let retry = send(request(&ahead)).await;
    let first = first.await.expect("task");
    assert_eq!(first.status, 201, "{first}");
    assert_eq!(retry.status, 201, "{retry}");
    assert!(retry.replayed(), "the retry waited for the run in flight: {retry}");
    assert_eq!(retry.body, first.body);
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
    assert_eq!(upstream.state.seen("pay")[0].recovered, None);
}

/// The store dies in the middle of traffic and comes back. Every keyed request is answered either
/// by the upstream (`201`) or with `503 store-unavailable` + `Retry-After`; the upstream is never
/// called without a claim (its calls equal the `201`s); once the store is back, traffic recovers
/// without a restart of idem.
pub(crate) async fn outage_fails_closed_and_recovers(
    store: &str,
    kill: impl AsyncFnOnce(),
    restart: impl AsyncFnOnce(),
) {
    let upstream = Upstream::start().await;
    let gateway = Arc::new(Gateway::start_on_store(&upstream.url(), store, &[]).await);
    let before = send(pay(&gateway, &new_key())).await;
    assert_eq!(before.status, 201, "{before}");

    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (gateway, stop) = (gateway.clone(), stop.clone());
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let reply = send(pay(&gateway, &new_key())).await;
                if reply.status == 503 {
                    assert!(
                        reply.headers.contains_key("retry-after"),
                        "503 without Retry-After: {reply}"
                    );
                    assert!(
                        String::from_utf8_lossy(&reply.body).contains("store-unavailable"),
                        "{reply}"
                    );
                }
                statuses.push(reply.status);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            statuses
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    kill().await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let ready = reqwest::get(format!("{}/readyz", gateway.admin))
        .await
        .expect("admin answers");
    assert_eq!(ready.status(), 503, "not ready while the store is down");
    restart().await;

    // Recovery: a new key is served again within 30 s, without restarting idem.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let reply = send(pay(&gateway, &new_key())).await;
        if reply.status == 201 {
            break;
        }
        assert_eq!(reply.status, 503, "{reply}");
        assert!(
            tokio::time::Instant::now() < deadline,
            "idem did not recover within 30 s of the store's return"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let statuses = traffic.await.expect("traffic task");
    let created = statuses.iter().filter(|s| **s == 201).count();
    let refused = statuses.iter().filter(|s| **s == 503).count();
    assert_eq!(
        created + refused,
        statuses.len(),
        "only 201 or 503 during an outage: {statuses:?}"
    );
    assert!(refused > 0, "the outage was seen: {statuses:?}");
    // Every upstream call is a 201 that reached its client: before, during (a claim taken just
    // before the store died), the traffic, and the recovery probe.
    assert_eq!(
        count(&upstream.state.pay),
        1 + created + 1,
        "no upstream call without a claim: {statuses:?}"
    );
}

fn pay(gateway: &Gateway, key: &str) -> reqwest::RequestBuilder {
    gateway
        .post("/pay", r#"{"amount":1}"#)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
}

/// The operator's view of a shared store: `/readyz` answers, `idem inspect` shows a completed
/// record with its request, status and replays, `idem purge` and `idem migrate` succeed, and
/// `inspect` of an unknown key fails.
pub(crate) async fn operator_commands_work(store: &str) {
    let upstream = Upstream::start().await;
    let gateway = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let ready = reqwest::get(format!("{}/readyz", gateway.admin))
        .await
        .expect("admin answers");
    assert_eq!(ready.status(), 200, "ready when the store answers");
    let key = new_key();
    for _ in 0..2 {
        assert_eq!(send(pay(&gateway, &key)).await.status, 201);
    }

    let limit = Duration::from_secs(60);
    let inspect = run_idem(&["inspect", "--store", store, &key], limit).await;
    assert!(
        inspect.status.success(),
        "inspect finds the record:\n{}",
        describe(&inspect)
    );
    let text = String::from_utf8_lossy(&inspect.stdout);
    for expected in ["POST /pay", "completed", "201", "replays:  1"] {
        assert!(text.contains(expected), "inspect shows {expected:?}:\n{text}");
    }
    let unknown = run_idem(&["inspect", "--store", store, &new_key()], limit).await;
    assert!(
        !unknown.status.success(),
        "inspect of an unknown key fails:\n{}",
        describe(&unknown)
    );
    for command in ["purge", "migrate"] {
        let output = run_idem(&[command, "--store", store], limit).await;
        assert!(output.status.success(), "idem {command}:\n{}", describe(&output));
    }
}
