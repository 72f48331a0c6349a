//! The gateway (`idem serve`) end to end: a real upstream, a real process, a real SQLite store.
//! Each test asserts something a user of the gateway relies on.

mod common;

use std::time::Duration;

use common::{Gateway, Upstream, count, new_key, now_millis, send, uuid_v7_at, wait_for_count};

const PAY_BODY: &str = r#"{"amount":1000,"currency":"EUR"}"#;

/// Strips the sf-string quotes a gateway may have added when forwarding the key.
fn unquote(value: &str) -> &str {
    value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value)
}

// ---------------------------------------------------------------------------------------------
// Replays
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_gets_the_stored_answer_and_the_upstream_runs_once() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let first = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    assert_eq!(first.status, 201, "{first}");
    assert!(!first.replayed(), "the first answer is not a replay: {first}");
    assert_eq!(first.header("location").as_deref(), Some("/charges/1"), "{first}");
    assert!(
        first.header("set-cookie").is_some(),
        "the live answer passes the upstream's Set-Cookie on: {first}"
    );
    // The key reached the upstream, so it can pass it on to its own payment provider.
    let seen = upstream.state.seen("pay");
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].key.as_deref().map(unquote), Some(key.as_str()), "{seen:?}");
    assert_eq!(seen[0].recovered, None, "a first run is not recovered: {seen:?}");

    let second = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    assert_eq!(second.status, 201, "{second}");
    assert!(
        second.replayed(),
        "the retry is marked Idempotency-Replayed: true: {second}"
    );
    assert_eq!(second.body, first.body, "the replay carries the same body");
    assert_eq!(second.header("location").as_deref(), Some("/charges/1"), "{second}");
    assert_eq!(
        second.header("content-type").as_deref(),
        Some("application/json"),
        "{second}"
    );
    assert!(
        second.header("set-cookie").is_none(),
        "Set-Cookie is never replayed: {second}"
    );
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_patch_is_protected_by_default() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let patch = || {
        gw.client
            .patch(gw.url("/pay"))
            .header("content-type", "application/json")
            .header("idempotency-key", key.as_str())
            .body(PAY_BODY)
    };
    let first = send(patch()).await;
    assert_eq!(first.status, 201, "{first}");
    let second = send(patch()).await;
    assert!(second.replayed(), "{second}");
    assert_eq!(second.body, first.body);
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quoted_sf_string_key_and_a_bare_key_name_the_same_record() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let first = gw.post_json("/pay", Some(&format!("\"{key}\"")), PAY_BODY).await;
    assert_eq!(first.status, 201, "{first}");
    let second = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    assert_eq!(second.status, 201, "{second}");
    assert!(second.replayed(), "{second}");
    assert_eq!(second.body, first.body);
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_key_order_and_whitespace_do_not_count() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let first = gw
        .post_json("/pay", Some(&key), r#"{"amount":1000,"currency":"EUR","tags":[1,2]}"#)
        .await;
    assert_eq!(first.status, 201, "{first}");
    let reordered = "{\n  \"tags\": [1, 2],\n  \"currency\": \"EUR\",\n  \"amount\": 1000\n}\n";
    let second = gw.post_json("/pay", Some(&key), reordered).await;
    assert_eq!(
        second.status, 201,
        "a re-serialised retry is the same request: {second}"
    );
    assert!(second.replayed(), "{second}");
    assert_eq!(second.body, first.body);
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_declared_json_that_does_not_parse_is_passed_on_and_replayed() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();
    let broken = r#"{"amount": 1000, "currency":"#;

    let first = gw.post_json("/pay", Some(&key), broken).await;
    assert_eq!(first.status, 201, "the gateway is no JSON validator: {first}");
    assert_eq!(
        first.json("received").as_deref(),
        Some(broken),
        "the body is passed on as sent"
    );
    let second = gw.post_json("/pay", Some(&key), broken).await;
    assert_eq!(second.status, 201, "{second}");
    assert!(second.replayed(), "{second}");
    assert_eq!(second.body, first.body);
    assert_eq!(count(&upstream.state.pay), 1);
}

