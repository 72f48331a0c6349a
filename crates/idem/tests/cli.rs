//! The command line and the process's life: admin endpoints, shutdown, a store that cannot be
//! opened, `inspect`, `delete`, `purge`, `migrate`.

mod common;

use std::process::Output;
use std::time::Duration;

use common::{Gateway, count, describe, new_key, run_idem, send, store_url_in, wait_for_count};

const COMMAND_LIMIT: Duration = Duration::from_secs(30);

/// `idem ARGS`, which must succeed: its output.
async fn idem_succeeds(args: &[&str]) -> Output {
    let output = run_idem(args, COMMAND_LIMIT).await;
    assert!(output.status.success(), "idem {args:?}:\n{}", describe(&output));
    output
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_answers_health_and_readiness() {
    let (_upstream, gw, _) = common::start(&[]).await;

    let health = send(gw.client.get(format!("{}/healthz", gw.admin))).await;
    assert_eq!(health.status, 200, "{health}");
    let ready = send(gw.client.get(format!("{}/readyz", gw.admin))).await;
    assert_eq!(ready.status, 200, "the store answers, so the gateway is ready: {ready}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_requests_finish_and_exits_zero() {
    let (upstream, mut gw, key) = common::start(&[]).await;

    let in_flight = {
        let request = gw.keyed("/pay?delay=1000", key.as_str(), r#"{"amount":1}"#);
        tokio::spawn(send(request))
    };
    wait_for_count(&upstream.state.pay, 1, Duration::from_secs(10)).await;
    gw.terminate();

    let reply = in_flight.await.unwrap();
    assert_eq!(reply.status, 201, "the in-flight request gets its answer: {reply}");
    let status = gw.wait_exit(Duration::from_secs(20)).await;
    assert!(
        status.success(),
        "a graceful shutdown exits 0, got {status:?}; stderr:\n{}",
        gw.stderr()
    );
    assert_eq!(count(&upstream.state.pay), 1);

    let inspect = run_idem(&["inspect", "--store", &gw.store, &key], COMMAND_LIMIT).await;
    assert!(inspect.status.success(), "the record is there:\n{}", describe(&inspect));
    let text = String::from_utf8_lossy(&inspect.stdout).to_lowercase();
    assert!(
        text.contains("completed"),
        "the record completed:\n{}",
        describe(&inspect)
    );
    assert!(text.contains("/pay"), "inspect shows the path:\n{}", describe(&inspect));
    assert!(
        text.contains("post"),
        "inspect shows the method:\n{}",
        describe(&inspect)
    );
    assert!(
        text.contains("201"),
        "inspect shows the stored status:\n{}",
        describe(&inspect)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_a_record_and_its_replays() {
    let (upstream, gw, key) = common::start(&[]).await;
    for _ in 0..3 {
        let reply = gw.post_json("/pay", Some(&key), r#"{"amount":1}"#).await;
        assert_eq!(reply.status, 201, "{reply}");
    }
    assert_eq!(count(&upstream.state.pay), 1);

    let inspect = idem_succeeds(&["inspect", "--store", &gw.store, &key]).await;
    let text = String::from_utf8_lossy(&inspect.stdout).to_lowercase();
    assert!(text.contains("completed"), "{}", describe(&inspect));
    assert!(text.contains("/pay"), "{}", describe(&inspect));
    assert!(text.contains("201"), "{}", describe(&inspect));
    assert!(
        text.lines().any(|line| line.contains("replay") && line.contains('2')),
        "two replays are counted:\n{}",
        describe(&inspect)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_cannot_be_opened_stops_serve_with_a_message_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing").join("x").join("idem.db");
    let store = format!("sqlite://{}", path.display());

    let output = common::serve_to_end("http://127.0.0.1:9", &store, COMMAND_LIMIT).await;
    assert!(!output.status.success(), "serve must fail:\n{}", describe(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&path.display().to_string()),
        "the message names the path {}:\n{}",
        path.display(),
        describe(&output)
    );
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("idem listening"),
        "{}",
        describe(&output)
    );
}

/// A store URL that cannot work is a usage error (exit 2, as a bad flag's value), named as
/// `--store` and with its password hidden; a store that is only unreachable is not (exit 1: the
/// same command works once it is up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_url_that_cannot_work_exits_2_and_an_unreachable_store_exits_1() {
    for (url, says) in [
        ("redis://:hunter2@127.0.0.1:9/?replicas=abc", "replicas"),
        ("redis://127.0.0.1:9/?bogus=1", "unknown option \"bogus\""),
        ("postgres://u:hunter2@127.0.0.1:9/test?pool_size=-1", "pool_size"),
        ("sqlite:///tmp/idem-never.db?mode=zz", "query parameters"),
        ("mysql://u:hunter2@127.0.0.1:9/db", "unknown store URL"),
    ] {
        for command in [&["list", "--store", url][..], &["purge", "--store", url][..]] {
            let output = run_idem(command, COMMAND_LIMIT).await;
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_eq!(output.status.code(), Some(2), "{command:?}:\n{}", describe(&output));
            assert!(
                stderr.contains("--store: ") && stderr.contains(says),
                "{command:?} names the setting and what is wrong:\n{}",
                describe(&output)
            );
            assert!(
                !stderr.contains("hunter2"),
                "{command:?} shows the password:\n{}",
                describe(&output)
            );
        }
    }
    let unreachable = run_idem(&["list", "--store", "redis://127.0.0.1:9"], COMMAND_LIMIT).await;
    assert_eq!(unreachable.status.code(), Some(1), "{}", describe(&unreachable));
    assert!(
        String::from_utf8_lossy(&unreachable.stderr).contains("cannot open the Redis store"),
        "{}",
        describe(&unreachable)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_and_purge_succeed_on_a_fresh_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_url_in(dir.path());

    idem_succeeds(&["migrate", "--store", &store]).await;
    let again = run_idem(&["migrate", "--store", &store], COMMAND_LIMIT).await;
    assert!(again.status.success(), "migrate is idempotent:\n{}", describe(&again));
    idem_succeeds(&["purge", "--store", &store]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_succeeds_on_a_store_in_use() {
    let (upstream, gw, key) = common::start(&[]).await;
    let reply = gw.post_json("/pay", Some(&key), r#"{"amount":1}"#).await;
    assert_eq!(reply.status, 201, "{reply}");

    idem_succeeds(&["purge", "--store", &gw.store]).await;
    // Nothing was due, so the record is still replayable.
    let again = gw.post_json("/pay", Some(&key), r#"{"amount":1}"#).await;
    assert!(again.replayed(), "{again}");
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_of_an_unknown_key_fails() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_url_in(dir.path());
    idem_succeeds(&["migrate", "--store", &store]).await;

    let inspect = run_idem(&["inspect", "--store", &store, "no-such-key"], COMMAND_LIMIT).await;
    assert!(
        !inspect.status.success(),
        "no record, non-zero exit:\n{}",
        describe(&inspect)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_delete_find_a_credentials_record_by_its_authorization() {
    let (upstream, gw, key) = common::start(&[]).await;
    let pay = || {
        gw.post("/pay", r#"{"amount":1}"#)
            .header("content-type", "application/json")
            .header("authorization", "Bearer alice")
            .header("idempotency-key", key.as_str())
    };
    let first = send(pay()).await;
    assert_eq!(first.status, 201, "{first}");

    let anonymous = run_idem(&["delete", "--store", &gw.store, &key], COMMAND_LIMIT).await;
    assert_eq!(
        anonymous.status.code(),
        Some(1),
        "the anonymous scope has no such record:\n{}",
        describe(&anonymous)
    );
    let both = run_idem(
        &[
            "delete",
            "--store",
            &gw.store,
            "--scope",
            "anonymous",
            "--authorization",
            "Bearer alice",
            &key,
        ],
        COMMAND_LIMIT,
    )
    .await;
    assert_eq!(
        both.status.code(),
        Some(2),
        "one scope or the other:\n{}",
        describe(&both)
    );

    let by_credential = [
        "--store",
        gw.store.as_str(),
        "--authorization",
        "Bearer alice",
        key.as_str(),
    ];
    let inspect = idem_succeeds(&[&["inspect", "--json"][..], &by_credential].concat()).await;
    let json: serde_json::Value = serde_json::from_slice(&inspect.stdout).expect("JSON");
    let scope = json["scope"].as_str().expect("a scope");
    assert!(scope.starts_with("cred-mac:"), "a keyed credential scope: {json}");
    assert_eq!(json["state"], "completed", "{json}");

    let delete = idem_succeeds(&[&["delete"][..], &by_credential].concat()).await;
    let text = String::from_utf8_lossy(&delete.stdout);
    assert!(text.contains(scope), "delete names the scope:\n{text}");
    let again = send(pay()).await;
    assert_eq!(again.status, 201, "{again}");
    assert!(!again.replayed(), "the request runs again: {again}");
    assert_eq!(count(&upstream.state.pay), 2);
}

/// The gateway writes its `info` lines in batches: none is lost, none is written twice, they
/// are all written by the time it exits, and the last line is the last thing it logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_is_logged_once_by_the_time_the_gateway_exits() {
    let (_upstream, mut gw, _) = common::start(&[]).await;
    let keys: Vec<String> = (0..100).map(|_| new_key()).collect();
    let replies = futures_util::future::join_all(
        keys.iter()
            .map(|key| gw.post_json("/pay", Some(key), r#"{"amount":1}"#)),
    )
    .await;
    for reply in &replies {
        assert_eq!(reply.status, 201, "{reply}");
    }
    gw.terminate();
    let status = gw.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "{status:?}:\n{}", gw.stderr());

    let stderr = gw.stderr();
    for key in &keys {
        let lines = stderr
            .lines()
            .filter(|line| line.contains(&format!("key=\"{key}\"")))
            .count();
        assert_eq!(lines, 1, "one line for {key}:\n{stderr}");
    }
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("idem serve stopped"),
        "the last line is the last logged:\n{stderr}"
    );
}

/// A warning is written at once, and after every line logged before it: here each request's
/// "upstream unreachable" warning comes after the previous request's own (batched) line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warning_is_written_at_once_after_the_lines_before_it() {
    // Nothing listens on port 1 of the loopback: every call upstream is refused.
    let gw = Gateway::start("http://127.0.0.1:1", &[]).await;
    let keys: Vec<String> = (0..10).map(|_| new_key()).collect();
    for key in &keys {
        let reply = gw.post_json("/pay", Some(key), r#"{"amount":1}"#).await;
        reply.assert_problem(502, "upstream-unavailable");
        let warned = gw.stderr().matches("upstream unreachable").count();
        assert!(
            warned >= 1,
            "the warning is written before its request is answered:\n{}",
            gw.stderr()
        );
    }
    let done = |stderr: &str| stderr.contains(&format!("key=\"{}\"", keys[keys.len() - 1]));
    let stderr = gw.stderr_once("the last request's line", done).await;
    let order: Vec<String> = stderr
        .lines()
        .filter_map(|line| {
            if line.contains("upstream unreachable") {
                Some("warning".to_owned())
            } else {
                keys.iter()
                    .find(|key| line.contains(&format!("key=\"{key}\"")))
                    .cloned()
            }
        })
        .collect();
    let expected: Vec<String> = keys
        .iter()
        .flat_map(|key| ["warning".to_owned(), key.clone()])
        .collect();
    assert_eq!(order, expected, "{stderr}");
}

/// A gateway that cannot start still writes the lines it logged before it gave up, before the
/// error that says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_cannot_listen_writes_its_earlier_lines_first() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let port = taken.local_addr().expect("its address").to_string();
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = store_url_in(dir.path());
    let output = run_idem(
        &[
            "serve",
            "--upstream",
            "http://127.0.0.1:1",
            "--store",
            &store,
            "--listen",
            &port,
        ],
        COMMAND_LIMIT,
    )
    .await;
    assert!(!output.status.success(), "{}", describe(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let started = stderr
        .find("the replay cache")
        .unwrap_or_else(|| panic!("the start-up lines are written:\n{stderr}"));
    let failed = stderr
        .find("cannot listen")
        .unwrap_or_else(|| panic!("the error is written:\n{stderr}"));
    assert!(started < failed, "{stderr}");
}

/// A path and a header scope are the caller's to choose: control and bidi characters in them are
/// escaped in `idem list`'s table and `idem inspect`'s text, so that they cannot recolour, move or
/// reorder what the operator reads; the JSON forms keep the exact values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_and_inspect_escape_terminal_controls_and_json_keeps_them_exact() {
    let (_upstream, gw, _) = common::start(&["--scope", "header:X-User-Id"]).await;
    // Raw UTF-8 in the request target (U+202E, an override) and an escaped one (U+2066, an
    // isolate), and in the scope header U+2066, U+202E, U+009B (the C1 CSI) and a tab: what a
    // hostile caller can send.
    let path = "/pay/\u{202e}gpj.exe%E2%81%A6x";
    let user = "\u{2066}alice\u{202e}\u{9b}31m\tx";
    let key = new_key();
    let raw = format!(
        "POST {path} HTTP/1.1\r\nhost: idem\r\nidempotency-key: {key}\r\nx-user-id: {user}\r\n\
         content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
    );
    let (answers, ending) =
        idem_test_support::wire::exchange(gw.addr(), raw.as_bytes(), false, 1, Duration::from_secs(10)).await;
    assert!(!answers.is_empty(), "no answer: {ending:?}");
    let scope = format!("header:{user}");
    let shown_scope = "header:\\u{2066}alice\\u{202e}\\u{9b}31m\\tx";
    let store = gw.store.as_str();
    let is_hostile = |c: char| {
        (c.is_control() && c != '\n')
            || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    // `list` shows the path as servers read it (escapes decoded); `inspect` the request's own.
    for (args, json_args, shown_path, exact_path) in [
        (
            &["list", "--store", store][..],
            &["list", "--store", store, "--json"][..],
            "/pay/\\u{202e}gpj.exe\\u{2066}x",
            "/pay/\u{202e}gpj.exe\u{2066}x",
        ),
        (
            &["inspect", "--store", store, "--scope", &scope, &key],
            &["inspect", "--store", store, "--scope", &scope, "--json", &key],
            "/pay/\\u{202e}gpj.exe%E2%81%A6x",
            path,
        ),
    ] {
        let output = idem_succeeds(args).await;
        let text = String::from_utf8(output.stdout.clone()).expect("UTF-8 output");
        assert!(
            !text.contains(is_hostile),
            "{args:?} prints a control or bidi character raw:\n{text:?}"
        );
        for shown in [shown_path, shown_scope] {
            assert!(text.contains(shown), "{args:?} shows {shown}:\n{text}");
        }

        let output = idem_succeeds(json_args).await;
        let record: serde_json::Value =
            serde_json::from_slice(&output.stdout).unwrap_or_else(|err| panic!("{err}: {}", describe(&output)));
        assert_eq!(record["path"], exact_path, "{json_args:?}: the exact path: {record}");
        assert_eq!(
            record["scope"],
            scope.as_str(),
            "{json_args:?}: the exact scope: {record}"
        );
    }
}
