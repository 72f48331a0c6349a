//! Scenarios every store must pass behind several `idem serve` processes, written once and run per
//! store (`shared_stores.rs`): concurrent copies spread over instances, a crashed holder taken
//! over, an outage of the store in the middle of traffic, and the operator's commands.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::common::{
    Gateway, Reply, Upstream, count, describe, inspect_json, new_key, random_u64, run_idem, send, try_send,
    wait_for_count,
};

/// [`copies_run_once`] with 60 copies over three instances.
pub(crate) async fn sixty_copies_over_three_instances_run_once(store: &str) {
    copies_run_once(store, 3, 60).await;
}

/// [`copies_run_once`] with 50 copies over two instances (on one SQLite file).
pub(crate) async fn fifty_copies_over_two_instances_run_once(store: &str) {
    copies_run_once(store, 2, 50).await;
}

/// `copies` simultaneous copies of one keyed request, spread round-robin over `instances`
/// gateways sharing `store`: the upstream runs once and every client gets the same 2xx body.
async fn copies_run_once(store: &str, instances: usize, copies: usize) {
    let upstream = Upstream::start().await;
    let mut gateways = Vec::with_capacity(instances);
    for _ in 0..instances {
        gateways.push(Gateway::start_on_store(&upstream.url(), store, &[]).await);
    }
    let key = new_key();
    let body = r#"{"amount":4200,"currency":"EUR"}"#;
    let tasks: Vec<_> = (0..copies)
        .map(|i| {
            let request = gateways[i % instances].keyed("/pay?delay=300", key.as_str(), body);
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
    let request = |gw: &Gateway| gw.keyed("/pay?delay=2000", key.as_str(), r#"{"amount":7}"#);

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
    assert_eq!(
        upstream.state.recovered("pay"),
        [None, Some("true".to_owned())],
        "two runs, the re-run (and only it) marked recovered"
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
    let request = |gw: &Gateway| gw.keyed("/pay?delay=4000", key.as_str(), r#"{"amount":9}"#);
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
    gateway.keyed("/pay", key, r#"{"amount":1}"#)
}

/// `idem list` answers an investigation's questions on the store, from another process, on the
/// store's clock: which keys are stuck in flight, which ended with their outcome unknown, which ran
/// recovered (with the trace id of the recovering run), and what happened within the last hour —
/// newest first, as JSON lines and as a table; `idem inspect` shows the same facts of one key.
pub(crate) async fn list_answers_an_investigations_questions(store: &str) {
    let upstream = Upstream::start().await;
    let gateway = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let route = format!("/orders/{:016x}", random_u64());
    let order =
        |name: &str, then: &str, key: &str| gateway.keyed(&format!("{route}/{name}{then}"), key, r#"{"amount":1}"#);
    let (completed, unknown, recovered, stuck) = (new_key(), new_key(), new_key(), new_key());
    assert_eq!(send(order("completed", "", &completed)).await.status, 201);
    send(order("unknown", "?then=break", &unknown))
        .await
        .assert_problem(502, "upstream-failed");
    let first_trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let second_trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let lost = send(order("recovered", "?then=break-once", &recovered).header("traceparent", first_trace)).await;
    lost.assert_problem(502, "upstream-failed");
    let rerun = send(order("recovered", "?then=break-once", &recovered).header("traceparent", second_trace)).await;
    assert_eq!(rerun.status, 201, "{rerun}");
    // Held by the upstream for two minutes: in flight while the operator looks.
    let hanging = tokio::spawn(send(order("stuck", "?then=hang", &stuck)));
    let limit = Duration::from_secs(60);
    let list = |extra: &[&str]| {
        let args = [
            &["list", "--store", store, "--route", route.as_str(), "--json"][..],
            extra,
        ]
        .concat();
        let args: Vec<String> = args.iter().map(|arg| (*arg).to_owned()).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let output = run_idem(&args, limit).await;
            assert!(output.status.success(), "idem {args:?}:\n{}", describe(&output));
            String::from_utf8_lossy(&output.stdout)
                .lines()
                .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("one JSON object per line"))
                .collect::<Vec<_>>()
        }
    };
    let keys = |records: &[serde_json::Value]| {
        records
            .iter()
            .map(|r| r["key"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while keys(&list(&["--state", "in-flight"]).await) != [stuck.clone()] {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the hanging order's key is never listed in flight"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let everything = list(&["--since", "1h"]).await;
    assert_eq!(
        keys(&everything),
        [stuck.clone(), recovered.clone(), unknown.clone(), completed.clone()],
        "newest first:\n{everything:#?}"
    );
    // The route however spelled: case, a doubled slash, a trailing one.
    let spelled = format!("/{}/", route.to_uppercase());
    let output = run_idem(&["list", "--store", store, "--route", &spelled, "--json"], limit).await;
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).lines().count(),
        4,
        "{}",
        describe(&output)
    );
    let by_key = |key: &str| everything.iter().find(|r| r["key"] == key).unwrap().clone();
    let rec = by_key(&recovered);
    for (field, expected) in [
        ("state", serde_json::json!("completed")),
        ("status", serde_json::json!(201)),
        ("recovered", serde_json::json!(true)),
        ("method", serde_json::json!("POST")),
        ("path", serde_json::json!(format!("{route}/recovered"))),
        ("trace_id", serde_json::json!("4bf92f3577b34da6a3ce929d0e0e4736")),
        ("scope", serde_json::json!("anonymous")),
    ] {
        assert_eq!(rec[field], expected, "{field} of the recovered key:\n{rec:#}");
    }
    assert_eq!(by_key(&unknown)["state"], "unknown");
    assert_eq!(by_key(&unknown)["status"], serde_json::Value::Null);
    assert_eq!(by_key(&completed)["recovered"], false);
    assert_eq!(keys(&list(&["--state", "unknown"]).await), vec![unknown.clone()]);
    assert_eq!(keys(&list(&["--recovered"]).await), vec![recovered.clone()]);
    assert_eq!(
        keys(&list(&["--state", "completed"]).await),
        [recovered.clone(), completed.clone()]
    );
    assert_eq!(keys(&list(&["--state", "tombstone"]).await), Vec::<String>::new());
    assert_eq!(keys(&list(&["--limit", "2"]).await), [stuck.clone(), recovered.clone()]);
    // A future `--since` window on the store's clock holds nothing older than itself.
    assert_eq!(keys(&list(&["--since", "1ms"]).await), Vec::<String>::new());

    let table = run_idem(&["list", "--store", store, "--route", &route], limit).await;
    assert!(table.status.success(), "{}", describe(&table));
    let text = String::from_utf8_lossy(&table.stdout);
    let lines: Vec<_> = text.lines().collect();
    assert_eq!(lines.len(), 5, "a header and four records:\n{text}");
    assert!(
        lines[0].starts_with("CREATED") && lines[0].contains("RECOVERED"),
        "{text}"
    );
    assert!(
        lines[2].contains(&format!("POST {route}/recovered")) && lines[2].contains("yes"),
        "{text}"
    );
    let bad = run_idem(&["list", "--store", store, "--state", "done"], limit).await;
    assert_eq!(
        bad.status.code(),
        Some(2),
        "a state that is none is a usage error:\n{}",
        describe(&bad)
    );
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("in-flight, unknown, completed, tombstone"),
        "{}",
        describe(&bad)
    );

    let inspect = run_idem(&["inspect", "--store", store, &recovered], limit).await;
    let text = String::from_utf8_lossy(&inspect.stdout);
    for expected in [
        "trace:    4bf92f3577b34da6a3ce929d0e0e4736",
        "recovered: yes",
        "status:   201",
    ] {
        assert!(text.contains(expected), "inspect shows {expected:?}:\n{text}");
    }
    hanging.abort();
}

/// The operator's view of a shared store: `/readyz` answers, `idem inspect` shows a completed
/// record with its request, status and replays (as text and as JSON), `idem delete` forgets a
/// completed record (the same request then runs again as new) and an in-flight one (its run's
/// answer is not stored; a retry runs again), `idem purge` and `idem migrate` succeed, and
/// `inspect` and `delete` of an unknown key fail with a message.
pub(crate) async fn operator_commands_work(store: &str) {
    let upstream = Upstream::start().await;
    let gateway = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let ready = reqwest::get(format!("{}/readyz", gateway.admin))
        .await
        .expect("admin answers");
    assert_eq!(ready.status(), 200, "ready when the store answers");
    let key = new_key();
    let first = send(pay(&gateway, &key)).await;
    assert_eq!(first.status, 201, "{first}");
    assert!(send(pay(&gateway, &key)).await.replayed());

    let limit = Duration::from_secs(60);
    // A store may write replay counts a moment later, in batches (PostgreSQL: every 500 ms), and
    // this is another process: it sees the count once it is written.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let inspect = run_idem(&["inspect", "--store", store, &key], limit).await;
        assert!(
            inspect.status.success(),
            "inspect finds the record:\n{}",
            describe(&inspect)
        );
        let text = String::from_utf8_lossy(&inspect.stdout).into_owned();
        if text.contains("replays:  1") || tokio::time::Instant::now() >= deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for expected in ["POST /pay", "completed", "201", "replays:  1"] {
        assert!(text.contains(expected), "inspect shows {expected:?}:\n{text}");
    }

    let json = inspect_json(store, &key, None, &[]).await;
    for (field, expected) in [
        ("scope", serde_json::json!("anonymous")),
        ("key", serde_json::json!(key)),
        ("method", serde_json::json!("POST")),
        ("path", serde_json::json!("/pay")),
        ("state", serde_json::json!("completed")),
        ("answer", serde_json::json!("whole")),
        ("status", serde_json::json!(201)),
        ("body_bytes", serde_json::json!(first.body.len())),
        ("replays", serde_json::json!(1)),
        ("lease_until", serde_json::Value::Null),
    ] {
        assert_eq!(json[field], expected, "inspect --json: {field}:\n{json}");
    }
    for time in ["created_at", "completed_at", "expires_at", "purge_at"] {
        let value = json[time]
            .as_str()
            .unwrap_or_else(|| panic!("{time} is a string:\n{json}"));
        humantime::parse_rfc3339(value).unwrap_or_else(|err| panic!("{time} is RFC 3339 ({err}):\n{json}"));
    }

    let unknown = new_key();
    for command in [&["inspect"][..], &["inspect", "--json"], &["delete"]] {
        let args = [command, &["--store", store, unknown.as_str()]].concat();
        let output = run_idem(&args, limit).await;
        assert_eq!(
            output.status.code(),
            Some(1),
            "idem {} of an unknown key fails:\n{}",
            command.join(" "),
            describe(&output)
        );
        assert!(output.stdout.is_empty(), "nothing on stdout:\n{}", describe(&output));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(&format!("no record for key \"{unknown}\" in scope \"anonymous\"")),
            "stderr says which record is missing:\n{}",
            describe(&output)
        );
    }

    let delete = run_idem(&["delete", "--store", store, &key], limit).await;
    assert!(delete.status.success(), "delete:\n{}", describe(&delete));
    let text = String::from_utf8_lossy(&delete.stdout);
    for expected in ["deleted", &key, "POST /pay", "completed", "201", "created:"] {
        assert!(text.contains(expected), "delete shows {expected:?}:\n{text}");
    }
    let gone = run_idem(&["inspect", "--store", store, &key], limit).await;
    assert_eq!(gone.status.code(), Some(1), "deleted:\n{}", describe(&gone));
    let again = send(pay(&gateway, &key)).await;
    assert_eq!(again.status, 201, "{again}");
    assert!(!again.replayed(), "the same request runs again as new: {again}");
    assert_ne!(again.body, first.body, "a new charge: {again}");
    assert_eq!(
        count(&upstream.state.pay),
        2,
        "the upstream ran the deleted request again"
    );
    let twice = run_idem(&["delete", "--store", store, &key], limit).await;
    assert!(
        twice.status.success(),
        "the new record is deleted too:\n{}",
        describe(&twice)
    );

    // An in-flight record: its run's answer is not stored, and a retry runs again, marked recovered
    // (the key was left unknown, not freed).
    let running = new_key();
    let slow = |gateway: &Gateway| gateway.keyed("/pay?delay=1500", running.as_str(), r#"{"amount":2}"#);
    let in_flight = tokio::spawn(send(slow(&gateway)));
    wait_for_count(&upstream.state.pay, 3, Duration::from_secs(10)).await;
    let json = inspect_json(store, &running, None, &[]).await;
    assert_eq!(json["state"], "in-flight", "{json}");
    assert!(json["lease_until"].is_string(), "{json}");
    assert!(json["status"].is_null() && json["answer"].is_null(), "{json}");
    let delete = run_idem(&["delete", "--store", store, &running], limit).await;
    assert!(delete.status.success(), "delete:\n{}", describe(&delete));
    let text = String::from_utf8_lossy(&delete.stdout);
    assert!(text.contains("in-flight"), "delete shows the state:\n{text}");
    let lost = in_flight.await.expect("task");
    assert_eq!(lost.status, 201, "the run still answers its client: {lost}");
    let retry = send(slow(&gateway)).await;
    assert_eq!(retry.status, 201, "{retry}");
    assert!(!retry.replayed(), "the deleted run's answer was not stored: {retry}");
    assert_eq!(retry.header("x-seen-recovered").as_deref(), Some("true"), "{retry}");
    assert_eq!(count(&upstream.state.pay), 4);

    for command in ["purge", "migrate"] {
        let output = run_idem(&[command, "--store", store], limit).await;
        assert!(output.status.success(), "idem {command}:\n{}", describe(&output));
    }
}

/// `idem delete` of a key in flight while a copy of the request waits for it: the holder is
/// fenced and the key left unknown, so the copy's run (the upstream's second) carries
/// `Idempotency-Recovered: true`, and a third copy is the replay of that run.
pub(crate) async fn delete_in_flight_marks_the_next_run_recovered(store: &str) {
    let upstream = Upstream::start().await;
    let gateway = Gateway::start_on_store(&upstream.url(), store, &["--wait", "20s"]).await;
    let key = new_key();
    let request = || gateway.keyed("/pay?delay=3000", key.as_str(), r#"{"amount":3}"#);
    let first = tokio::spawn(send(request()));
    wait_for_count(&upstream.state.pay, 1, Duration::from_secs(10)).await;
    let waiting = tokio::spawn(send(request()));
    // Long enough for the copy to find the key in flight and wait; the holder runs 3 s.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(count(&upstream.state.pay), 1, "the copy waits");

    let delete = run_idem(&["delete", "--store", store, &key], Duration::from_secs(60)).await;
    assert!(delete.status.success(), "delete:\n{}", describe(&delete));

    let (first, waiting) = (first.await.expect("task"), waiting.await.expect("task"));
    assert_eq!(first.status, 201, "the fenced run still answers its client: {first}");
    assert_eq!(waiting.status, 201, "{waiting}");
    assert!(!waiting.replayed(), "the copy ran: {waiting}");
    let seen = upstream.state.seen("pay");
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].recovered, None, "{seen:?}");
    assert_eq!(
        seen[1].recovered.as_deref(),
        Some("true"),
        "the run after the delete may repeat the deleted one, and says so: {seen:?}"
    );
    let third = send(request()).await;
    assert!(third.replayed(), "{third}");
    assert_eq!(
        third.body, waiting.body,
        "the recovered run's answer was stored: {third}"
    );
    assert_eq!(count(&upstream.state.pay), 2);
    let text = String::from_utf8_lossy(&delete.stdout);
    assert!(
        text.contains("in-flight") && text.contains("left unknown"),
        "delete says the key is left unknown:\n{text}"
    );
}

/// How long a delete may take to reach another gateway's replay cache: at once through the store's
/// channel, within 200 ms from another process on SQLite (its count of deletes is polled, and
/// `idem delete` waits that long before it returns);
/// a margin for a loaded machine on top.
const DELETE_REACHES_CACHES_WITHIN: Duration = Duration::from_secs(3);

/// The count of `idem_replay_cache_answers_total` on a gateway's `/metrics` (0 before the first).
async fn cache_answers(gateway: &Gateway) -> u64 {
    let scrape = send(gateway.client.get(format!("{}/metrics", gateway.admin)))
        .await
        .text();
    scrape
        .lines()
        .find_map(|line| line.strip_prefix("idem_replay_cache_answers_total "))
        .map_or(0, |count| count.trim().parse().expect("a count"))
}

/// An upstream, two gateways on `store` in front of it, and a key paid through the first: its
/// `201`.
async fn paid_through_one_of_two_gateways(store: &str) -> (Upstream, Gateway, Gateway, String, Reply) {
    let upstream = Upstream::start().await;
    let a = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let b = Gateway::start_on_store(&upstream.url(), store, &[]).await;
    let key = new_key();
    let first = send(pay(&a, &key)).await;
    assert_eq!(first.status, 201, "{first}");
    (upstream, a, b, key, first)
}

/// Two gateways, each with its replay cache (on by default): replays of a key are answered on both
/// from memory (their `/metrics` say so) with the answer the upstream gave once, and a copy with
/// another body is refused `422` there too. An operator's `idem delete` (another process) reaches
/// both caches: within the bound the next request runs again at the upstream, and both gateways
/// then replay the new answer, never the old one.
pub(crate) async fn a_delete_reaches_every_gateways_replay_cache(store: &str) {
    let (upstream, a, b, key, first) = paid_through_one_of_two_gateways(store).await;
    for gateway in [&a, &b] {
        for _ in 0..5 {
            let replay = send(pay(gateway, &key)).await;
            assert!(replay.replayed(), "{replay}");
            assert_eq!(replay.body, first.body, "the answer the upstream gave: {replay}");
        }
        // The first replay on each gateway reads the store (a run's own answer is not kept), the
        // rest are answered from memory (unless a stall of the machine emptied it meanwhile).
        assert!(cache_answers(gateway).await >= 1, "replays are answered from the cache");
        let other = send(gateway.keyed("/pay", key.as_str(), r#"{"amount":2}"#)).await;
        assert_eq!(other.status, 422, "another body with the key: {other}");
    }
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");

    let deleted = run_idem(&["delete", "--store", store, &key], Duration::from_secs(60)).await;
    assert!(deleted.status.success(), "idem delete:\n{}", describe(&deleted));
    let started = tokio::time::Instant::now();
    let mut stale = 0;
    let second = loop {
        let reply = send(pay(&b, &key)).await;
        if !reply.replayed() {
            break reply;
        }
        assert_eq!(reply.body, first.body, "{reply}");
        stale += 1;
        assert!(
            started.elapsed() < DELETE_REACHES_CACHES_WITHIN,
            "the deleted answer was still replayed {stale} times after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(second.status, 201, "{second}");
    assert_ne!(second.body, first.body, "a new run, a new charge: {second}");
    assert_eq!(count(&upstream.state.pay), 2, "the key ran again once");
    let deadline = tokio::time::Instant::now() + DELETE_REACHES_CACHES_WITHIN;
    loop {
        let replay = send(pay(&a, &key)).await;
        assert!(replay.replayed(), "{replay}");
        if replay.body == second.body {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the other gateway still replays the deleted answer: {replay}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(count(&upstream.state.pay), 2, "and nothing ran a third time");
}

/// A gateway's cached answer stops at the record's expiry: afterwards the store decides, and the
/// key is told it expired, never replayed from memory and never run again.
pub(crate) async fn a_cached_answer_stops_at_its_expiry(store: &str) {
    let upstream = Upstream::start().await;
    let gateway = Gateway::start_on_store(&upstream.url(), store, &["--ttl", "2s"]).await;
    let key = new_key();
    assert_eq!(send(pay(&gateway, &key)).await.status, 201);
    for _ in 0..3 {
        assert!(send(pay(&gateway, &key)).await.replayed());
    }
    assert!(
        cache_answers(&gateway).await >= 2,
        "replays are answered from the cache"
    );
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let late = send(pay(&gateway, &key)).await;
    assert!(!late.replayed(), "past the ttl: {late}");
    assert_eq!(late.status, 422, "the key expired: {late}");
    assert!(late.text().contains("key-expired"), "{late}");
    assert_eq!(count(&upstream.state.pay), 1, "never run again");
}

/// Sends `signal` (`-STOP`, `-CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {signal} {pid}");
}

/// A gateway stopped (`SIGSTOP`: a paused VM, a stalled runtime) while an operator deletes a key
/// it holds in its replay cache, and resumed 1.5 s later with requests for that key queued in its
/// sockets: none of them gets the deleted answer, though the delete's announcement waits unread
/// behind them (or its next read of the SQLite file is due). The key runs once more, and every
/// copy gets that run's answer.
pub(crate) async fn a_stopped_gateway_forgets_what_was_deleted_while_it_slept(store: &str) {
    let (upstream, _a, b, key, first) = paid_through_one_of_two_gateways(store).await;
    for _ in 0..3 {
        let replay = send(pay(&b, &key)).await;
        assert!(replay.replayed() && replay.body == first.body, "{replay}");
    }
    assert!(cache_answers(&b).await >= 1, "b answers the key from its cache");

    signal(b.pid(), "-STOP");
    let deleted = run_idem(&["delete", "--store", store, &key], Duration::from_secs(60)).await;
    assert!(deleted.status.success(), "idem delete:\n{}", describe(&deleted));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let queued: Vec<_> = (0..5).map(|_| tokio::spawn(send(pay(&b, &key)))).collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    signal(b.pid(), "-CONT");
    let mut bodies = std::collections::HashSet::new();
    for copy in queued {
        let reply = copy.await.expect("a copy's task");
        assert_eq!(reply.status, 201, "{reply}");
        assert_ne!(
            reply.body, first.body,
            "the deleted answer, replayed after the stall: {reply}"
        );
        bodies.insert(reply.body);
    }
    assert_eq!(bodies.len(), 1, "every copy gets the one new run's answer");
    assert_eq!(count(&upstream.state.pay), 2, "the key ran once more");
}