// ---------------------------------------------------------------------------------------------
// Mismatches
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_another_body_is_a_mismatch_naming_the_body() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let first = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    assert_eq!(first.status, 201, "{first}");
    let other = gw
        .post_json("/pay", Some(&key), r#"{"amount":2000,"currency":"EUR"}"#)
        .await;
    other.assert_problem(422, "key-mismatch");
    assert!(
        other.detail().to_lowercase().contains("body"),
        "the detail names the body: {other}"
    );
    assert!(!other.replayed(), "{other}");
    assert_eq!(count(&upstream.state.pay), 1, "a mismatch never reaches the upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_another_query_is_a_mismatch_naming_the_query() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let first = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    assert_eq!(first.status, 201, "{first}");
    let other = gw.post_json("/pay?delay=1", Some(&key), PAY_BODY).await;
    other.assert_problem(422, "key-mismatch");
    assert!(
        other.detail().to_lowercase().contains("query"),
        "the detail names the query: {other}"
    );
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_on_another_path_is_a_mismatch_naming_the_path() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let first = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    assert_eq!(first.status, 201, "{first}");
    let other = gw.post_json("/status/201", Some(&key), PAY_BODY).await;
    other.assert_problem(422, "key-mismatch");
    assert!(
        other.detail().to_lowercase().contains("path"),
        "the detail names the path: {other}"
    );
    assert_eq!(count(&upstream.state.pay), 1);
    assert_eq!(
        count(&upstream.state.status),
        0,
        "a mismatch never reaches the upstream"
    );
}

// ---------------------------------------------------------------------------------------------
// Concurrent copies
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_copy_waits_and_gets_the_replay() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let (a, b) = tokio::join!(
        gw.post_json("/pay?delay=800", Some(&key), PAY_BODY),
        gw.post_json("/pay?delay=800", Some(&key), PAY_BODY),
    );
    assert_eq!(a.status, 201, "{a}");
    assert_eq!(b.status, 201, "{b}");
    assert_eq!(a.body, b.body, "both copies get the one answer");
    assert_eq!(
        usize::from(a.replayed()) + usize::from(b.replayed()),
        1,
        "exactly one of the two is a replay: {a} / {b}"
    );
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_waiting_past_the_wait_limit_gets_409_with_retry_after() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--wait", "200ms"]).await;
    let key = new_key();

    let first = {
        let request = gw
            .post("/pay?delay=3000", PAY_BODY)
            .header("content-type", "application/json")
            .header("idempotency-key", key.as_str());
        tokio::spawn(send(request))
    };
    wait_for_count(&upstream.state.pay, 1, Duration::from_secs(10)).await;

    let second = gw.post_json("/pay?delay=3000", Some(&key), PAY_BODY).await;
    second.assert_problem(409, "key-in-flight");
    let retry_after = second
        .header("retry-after")
        .expect("409 key-in-flight carries Retry-After");
    assert!(
        retry_after.trim().parse::<u64>().is_ok_and(|s| s >= 1),
        "Retry-After is a number of seconds: {retry_after:?}"
    );

    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "the first copy still completes: {first}");
    assert_eq!(count(&upstream.state.pay), 1);
}

// ---------------------------------------------------------------------------------------------
// Scopes
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_credentials_with_the_same_key_never_share_an_answer() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let pay_as = |who: &'static str| {
        let request = gw
            .post("/pay", PAY_BODY)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {who}"))
            .header("idempotency-key", key.as_str());
        send(request)
    };
    let alice = pay_as("alice").await;
    let bob = pay_as("bob").await;
    assert_eq!(alice.status, 201, "{alice}");
    assert_eq!(bob.status, 201, "{bob}");
    assert!(!bob.replayed(), "bob never gets alice's answer: {bob}");
    assert_ne!(alice.charge(), bob.charge(), "two tenants, two charges");
    assert_eq!(count(&upstream.state.pay), 2);

    let alice_again = pay_as("alice").await;
    assert!(alice_again.replayed(), "{alice_again}");
    assert_eq!(alice_again.body, alice.body, "alice's retry gets alice's answer");
    assert_eq!(count(&upstream.state.pay), 2);
}

