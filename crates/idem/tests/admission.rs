//! Which record a request belongs to, through the gateway (`idem serve`): bodies that are different
//! JSON values never share a fingerprint, scopes are the exact bytes of their header, a key's
//! embedded time is trusted only for formats that say what they are, settings that cannot work
//! never start, and a body that breaks off claims nothing.

mod common;

use std::time::Duration;

use common::{Gateway, Reply, count, new_key, send};
use idem_test_support::wire;
use reqwest::header::HeaderValue;

// ---------------------------------------------------------------------------------------------
// Fingerprints
// ---------------------------------------------------------------------------------------------

/// Sends `first` then `second` with one key; returns the second answer.
async fn same_key(gw: &Gateway, first: &str, second: &str) -> (Reply, Reply) {
    let key = new_key();
    let a = gw.post_json("/pay", Some(&key), first).await;
    assert_eq!(a.status, 201, "{a}");
    let b = gw.post_json("/pay", Some(&key), second).await;
    (a, b)
}

/// Two bodies under one key are one request only when they are one JSON value: otherwise the
/// second is `422 key-mismatch`, which never reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_bodies_under_one_key_are_one_request_only_as_one_json_value() {
    let (upstream, gw, _) = common::start(&[]).await;
    #[rustfmt::skip]
    let cases = [
        // 2^53 + 1 and 2^53 are one f64: a canonicaliser that goes through floating point makes
        // the second payment a replay of the first.
        ("integers beyond f64 precision", r#"{"user":"u1","amount":100,"to":9007199254740993}"#,
            r#"{"user":"u1","amount":100,"to":9007199254740992}"#, false),
        ("one number written two ways", r#"{"amount":1e2}"#, r#"{ "amount" : 100 }"#, true),
        // Which "amount" a JSON parser keeps differs between parsers: such a body is its bytes.
        ("duplicate members", r#"{"user":"u1","amount":1,"amount":500}"#, r#"{"user":"u1","amount":500}"#, false),
        ("a lone surrogate and its replacement", r#"{"note":"\ud800"}"#, r#"{"note":"\ufffd"}"#, false),
    ];
    for (runs, (case, first, second, one_value)) in (1..).zip(cases) {
        println!("case: {case}");
        let (_, second) = same_key(&gw, first, second).await;
        if one_value {
            assert_eq!(second.status, 201, "{case}: {second}");
            assert!(second.replayed(), "{case}: one JSON value: {second}");
        } else {
            second.assert_problem(422, "key-mismatch");
            assert!(!second.replayed(), "{case}: {second}");
        }
        assert_eq!(count(&upstream.state.pay), runs, "{case}: only the first of each ran");
    }
}

// ---------------------------------------------------------------------------------------------
// Scopes
// ---------------------------------------------------------------------------------------------

/// A keyed payment from the caller named by `X-User-Id: user` (raw bytes).
async fn pay_as(gw: &Gateway, key: &str, user: &[&[u8]]) -> Reply {
    let mut request = gw.keyed("/pay", key, r#"{"amount":100}"#);
    for value in user {
        request = request.header("x-user-id", HeaderValue::from_bytes(value).expect("a header value"));
    }
    send(request).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scope_headers_are_compared_byte_for_byte() {
    let (upstream, gw, key) = common::start(&["--scope", "header:X-User-Id"]).await;
    // "müller" and "mäller" in Latin-1: not UTF-8, and one scope after a lossy conversion.
    let mueller = pay_as(&gw, &key, &[b"m\xfcller"]).await;
    let maeller = pay_as(&gw, &key, &[b"m\xe4ller"]).await;
    assert_eq!(mueller.status, 201, "{mueller}");
    assert_eq!(maeller.status, 201, "{maeller}");
    assert!(
        !maeller.replayed(),
        "another user must never get the first user's answer: {maeller}"
    );
    assert_ne!(mueller.charge(), maeller.charge());
    assert_eq!(count(&upstream.state.pay), 2);

    // Each still gets its own answer on a retry.
    let retry = pay_as(&gw, &key, &[b"m\xfcller"]).await;
    assert!(retry.replayed(), "{retry}");
    assert_eq!(retry.charge(), mueller.charge());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_scope_header_is_refused() {
    let (upstream, gw, key) = common::start(&["--scope", "header:X-User-Id"]).await;
    let alice = pay_as(&gw, &key, &[b"alice"]).await;
    assert_eq!(alice.status, 201, "{alice}");
    // Before, the first value won: alice's answer went to a request that also says "mallory".
    let both = pay_as(&gw, &key, &[b"alice", b"mallory"]).await;
    both.assert_problem(400, "scope-invalid");
    assert!(
        both.detail().contains("x-user-id"),
        "the detail names the header: {both}"
    );
    assert_eq!(count(&upstream.state.pay), 1);

    // Under the default credential scope, two Authorization headers are the same refusal.
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let twice = send(
        gw.post("/pay", "{}")
            .header("idempotency-key", new_key())
            .header("authorization", "Bearer a")
            .header("authorization", "Bearer b"),
    )
    .await;
    twice.assert_problem(400, "scope-invalid");
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_reject_refuses_keyed_requests_without_a_credential() {
    let (upstream, gw, _) = common::start(&["--anonymous", "reject"]).await;

    let anonymous = gw.post_json("/pay", Some(&new_key()), "{}").await;
    anonymous.assert_problem(401, "credential-missing");
    assert!(anonymous.detail().contains("Authorization"), "{anonymous}");
    let empty = send(
        gw.post("/pay", "{}")
            .header("idempotency-key", new_key())
            .header("authorization", ""),
    )
    .await;
    empty.assert_problem(401, "credential-missing");
    assert_eq!(count(&upstream.state.pay), 0);

    // With a credential it is the protocol as usual; keyless requests are not its business.
    let key = new_key();
    let with = |key: &str| {
        gw.post("/pay", "{}")
            .header("idempotency-key", key)
            .header("authorization", "Bearer alice")
    };
    assert_eq!(send(with(&key)).await.status, 201);
    assert!(send(with(&key)).await.replayed());
    let keyless = gw.post_json("/pay", None, "{}").await;
    assert_eq!(keyless.status, 201, "{keyless}");
    assert_eq!(count(&upstream.state.pay), 2);
}

// ---------------------------------------------------------------------------------------------
// Keys' embedded time
// ---------------------------------------------------------------------------------------------

/// A key any 26-character Crockford reading takes for a ULID created in 2016.
const ULID_LOOKING: &str = "01ARZ3NDEKTSV4RRFFQ69G5FAV";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_merely_looks_like_a_ulid_does_not_expire() {
    let (upstream, gw, _) = common::start(&[]).await;
    let first = gw.post_json("/pay", Some(ULID_LOOKING), "{}").await;
    assert_eq!(first.status, 201, "{first}");
    let retry = gw.post_json("/pay", Some(ULID_LOOKING), "{}").await;
    assert!(retry.replayed(), "{retry}");
    // A UUIDv7 from two days ago still expires on sight: its version digit says what it is.
    let old = common::uuid_v7_at(common::now_millis() - 48 * 3600 * 1000);
    gw.post_json("/pay", Some(&old), "{}")
        .await
        .assert_problem(422, "key-expired");
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ulid_times_expire_keys_only_when_asked() {
    let (upstream, gw, _) = common::start(&["--expire-by-key-time", "uuid7,ulid"]).await;
    gw.post_json("/pay", Some(ULID_LOOKING), "{}")
        .await
        .assert_problem(422, "key-expired");

    let off = Gateway::start(&upstream.url(), &["--expire-by-key-time", "off"]).await;
    let old = common::uuid_v7_at(common::now_millis() - 48 * 3600 * 1000);
    let answer = off.post_json("/pay", Some(&old), "{}").await;
    assert_eq!(answer.status, 201, "with off, no key expires by its own time: {answer}");
    assert_eq!(count(&upstream.state.pay), 1);
}

// ---------------------------------------------------------------------------------------------
// Settings that cannot work
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_that_cannot_work_never_start() {
    for (args, flag) in [
        (&["--lease", "0s"][..], "--lease"),
        (&["--lease", "500ms"], "--lease"),
        (&["--ttl", "0s"], "--ttl"),
        (&["--run-timeout", "0s"], "--run-timeout"),
        (&["--scope", "extension"], "--scope"),
        (&["--scope", "none", "--anonymous", "reject"], "--anonymous"),
        (&["--anonymous", "maybe"], "--anonymous"),
        (&["--expire-by-key-time", "uuid4"], "--expire-by-key-time"),
    ] {
        common::assert_serve_refuses(args, flag).await;
    }
}

/// A `header:` scope on a header that carries a credential would store it in clear in every
/// record and print it in every log line: refused, pointing to `--scope credential`, whether it
/// comes from the flag, the environment or a route of the config file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_scope_on_a_credential_never_starts() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let route_file = dir.path().join("idem.toml");
    std::fs::write(
        &route_file,
        "[[route]]\npath = \"/pay\"\nscope = \"header:X-Api-Key\"\n",
    )
    .unwrap();
    let route_file = route_file.to_str().unwrap();
    let upstream = ["--upstream", "http://127.0.0.1:9"];
    for (what, args, env, names) in [
        ("--scope", &["--scope", "header:Authorization"][..], &[][..], "--scope"),
        ("--scope Cookie", &["--scope", "header:cookie"], &[], "--scope"),
        (
            "IDEM_SCOPE",
            &[],
            &[("IDEM_SCOPE", "header:Proxy-Authorization")],
            "--scope",
        ),
        (
            "--scope X-Auth-Token",
            &["--scope", "header:X-Auth-Token"],
            &[],
            "--scope",
        ),
        (
            "a route's scope",
            &["--config", route_file],
            &[],
            "route \"/pay\": scope",
        ),
    ] {
        let output = common::serve_refusing(&[&upstream[..], args].concat(), env).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(names), "{what}: names the setting ({names}): {stderr}");
        assert!(stderr.contains("carries a credential"), "{what}: says why: {stderr}");
        assert!(
            stderr.contains("--scope credential"),
            "{what}: says what to use: {stderr}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Bodies that break off
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_breaks_off_is_body_incomplete_and_claims_nothing() {
    let (upstream, gw, key) = common::start(&[]).await;
    // A chunked body whose second chunk-size line is not a number: the body cannot be read whole.
    let raw = format!(
        "POST /pay HTTP/1.1\r\nhost: idem\r\nidempotency-key: {key}\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\n\r\n5\r\n{{\"a\":\r\nzz\r\n"
    );
    let (answers, ending) = wire::exchange(gw.addr(), raw.as_bytes(), false, 1, Duration::from_secs(10)).await;
    let answer = answers.first().unwrap_or_else(|| panic!("no answer: {ending:?}"));
    assert_eq!(answer.status, 400, "{answer}");
    assert!(answer.is_problem(), "{answer}");
    assert!(answer.text().contains("urn:idem:problem:body-incomplete"), "{answer}");
    assert_eq!(count(&upstream.state.pay), 0);

    // Nothing was claimed: the same key sent whole runs at once, as new.
    let whole = gw.post_json("/pay", Some(&key), r#"{"a":1}"#).await;
    assert_eq!(whole.status, 201, "{whole}");
    assert!(!whole.replayed(), "{whole}");
    assert_eq!(whole.header("x-seen-recovered"), None, "{whole}");
    assert_eq!(count(&upstream.state.pay), 1);
}
