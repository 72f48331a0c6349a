//! `idem serve --config FILE`: routes by path through a real gateway, the order in which flags,
//! the environment and the file win, and a bad file refused at start with the setting and its line.

mod common;

use std::time::Duration;

use common::{Gateway, Upstream, config_file, count, new_key, send, serve_refusing};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_give_each_path_its_rules() {
    let upstream = Upstream::start().await;
    let (_dir, path) = config_file(
        r#"
# The gateway's own settings, as the flags name them.
ttl = "24h"
wait = "5s"

# A webhook sender has its own retries and its own ids: pass it through untouched.
[[route]]
path = "/status/*"
enabled = false

# Payments must carry a key.
[[route]]
path = "/pay"
missing-key = "require"

# Streamed orders are replayable for one second only.
[[route]]
path = "/chunked"
ttl = "1s"
"#,
    );
    let gw = Gateway::start(&upstream.url(), &["--config", path.to_str().unwrap()]).await;

    // enabled = false: the same key twice reaches the upstream twice, and nothing is replayed.
    let key = new_key();
    for call in 1..=2 {
        let reply = send(gw.post("/status/201", "{}").header("idempotency-key", key.as_str())).await;
        assert_eq!(reply.status, 201, "{reply}");
        assert!(!reply.replayed(), "call {call} passes through: {reply}");
    }
    assert_eq!(count(&upstream.state.status), 2, "a pass-through route runs every copy");

    // missing-key = "require" on /pay only.
    let keyless = send(gw.post("/pay", "{}")).await;
    keyless.assert_problem(400, "key-missing");
    assert_eq!(
        count(&upstream.state.pay),
        0,
        "a refused request never reaches the upstream"
    );
    let elsewhere = send(gw.post("/flaky", "{}")).await;
    assert_eq!(elsewhere.status, 500, "keyless requests pass elsewhere: {elsewhere}");
    let pay_key = new_key();
    let first = send(gw.post("/pay", "{}").header("idempotency-key", pay_key.as_str())).await;
    let again = send(gw.post("/pay", "{}").header("idempotency-key", pay_key.as_str())).await;
    assert_eq!((first.status, again.status), (201, 201), "{first}\n{again}");
    assert!(again.replayed(), "a keyed payment still replays: {again}");
    assert_eq!(count(&upstream.state.pay), 1);

    // ttl = "1s" on /chunked: after a second the key has expired (its tombstone answers).
    let key = new_key();
    let first = send(gw.post("/chunked", "{}").header("idempotency-key", key.as_str())).await;
    assert_eq!(first.status, 201, "{first}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = send(gw.post("/chunked", "{}").header("idempotency-key", key.as_str())).await;
    late.assert_problem(422, "key-expired");
    // The gateway's 24 h still holds on the other paths.
    let replay = send(gw.post("/pay", "{}").header("idempotency-key", pay_key.as_str())).await;
    assert!(replay.replayed(), "{replay}");
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flag_beats_the_environment_which_beats_the_file() {
    let upstream = Upstream::start().await;
    let (_dir, path) = config_file("missing-key = \"require\"\n");
    let config = path.to_str().unwrap();
    let keyless = |gw: &Gateway| send(gw.post("/status/201", "{}"));

    let file = Gateway::start(&upstream.url(), &["--config", config]).await;
    keyless(&file).await.assert_problem(400, "key-missing");

    let env = [("IDEM_MISSING_KEY", "allow")];
    let environment = Gateway::start_with_env(&upstream.url(), &["--config", config], &env).await;
    let reply = keyless(&environment).await;
    assert_eq!(reply.status, 201, "IDEM_MISSING_KEY beats the file: {reply}");

    let flag = Gateway::start_with_env(&upstream.url(), &["--config", config, "--missing-key", "require"], &env).await;
    keyless(&flag).await.assert_problem(400, "key-missing");

    // IDEM_CONFIG names the file as --config does; with no file the default (allow) holds.
    let named = Gateway::start_with_env(&upstream.url(), &[], &[("IDEM_CONFIG", config)]).await;
    keyless(&named).await.assert_problem(400, "key-missing");
    let bare = Gateway::start(&upstream.url(), &[]).await;
    assert_eq!(keyless(&bare).await.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_config_file_stops_the_start_naming_the_setting_and_its_line() {
    let cases: &[(&str, &str, &[&str])] = &[
        (
            "a misspelt setting",
            "wait = \"5s\"\nttll = \"1h\"\n",
            &["line 2", "unknown field `ttll`"],
        ),
        (
            "a bad value",
            "ttl = \"forever\"\n",
            &["line 1", "ttl:", "not a duration"],
        ),
        (
            "a value that cannot work",
            "\n\nttl = \"0s\"\n",
            &["line 3", "ttl: must be longer than zero"],
        ),
        (
            "a lease too short",
            "lease = \"500ms\"\n",
            &["line 1", "lease: must be at least 1s"],
        ),
        ("a size of the wrong type", "max-body = true\n", &["line 1", "max-body"]),
        (
            "a method that is not one",
            "methods = [\"PO ST\"]\n",
            &["line 1", "not an HTTP method"],
        ),
        ("not TOML", "ttl = 24h\n", &["line 1"]),
        (
            "a route behind a wider one",
            "[[route]]\npath = \"/payments/*\"\n\n[[route]]\npath = \"/payments/{id}\"\nttl = \"1h\"\n",
            &["line 5", "\"/payments/{id}\"", "can never match", "\"/payments/*\""],
        ),
        (
            "a route without a path",
            "[[route]]\nttl = \"1h\"\n",
            &["line 1", "missing field `path`"],
        ),
        (
            "a route's path without /",
            "[[route]]\npath = \"pay\"\n",
            &["line 2", "a path starts with /"],
        ),
        (
            "a misspelt route setting",
            "[[route]]\npath = \"/pay\"\nmissing_key = \"require\"\n",
            &["line 3", "unknown field `missing_key`"],
        ),
        (
            "a route setting that cannot work",
            "[[route]]\npath = \"/pay\"\nrun-timeout = \"0s\"\n",
            &["line 2", "\"/pay\"", "run-timeout"],
        ),
        (
            "a provisional key over one scope shared by every caller",
            "[[route]]\npath = \"/pay\"\nscope = \"none\"\nmissing-key = \"fingerprint:5s\"\n",
            &["line 2", "\"/pay\"", "missing-key", "--scope none"],
        ),
        (
            "settings on a route that passes through",
            "[[route]]\npath = \"/hooks/*\"\nenabled = false\nttl = \"1h\"\n",
            &["line 2", "enabled = false", "ttl"],
        ),
        (
            "a global-only setting in a route",
            "[[route]]\npath = \"/a\"\nlease = \"5s\"\n",
            &["line 3", "lease"],
        ),
    ];
    for (what, text, expected) in cases {
        let (_dir, path) = config_file(text);
        let args = ["--upstream", "http://127.0.0.1:9", "--config", path.to_str().unwrap()];
        let output = serve_refusing(&args, &[]).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("idem.toml"), "{what}: names the file: {stderr}");
        for piece in *expected {
            assert!(stderr.contains(piece), "{what}: stderr says {piece:?}: {stderr}");
        }
    }
    // A file that cannot be read, and no upstream anywhere.
    let output = serve_refusing(&["--config", "/nonexistent/idem.toml"], &[]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent/idem.toml: cannot read it"), "{stderr}");
    let output = serve_refusing(&[], &[]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--upstream") && stderr.contains("required"), "{stderr}");
}

/// The config file docs/operations.md shows, as a reader would copy it: it starts (with the flags
/// pointing it at a test's store and upstream) and its routes do what the page says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_config_file_works() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/operations.md"))
        .expect("docs/operations.md");
    let section = page
        .split_once("## The config file")
        .expect("docs/operations.md has a config file section")
        .1;
    let toml = section
        .split_once("```toml\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .expect("the section shows a TOML block")
        .0;
    let upstream = Upstream::start().await;
    let (_dir, path) = config_file(toml);
    let gw = Gateway::start(&upstream.url(), &["--config", path.to_str().unwrap()]).await;

    send(gw.post("/payments/p_1", "{}"))
        .await
        .assert_problem(400, "key-missing");
    let key = new_key();
    for _ in 0..2 {
        let reply = send(
            gw.post("/webhooks/stripe", "{}")
                .header("idempotency-key", key.as_str()),
        )
        .await;
        assert!(!reply.replayed(), "webhooks pass through untouched: {reply}");
    }
    let key = new_key();
    send(gw.post("/exports/9", "{}").header("idempotency-key", key.as_str())).await;
    let replay = send(gw.post("/exports/9", "{}").header("idempotency-key", key.as_str())).await;
    assert!(replay.replayed(), "exports are protected: {replay}");
}

/// A `tombstone-ttl` no longer than `ttl` (the gateway's, or a route's) leaves no time in which an
/// expired key answers `422 key-expired`: allowed, but the start says so, naming the route; the
/// defaults (24 h and 7 d) say nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tombstone_ttl_no_longer_than_the_ttl_is_warned_of_at_the_start() {
    const WARNING: &str = "tombstone-ttl is not longer than ttl";
    let (upstream, defaults, _) = common::start(&[]).await;
    let started = defaults
        .stderr_once("the start", |log| log.contains("idem serve started"))
        .await;
    assert!(!started.contains(WARNING), "{started}");

    let (_dir, path) = config_file(
        r#"
[[route]]
path = "/pay"
ttl = "30d"
"#,
    );
    let gw = Gateway::start(&upstream.url(), &["--config", path.to_str().unwrap()]).await;
    let started = gw
        .stderr_once("the warning", |log| log.contains("idem serve started"))
        .await;
    let warnings: Vec<&str> = started.lines().filter(|line| line.contains(WARNING)).collect();
    assert_eq!(warnings.len(), 1, "{started}");
    assert!(
        warnings[0].contains("/pay") && warnings[0].contains("30days"),
        "{started}"
    );

    let gw = Gateway::start(&upstream.url(), &["--ttl", "2h", "--tombstone-ttl", "1h"]).await;
    let started = gw
        .stderr_once("the warning", |log| log.contains("idem serve started"))
        .await;
    assert!(
        started.contains(WARNING) && started.contains("every route without its own"),
        "{started}"
    );
}