/// An authentication scheme is case-insensitive and may be followed by more than one space (RFC
/// 9110 §11): a retry that spells the same credential otherwise is the same caller, and replays;
/// the credential itself is case-sensitive, and another is another caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spellings_of_one_credential_are_one_caller() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();
    let pay_as = |authorization: &'static str| {
        let request = gw
            .post("/pay", PAY_BODY)
            .header("content-type", "application/json")
            .header("authorization", authorization)
            .header("idempotency-key", key.as_str());
        send(request)
    };
    let first = pay_as("Bearer tok_A1").await;
    assert_eq!((first.status, first.replayed()), (201, false), "{first}");
    for spelling in ["bearer tok_A1", "BEARER tok_A1", "Bearer   tok_A1"] {
        let again = pay_as(spelling).await;
        assert!(again.replayed() && again.body == first.body, "{spelling}: {again}");
    }
    assert_eq!(count(&upstream.state.pay), 1, "one caller, one run");
    let other = pay_as("Bearer tok_a1").await;
    assert_eq!(
        (other.status, other.replayed()),
        (201, false),
        "another credential: {other}"
    );
    assert_eq!(count(&upstream.state.pay), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_scope_keeps_users_apart() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--scope", "header:X-User-Id"]).await;
    let key = new_key();

    let pay_as = |who: &'static str| {
        let request = gw
            .post("/pay", PAY_BODY)
            .header("content-type", "application/json")
            .header("x-user-id", who)
            .header("idempotency-key", key.as_str());
        send(request)
    };
    let u1 = pay_as("u1").await;
    let u2 = pay_as("u2").await;
    assert_eq!(u1.status, 201, "{u1}");
    assert_eq!(u2.status, 201, "{u2}");
    assert!(!u2.replayed(), "{u2}");
    assert_ne!(u1.charge(), u2.charge());
    assert_eq!(count(&upstream.state.pay), 2);

    let u1_again = pay_as("u1").await;
    assert!(u1_again.replayed(), "{u1_again}");
    assert_eq!(u1_again.body, u1.body);
    assert_eq!(count(&upstream.state.pay), 2);
}

