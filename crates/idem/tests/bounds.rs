//! Durations within what every store accepts, through the real `idem serve`: a ttl or tombstone
//! past ten years, a lease, wait, timeout or replay-cache age past a day, as a flag or in a
//! `[[route]]` table, stops the start with exit 2 naming the setting and its bound (before,
//! `--ttl 584000000000y` started and made Redis refuse its expiries); values at the bounds start
//! and serve, on SQLite and Redis.

mod common;

use common::{Gateway, Upstream, config_file, count, new_key, serve_refusing};
use idem_test_support::redis_store;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duration_past_its_bound_stops_the_start_naming_flag_and_bound() {
    const RETENTION: &str = "must be at most 10y";
    const TIMEOUT: &str = "must be at most 1d";
    let cases = [
        ("--ttl", "10y 1s", RETENTION),
        ("--ttl", "584000000000y", RETENTION),
        ("--tombstone-ttl", "11y", RETENTION),
        ("--missing-key", "fingerprint:11y", RETENTION),
        ("--lease", "1d 1s", TIMEOUT),
        ("--run-timeout", "2d", TIMEOUT),
        ("--wait", "1y", TIMEOUT),
        ("--upstream-timeout", "2d", TIMEOUT),
        ("--read-timeout", "2d", TIMEOUT),
        ("--shutdown-grace", "2d", TIMEOUT),
        ("--replay-cache-max-age", "1d 1s", TIMEOUT),
    ];
    for (flag, value, bound) in cases {
        let args = ["--upstream", "http://127.0.0.1:9", flag, value];
        let output = serve_refusing(&args, &[]).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(&format!("{flag}: {bound}")),
            "{flag} {value}: stderr names the flag and the bound: {stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_duration_past_its_bound_stops_the_start_naming_route_and_bound() {
    let cases = [
        ("ttl = \"11y\"", "ttl", "at most 10y"),
        ("tombstone-ttl = \"11y\"", "tombstone-ttl", "at most 10y"),
        ("missing-key = \"fingerprint:11y\"", "missing-key", "at most 10y"),
        ("run-timeout = \"2d\"", "run-timeout", "at most 1d"),
    ];
    for (setting, name, bound) in cases {
        let (_dir, path) = config_file(&format!("[[route]]\npath = \"/pay\"\n{setting}\n"));
        let args = ["--upstream", "http://127.0.0.1:9", "--config", path.to_str().unwrap()];
        let output = serve_refusing(&args, &[]).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        for piece in ["idem.toml", "\"/pay\"", name, bound] {
            assert!(stderr.contains(piece), "{setting}: stderr says {piece:?}: {stderr}");
        }
    }
}

/// Every duration at its bound: the gateway starts, runs a keyed request once and replays it.
async fn durations_at_their_bounds_serve(store: &str) {
    let upstream = Upstream::start().await;
    let at_bounds = [
        "--ttl",
        "10y",
        "--tombstone-ttl",
        "10y",
        "--lease",
        "1d",
        "--run-timeout",
        "1d",
        "--wait",
        "1d",
        "--upstream-timeout",
        "1d",
        "--read-timeout",
        "1d",
        "--shutdown-grace",
        "1d",
        "--replay-cache-max-age",
        "1d",
    ];
    let gw = Gateway::start_on_store(&upstream.url(), store, &at_bounds).await;
    let key = new_key();
    let first = gw.post_json("/pay", Some(&key), r#"{"amount":1}"#).await;
    assert_eq!(first.status, 201, "{first}");
    let again = gw.post_json("/pay", Some(&key), r#"{"amount":1}"#).await;
    assert_eq!(again.status, 201, "{again}");
    assert!(again.replayed(), "{again}");
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_durations_at_their_bounds_serve() {
    let dir = tempfile::tempdir().expect("a temp dir");
    durations_at_their_bounds_serve(&common::store_url_in(dir.path())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_durations_at_their_bounds_serve() {
    let store = redis_store::store_url();
    // Records kept ten years are not left on the shared server.
    let (server, prefix) = store.split_once("/?prefix=").expect("a URL with a prefix");
    let _cleanup = idem_test_support::servers::Cleanup::redis_keys(server, prefix);
    durations_at_their_bounds_serve(&store).await;
}
