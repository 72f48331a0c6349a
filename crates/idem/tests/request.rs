//! The client half end to end: idem-client and `idem request` against `idem serve` in front of
//! upstreams that misbehave on purpose, and `idem request`'s output and exit statuses.

mod common;
mod request_support;

use std::time::Duration;

use common::{Gateway, Upstream, count, describe};
use idem_client::reqwest_middleware::ClientBuilder;
use idem_client::{IdempotencyMiddleware, ResponseExt};
use request_support::{LossyLink, idem, summary};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_lost_on_the_way_back_is_replayed_and_the_upstream_runs_once() {
    let (upstream, gateway, _) = common::start(&[]).await;
    let link = LossyLink::start(gateway.addr()).await;
    let client = ClientBuilder::new(common::client())
        .with(IdempotencyMiddleware::new().with_base_delay(Duration::from_millis(50)))
        .build();

    let response = client
        .post(link.url("/pay"))
        .header("content-type", "application/json")
        .body(r#"{"amount":10}"#)
        .send()
        .await
        .expect("the retry gets an answer");

    assert_eq!(response.status(), 201);
    let report = response.retry_report().unwrap().clone();
    assert_eq!(
        report.attempts, 2,
        "the first answer was lost, the second delivered: {report:?}"
    );
    assert!(report.replayed, "the retry got the stored answer: {report:?}");
    let body: serde_json::Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    assert_eq!(body["charge"], 1, "the answer of the one run: {body}");
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
    let key = report.key.expect("a POST gets a key");
    let seen = upstream.state.seen("pay");
    assert_eq!(
        seen[0].key.as_deref(),
        Some(format!("\"{key}\"").as_str()),
        "the upstream saw the key the client stamped: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_request_shows_the_attempts_and_the_replay_behind_a_slow_upstream() {
    let upstream = Upstream::start().await;
    // The call takes 1.5 s: the gateway answers 504 with Retry-After after 300 ms, keeps waiting
    // for the upstream, and the retry waits for or replays the stored answer (a retry that reached
    // the upstream would be a second call).
    let gateway = Gateway::start(&upstream.url(), &["--upstream-timeout", "300ms"]).await;
    let url = gateway.url("/pay?delay=1500");
    let output = idem(&[
        "request",
        "-H",
        "Content-Type: application/json",
        "-d",
        r#"{"amount":5}"#,
        &url,
    ])
    .await;

    assert!(output.status.success(), "2xx exits 0:\n{}", describe(&output));
    let line = summary(&output);
    assert_eq!(line["status"], "201", "{}", describe(&output));
    assert_eq!(line["attempts"], "2", "{}", describe(&output));
    assert_eq!(line["replayed"], "true", "{}", describe(&output));
    assert!(line["key"].len() == 36, "a UUIDv7 key: {}", describe(&output));
    let body: serde_json::Value = serde_json::from_slice(&output.stdout).expect("the body on stdout");
    assert_eq!(body["charge"], 1);
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_request_retries_a_flaky_upstream_and_a_second_run_with_the_key_is_a_replay() {
    let (upstream, gateway, _) = common::start(&[]).await;
    let url = gateway.url("/flaky");
    let key = "order-7f3a";

    let first = idem(&["request", "-d", "{}", "--key", key, &url]).await;
    assert!(first.status.success(), "{}", describe(&first));
    let line = summary(&first);
    assert_eq!(line["status"], "201", "{}", describe(&first));
    assert_eq!(line["attempts"], "2", "the 500 was retried: {}", describe(&first));
    assert_eq!(line["replayed"], "false", "{}", describe(&first));
    assert_eq!(line["key"], key);

    let again = idem(&["request", "-d", "{}", "--key", key, &url]).await;
    assert!(again.status.success(), "{}", describe(&again));
    let line = summary(&again);
    assert_eq!(line["attempts"], "1", "{}", describe(&again));
    assert_eq!(line["replayed"], "true", "{}", describe(&again));
    assert_eq!(first.stdout, again.stdout, "the same answer, replayed");
    assert_eq!(count(&upstream.state.flaky), 2, "one 500, one 201, no third run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_request_reads_the_body_from_a_file_and_sends_the_method_and_headers_given() {
    let (upstream, gateway, _) = common::start(&[]).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("body.json");
    std::fs::write(&file, r#"{"amount":3}"#).unwrap();
    let data = format!("@{}", file.display());
    let url = gateway.url("/pay");

    let first = idem(&[
        "request",
        "-X",
        "POST",
        "-H",
        "content-type: application/json",
        "-d",
        &data,
        &url,
    ])
    .await;
    assert!(first.status.success(), "{}", describe(&first));
    let key = summary(&first)["key"].clone();
    // The same key with the same file is a replay: the body sent was the file's.
    let again = idem(&[
        "request",
        "-X",
        "POST",
        "-H",
        "content-type: application/json",
        "-H",
        &format!("Idempotency-Key: \"{key}\""),
        "-d",
        &data,
        &url,
    ])
    .await;
    assert_eq!(summary(&again)["replayed"], "true", "{}", describe(&again));
    // And a different body under that key is refused, not replayed.
    let other = idem(&["request", "--key", &key, "-d", r#"{"amount":4}"#, &url]).await;
    assert_eq!(
        other.status.code(),
        Some(4),
        "422 key-mismatch exits 4:\n{}",
        describe(&other)
    );
    assert_eq!(summary(&other)["attempts"], "1", "a 422 is not retried");
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_request_exit_statuses_tell_the_kind_of_answer() {
    let upstream = Upstream::start().await;
    let base = upstream.url();

    let not_found = idem(&["request", "-X", "POST", &format!("{base}/status/404")]).await;
    assert_eq!(not_found.status.code(), Some(4), "{}", describe(&not_found));
    assert_eq!(summary(&not_found)["attempts"], "1");
    assert_eq!(
        String::from_utf8_lossy(&not_found.stdout),
        r#"{"status":404,"call":1}"#,
        "the body still goes to stdout"
    );

    let down = idem(&["request", "-X", "POST", "--retries", "1", &format!("{base}/status/503")]).await;
    assert_eq!(down.status.code(), Some(5), "{}", describe(&down));
    assert_eq!(summary(&down)["attempts"], "2");
    assert!(
        String::from_utf8_lossy(&down.stderr).contains("no retries left"),
        "{}",
        describe(&down)
    );

    let redirect = idem(&["request", &format!("{base}/status/304")]).await;
    assert_eq!(redirect.status.code(), Some(3), "{}", describe(&redirect));

    let ok = idem(&["request", &format!("{base}/status/200")]).await;
    assert_eq!(ok.status.code(), Some(0), "{}", describe(&ok));
    assert_eq!(summary(&ok)["key"], "none", "a GET gets no key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_request_without_an_answer_exits_1_and_says_why() {
    let refused = {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        idem(&["request", "-d", "x", "--retries", "2", &format!("http://{port}/pay")]).await
    };
    assert_eq!(refused.status.code(), Some(1), "{}", describe(&refused));
    let line = summary(&refused);
    assert_eq!(line["status"], "none");
    assert_eq!(
        line["attempts"],
        "3",
        "a refused connection is retried: {}",
        describe(&refused)
    );
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("refused"),
        "the cause is shown: {}",
        describe(&refused)
    );

    let upstream = Upstream::start().await;
    let started = std::time::Instant::now();
    let beyond = idem(&[
        "request",
        "-X",
        "POST",
        "--deadline",
        "3s",
        &format!("{}/status/503?retry-after=120", upstream.url()),
    ])
    .await;
    assert_eq!(beyond.status.code(), Some(1), "{}", describe(&beyond));
    assert!(started.elapsed() < Duration::from_secs(20), "it did not wait in vain");
    let stderr = String::from_utf8_lossy(&beyond.stderr);
    assert!(
        stderr.contains("Retry-After") && stderr.contains("deadline"),
        "the reason is named: {}",
        describe(&beyond)
    );
    assert_eq!(summary(&beyond)["attempts"], "1");
    assert_eq!(count(&upstream.state.status), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_request_refuses_bad_input_with_exit_2() {
    for args in [
        vec!["request", "-H", "no colon here", "http://127.0.0.1:9/"],
        vec!["request", "--key", "has space", "http://127.0.0.1:9/"],
        vec!["request", "-d", "@/nonexistent/body.json", "http://127.0.0.1:9/"],
        vec![
            "request",
            "--key",
            "k",
            "-H",
            "Idempotency-Key: k",
            "-d",
            "x",
            "http://127.0.0.1:9/",
        ],
        vec!["request", "not a url"],
    ] {
        let output = idem(&args).await;
        assert_eq!(output.status.code(), Some(2), "{args:?}:\n{}", describe(&output));
    }
}