// ---------------------------------------------------------------------------------------------
// Keys: missing and invalid
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_key_is_refused_when_required() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--missing-key", "require"]).await;

    let reply = gw.post_json("/pay", None, PAY_BODY).await;
    reply.assert_problem(400, "key-missing");
    assert_eq!(count(&upstream.state.pay), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_keys_are_refused_and_never_processed() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;

    let two_headers = gw
        .post("/pay", PAY_BODY)
        .header("content-type", "application/json")
        .header("idempotency-key", "first-key")
        .header("idempotency-key", "second-key");
    let reply = send(two_headers).await;
    reply.assert_problem(400, "key-invalid");

    let too_long = "k".repeat(256);
    for bad in [r#""a", "b""#, too_long.as_str(), r#""unterminated"#, "a,b", r#""""#] {
        let reply = gw.post_json("/pay", Some(bad), PAY_BODY).await;
        assert_eq!(reply.status, 400, "key {bad:?}: {reply}");
        reply.assert_problem(400, "key-invalid");
    }
    assert_eq!(count(&upstream.state.pay), 0, "an invalid key is never processed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_255_characters_is_accepted() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = "k".repeat(255);

    let first = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    assert_eq!(first.status, 201, "{first}");
    let second = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    assert!(second.replayed(), "{second}");
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyless_post_passes_through_by_default() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;

    let a = gw.post_json("/pay", None, PAY_BODY).await;
    let b = gw.post_json("/pay", None, PAY_BODY).await;
    assert_eq!(a.status, 201, "{a}");
    assert_eq!(b.status, 201, "{b}");
    assert!(
        !a.replayed() && !b.replayed(),
        "keyless requests are not deduplicated: {b}"
    );
    assert_ne!(a.charge(), b.charge());
    assert_eq!(count(&upstream.state.pay), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fingerprint_policy_catches_a_keyless_double_tap() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--missing-key", "fingerprint:10s"]).await;
    // The double tap of one caller: the same credential, the same body.
    let tap = |body: &'static str| {
        send(
            gw.post("/pay", body)
                .header("content-type", "application/json")
                .header("authorization", "Bearer alice"),
        )
    };

    let a = tap(PAY_BODY).await;
    assert_eq!(a.status, 201, "{a}");
    assert!(!a.replayed(), "{a}");
    let b = tap(PAY_BODY).await;
    assert_eq!(b.status, 201, "{b}");
    assert!(b.replayed(), "the double tap is replayed: {b}");
    assert_eq!(b.body, a.body);
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");

    // Another body is another request.
    let c = tap(r#"{"amount":5}"#).await;
    assert_eq!(c.status, 201, "{c}");
    assert!(!c.replayed(), "{c}");
    assert_eq!(count(&upstream.state.pay), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fingerprint_policy_never_merges_two_anonymous_callers() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--missing-key", "fingerprint:10s"]).await;

    // Two people without a credential who post the same body: nothing tells them apart, so
    // neither may get the other's answer.
    let a = gw.post_json("/pay", None, PAY_BODY).await;
    let b = gw.post_json("/pay", None, PAY_BODY).await;
    assert_eq!((a.status, b.status), (201, 201), "{a}\n{b}");
    assert!(
        !a.replayed() && !b.replayed(),
        "no answer is another caller's: {a}\n{b}"
    );
    assert_ne!(a.charge(), b.charge(), "each ran");
    assert_eq!(count(&upstream.state.pay), 2, "the upstream ran twice");

    // Two callers with credentials of their own are two scopes: each runs once.
    let as_caller = |who: &'static str| {
        send(
            gw.post("/pay", PAY_BODY)
                .header("content-type", "application/json")
                .header("authorization", who),
        )
    };
    let alice = as_caller("Bearer alice").await;
    let bob = as_caller("Bearer bob").await;
    assert!(!alice.replayed() && !bob.replayed(), "{alice}\n{bob}");
    assert_eq!(count(&upstream.state.pay), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fingerprint_with_one_shared_scope_is_refused_at_start() {
    let output = common::serve_refusing(
        &[
            "--upstream",
            "http://127.0.0.1:9",
            "--scope",
            "none",
            "--missing-key",
            "fingerprint:5s",
        ],
        &[],
    )
    .await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--missing-key") && stderr.contains("--scope none"),
        "names both settings: {stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_the_grace_period_keyless_requests_pass_with_deprecation_headers() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--missing-key", "grace:2099-01-01T00:00:00Z"]).await;

    let reply = gw.post_json("/pay", None, PAY_BODY).await;
    assert_eq!(reply.status, 201, "{reply}");
    assert!(
        reply.header("sunset").is_some(),
        "a Sunset header announces the date: {reply}"
    );
    assert!(reply.header("deprecation").is_some(), "a Deprecation header: {reply}");
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_grace_period_a_key_is_required() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--missing-key", "grace:2000-01-01T00:00:00Z"]).await;

    let reply = gw.post_json("/pay", None, PAY_BODY).await;
    reply.assert_problem(400, "key-missing");
    assert_eq!(count(&upstream.state.pay), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_a_key_passes_through_untouched() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    for n in 1..=2 {
        let reply = send(gw.client.get(gw.url("/pay")).header("idempotency-key", key.as_str())).await;
        assert_eq!(reply.status, 200, "{reply}");
        assert!(!reply.replayed(), "a GET is never replayed: {reply}");
        assert_eq!(reply.json("read").as_deref(), Some(n.to_string().as_str()), "{reply}");
    }
    assert_eq!(count(&upstream.state.pay_get), 2);
    let seen = upstream.state.seen("pay_get");
    assert_eq!(
        seen[1].key.as_deref(),
        Some(key.as_str()),
        "the header is passed on as sent"
    );
}

// ---------------------------------------------------------------------------------------------
// What is stored
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_releases_the_key_and_the_retry_runs_again() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let first = gw.post_json("/flaky", Some(&key), "{}").await;
    assert_eq!(first.status, 500, "the upstream's 500 is passed on: {first}");
    let second = gw.post_json("/flaky", Some(&key), "{}").await;
    assert_eq!(second.status, 201, "the retry runs again: {second}");
    assert!(!second.replayed(), "{second}");
    let third = gw.post_json("/flaky", Some(&key), "{}").await;
    assert_eq!(third.status, 201, "{third}");
    assert!(third.replayed(), "the success is stored: {third}");
    assert_eq!(third.body, second.body);
    assert_eq!(count(&upstream.state.flaky), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_store_5xx_a_500_is_kept_and_replayed() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--store-5xx"]).await;
    let key = new_key();

    let first = gw.post_json("/flaky", Some(&key), "{}").await;
    assert_eq!(first.status, 500, "{first}");
    let second = gw.post_json("/flaky", Some(&key), "{}").await;
    assert_eq!(second.status, 500, "--store-5xx keeps the 500: {second}");
    assert!(second.replayed(), "{second}");
    assert_eq!(second.body, first.body);
    assert_eq!(count(&upstream.state.flaky), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_4xx_is_stored_and_replayed() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let first = gw.post_json("/status/404", Some(&key), "{}").await;
    assert_eq!(first.status, 404, "{first}");
    let second = gw.post_json("/status/404", Some(&key), "{}").await;
    assert_eq!(second.status, 404, "{second}");
    assert!(second.replayed(), "a 404 is a final answer: {second}");
    assert_eq!(second.body, first.body);
    assert_eq!(count(&upstream.state.status), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_is_not_stored() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let first = gw.post_json("/status/429", Some(&key), "{}").await;
    assert_eq!(first.status, 429, "{first}");
    let second = gw.post_json("/status/429", Some(&key), "{}").await;
    assert_eq!(second.status, 429, "{second}");
    assert!(
        !second.replayed(),
        "a 429 asks for a retry, which must run again: {second}"
    );
    assert_eq!(count(&upstream.state.status), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_answer_is_never_re_run_and_replays_compact() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--max-stored-body", "1KiB"]).await;
    let key = new_key();

    let first = gw.post_json("/big?size=200000", Some(&key), "{}").await;
    assert_eq!(first.status, 201, "{first}");
    assert_eq!(first.body.len(), 200_000, "the live answer streams in full");
    assert!(first.body.iter().enumerate().all(|(i, &b)| b == b'a' + (i % 26) as u8));

    let second = gw.post_json("/big?size=200000", Some(&key), "{}").await;
    assert_eq!(second.status, 201, "the replay keeps the status: {second}");
    assert!(second.replayed(), "{second}");
    assert!(second.body.is_empty(), "the compact replay has an empty body: {second}");
    assert_eq!(
        second.header("content-location").as_deref(),
        Some("/big/1"),
        "the replay says where to fetch the resource: {second}"
    );
    assert_eq!(
        count(&upstream.state.big),
        1,
        "a large answer is no reason to run again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_chunked_answer_is_stored_whole() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let first = gw.post_json("/chunked", Some(&key), "{}").await;
    assert_eq!(first.status, 201, "{first}");
    assert_eq!(first.text(), r#"{"order":1,"items":["a","b","c"]}"#, "{first}");
    let second = gw.post_json("/chunked", Some(&key), "{}").await;
    assert_eq!(second.status, 201, "{second}");
    assert!(second.replayed(), "{second}");
    assert_eq!(
        second.text(),
        first.text(),
        "an answer without Content-Length but under --max-stored-body is replayed whole: {second}"
    );
    assert_eq!(count(&upstream.state.chunked), 1);
}

// ---------------------------------------------------------------------------------------------
// Clients that go away, time and retention
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hanging_up_does_not_cancel_the_request() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let impatient = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let gone = impatient
        .post(gw.url("/pay?delay=1500"))
        .header("content-type", "application/json")
        .header("idempotency-key", key.as_str())
        .body(PAY_BODY)
        .send()
        .await;
    assert!(gone.is_err(), "the client gave up before the answer: {gone:?}");
    drop(impatient);

    tokio::time::sleep(Duration::from_secs(2)).await;
    let retry = gw.post_json("/pay?delay=1500", Some(&key), PAY_BODY).await;
    assert_eq!(retry.status, 201, "{retry}");
    assert!(retry.replayed(), "the hung-up request was finished and stored: {retry}");
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_ttl_the_key_is_expired_not_re_run() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--ttl", "1s"]).await;
    let key = new_key();

    let first = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    assert_eq!(first.status, 201, "{first}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    late.assert_problem(422, "key-expired");
    assert!(
        late.detail().to_lowercase().contains("new key"),
        "the detail tells the client to use a new key: {late}"
    );
    assert_eq!(count(&upstream.state.pay), 1, "an expired key is never re-run silently");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uuid_v7_key_older_than_the_ttl_is_expired_at_once() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let two_days = 2 * 24 * 3600 * 1000;
    let key = uuid_v7_at(now_millis() - two_days);

    let reply = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    reply.assert_problem(422, "key-expired");
    assert_eq!(count(&upstream.state.pay), 0, "the upstream is not called");

    // A fresh UUIDv7 is an ordinary key.
    let fresh = uuid_v7_at(now_millis());
    let ok = gw.post_json("/pay", Some(&fresh), PAY_BODY).await;
    assert_eq!(ok.status, 201, "{ok}");
    assert_eq!(count(&upstream.state.pay), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_body_over_the_limit_is_413() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--max-body", "1KiB"]).await;
    let key = new_key();
    let body = format!(r#"{{"memo":"{}"}}"#, "x".repeat(2048));

    let reply = gw.post_json("/pay", Some(&key), &body).await;
    reply.assert_problem(413, "body-too-large");
    assert_eq!(count(&upstream.state.pay), 0);

    // A body under the limit with another key goes through.
    let ok = gw.post_json("/pay", Some(&new_key()), PAY_BODY).await;
    assert_eq!(ok.status, 201, "{ok}");
}

// ---------------------------------------------------------------------------------------------
// The upstream's side
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_releases_the_key() {
    let addr = common::reserve_port();
    let gw = Gateway::start(&format!("http://{addr}"), &[]).await;
    let key = new_key();

    let down = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    down.assert_problem(502, "upstream-unavailable");

    let upstream = Upstream::start_on(addr).await;
    let up = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    assert_eq!(up.status, 201, "the key was released, so the retry runs: {up}");
    assert!(!up.replayed(), "{up}");
    assert_eq!(count(&upstream.state.pay), 1);
    let seen = upstream.state.seen("pay");
    assert_eq!(
        seen[0].recovered, None,
        "nothing was sent the first time, so this is no recovery: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_mid_answer_is_502_and_the_rerun_is_marked_recovered() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();

    let request = gw
        .post("/break-once", PAY_BODY)
        .header("content-type", "application/json")
        .header("idempotency-key", key.as_str());
    let broken = common::try_send(request)
        .await
        .unwrap_or_else(|err| panic!("expected a whole 502 upstream-failed answer; {err}"));
    broken.assert_problem(502, "upstream-failed");

    let retry = gw.post_json("/break-once", Some(&key), PAY_BODY).await;
    assert_eq!(retry.status, 201, "{retry}");
    assert_eq!(count(&upstream.state.break_once), 2);
    let seen = upstream.state.seen("break_once");
    assert_eq!(seen[0].recovered, None, "{seen:?}");
    assert_eq!(
        seen[1].recovered.as_deref(),
        Some("true"),
        "the re-run tells the upstream that an earlier run may have happened: {seen:?}"
    );
    assert_eq!(seen[1].key.as_deref().map(unquote), Some(key.as_str()));

    let replay = gw.post_json("/break-once", Some(&key), PAY_BODY).await;
    assert!(replay.replayed(), "{replay}");
    assert_eq!(replay.body, retry.body);
    assert_eq!(count(&upstream.state.break_once), 2);
}

/// A recovered run that cannot reach the upstream leaves the earlier run's outcome as unknown as
/// it was: the run after it is still marked recovered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_survives_a_recovery_that_could_not_reach_the_upstream() {
    let addr = common::reserve_port();
    let upstream = Upstream::start_on(addr).await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();
    let pay = || {
        gw.post("/break-once", PAY_BODY)
            .header("content-type", "application/json")
            .header("idempotency-key", key.as_str())
    };

    let lost = common::try_send(pay()).await.expect("a whole answer");
    lost.assert_problem(502, "upstream-failed");
    assert_eq!(count(&upstream.state.break_once), 1);

    drop(upstream);
    let down = common::try_send(pay()).await.expect("a whole answer");
    down.assert_problem(502, "upstream-unavailable");

    let upstream = Upstream::start_on(addr).await;
    let _ = common::try_send(pay()).await;
    let seen = upstream.state.seen("break_once");
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        seen[0].recovered.as_deref(),
        Some("true"),
        "the first run's outcome is still unknown, whatever the recovery that never reached the upstream did: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_past_its_ttl_is_key_expired_until_its_tombstone_ends() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--ttl", "1s", "--tombstone-ttl", "1h"]).await;
    let key = new_key();

    let request = gw
        .post("/break-once", PAY_BODY)
        .header("content-type", "application/json")
        .header("idempotency-key", key.as_str());
    let broken = common::try_send(request)
        .await
        .unwrap_or_else(|err| panic!("expected a whole 502 upstream-failed answer; {err}"));
    broken.assert_problem(502, "upstream-failed");

    // Past the ttl the outcome is as expired as an answer would be: the upstream is not run again
    // (as it was, unflagged, when an unknown outcome was kept only for the ttl).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = gw.post_json("/break-once", Some(&key), PAY_BODY).await;
    late.assert_problem(422, "key-expired");
    let other = gw.post_json("/break-once", Some(&key), r#"{"amount":1}"#).await;
    other.assert_problem(422, "key-expired");
    assert_eq!(count(&upstream.state.break_once), 1, "the upstream ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upstream_gets_504_and_its_answer_is_kept_for_the_retry() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &["--upstream-timeout", "300ms"]).await;
    let key = new_key();

    let slow = gw.post_json("/pay?delay=1500", Some(&key), PAY_BODY).await;
    slow.assert_problem(504, "upstream-timeout");
    assert!(slow.header("retry-after").is_some(), "504 carries Retry-After: {slow}");

    tokio::time::sleep(Duration::from_secs(2)).await;
    let retry = gw.post_json("/pay?delay=1500", Some(&key), PAY_BODY).await;
    assert_eq!(retry.status, 201, "{retry}");
    assert!(
        retry.replayed(),
        "the gateway kept waiting and stored the answer: {retry}"
    );
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
}

/// A request whose head is over the gateway's 400 KiB is refused `431` before anything is claimed
/// or sent, whatever one read of it brings: it never reaches the upstream (where it would break
/// the connection mid-request and leave its key unknown). Just under the limit, it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_over_the_limit_is_refused_before_it_reaches_the_upstream() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    for size in [401 * 1024, 450 * 1024, 600 * 1024] {
        let key = new_key();
        let request = gw
            .post("/pay", PAY_BODY)
            .header("content-type", "application/json")
            .header("idempotency-key", key.as_str())
            .header("x-junk", "j".repeat(size));
        match common::try_send(request).await {
            Ok(reply) => assert_eq!(reply.status, 431, "a {size}-byte header: {reply}"),
            // hyper may close instead, when its buffer fills before the head is whole: the client
            // sees the connection closed or reset, or its write of the rest fail (a broken pipe).
            Err(err) => assert!(
                ["closed", "reset", "error", "BrokenPipe", "Broken pipe"]
                    .iter()
                    .any(|said| err.contains(said)),
                "{err}"
            ),
        }
        assert_eq!(
            count(&upstream.state.pay),
            0,
            "a {size}-byte header reached the upstream"
        );
    }
    // On a connection of its own: one the gateway closed after a refusal may still sit in the
    // client's pool, and a request written to it fails in the client, never reaching idem.
    let key = new_key();
    let fits = common::client()
        .post(gw.url("/pay"))
        .body(PAY_BODY)
        .header("content-type", "application/json")
        .header("idempotency-key", key.as_str())
        .header("x-junk", "j".repeat(300 * 1024));
    assert_eq!(send(fits).await.status, 201);
    assert_eq!(count(&upstream.state.pay), 1);
}

/// The client's W3C trace context reaches the upstream as it was sent, so that the service's own
/// spans join the client's trace; the record keeps its trace id (`idem inspect`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_context_reaches_the_upstream_and_the_record() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url(), &[]).await;
    let key = new_key();
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let request = gw
        .post("/pay", PAY_BODY)
        .header("content-type", "application/json")
        .header("idempotency-key", key.as_str())
        .header("traceparent", traceparent)
        .header("tracestate", "vendor=opaque");
    assert_eq!(send(request).await.status, 201);
    let seen = upstream.state.last_headers("pay").expect("the upstream was called");
    assert_eq!(seen.get("traceparent").and_then(|v| v.to_str().ok()), Some(traceparent));
    assert_eq!(
        seen.get("tracestate").and_then(|v| v.to_str().ok()),
        Some("vendor=opaque")
    );
    let inspect = common::run_idem(
        &["inspect", "--json", "--store", &gw.store, &key],
        Duration::from_secs(60),
    )
    .await;
    let json: serde_json::Value = serde_json::from_slice(&inspect.stdout).expect("one JSON object");
    assert_eq!(json["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736", "{json}");
}
