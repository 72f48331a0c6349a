//! The gateway (`idem serve`) end to end: a real upstream, a real process, a real SQLite store.
//! Each test asserts something a user of the gateway relies on. Cases that differ only in their
//! values are tables: each case runs on an upstream and a gateway of its own, and its name is
//! printed first, so that a failure names it.

mod common;

use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use common::{Gateway, Upstream, UpstreamState, count, new_key, now_millis, send, start, uuid_v7_at, wait_for_count};

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
    let (upstream, gw, key) = start(&[]).await;

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

/// How a request carries its key.
#[derive(Debug, Clone, Copy)]
enum Spelling {
    /// The key as it is.
    Bare,
    /// The key as a quoted sf-string.
    Quoted,
    /// 255 characters, the longest key.
    Longest,
}

/// A retry that says the same request in other words (another method of the protected ones,
/// another spelling of the key, the body's JSON otherwise serialised, a body that only claims to be
/// JSON): the first runs, the second is its replay, and the upstream ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_the_same_request_in_other_words_is_replayed() {
    let broken = r#"{"amount": 1000, "currency":"#;
    let reordered = "{\n  \"tags\": [1, 2],\n  \"currency\": \"EUR\",\n  \"amount\": 1000\n}\n";
    #[rustfmt::skip]
    let cases = [
        ("a keyed PATCH is protected by default", "PATCH", [Spelling::Bare; 2], [PAY_BODY; 2]),
        ("a quoted key and a bare one name one record", "POST", [Spelling::Quoted, Spelling::Bare], [PAY_BODY; 2]),
        ("JSON key order and whitespace do not count", "POST", [Spelling::Bare; 2],
            [r#"{"amount":1000,"currency":"EUR","tags":[1,2]}"#, reordered]),
        ("a body declared JSON that does not parse is passed on as sent", "POST", [Spelling::Bare; 2], [broken; 2]),
        ("a key of 255 characters is accepted", "POST", [Spelling::Longest; 2], [PAY_BODY; 2]),
    ];
    for (case, method, spellings, bodies) in cases {
        println!("case: {case}");
        let (upstream, gw, key) = start(&[]).await;
        let mut replies = Vec::new();
        for (spelling, body) in spellings.into_iter().zip(bodies) {
            let key = match spelling {
                Spelling::Bare => key.clone(),
                Spelling::Quoted => format!("\"{key}\""),
                Spelling::Longest => "k".repeat(255),
            };
            let request = gw
                .client
                .request(method.parse().expect("a method"), gw.url("/pay"))
                .header("content-type", "application/json")
                .header("idempotency-key", key)
                .body(body);
            replies.push(send(request).await);
        }
        let [first, second] = &replies[..] else { unreachable!() };
        assert_eq!(first.status, 201, "{case}: {first}");
        assert_eq!(
            first.json("received").as_deref(),
            Some(bodies[0]),
            "{case}: the body is passed on as sent"
        );
        assert_eq!(second.status, 201, "{case}: {second}");
        assert!(second.replayed(), "{case}: {second}");
        assert_eq!(second.body, first.body, "{case}");
        assert_eq!(count(&upstream.state.pay), 1, "{case}");
    }
}

// ---------------------------------------------------------------------------------------------
// Mismatches
// ---------------------------------------------------------------------------------------------

/// The same key with another request is refused `422 key-mismatch`, the detail naming what
/// differs, and never reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_another_request_is_a_mismatch_naming_what_differs() {
    let cases = [
        ("body", "/pay", r#"{"amount":2000,"currency":"EUR"}"#),
        ("query", "/pay?delay=1", PAY_BODY),
        ("path", "/status/201", PAY_BODY),
    ];
    for (differs, path, body) in cases {
        println!("case: another {differs}");
        let (upstream, gw, key) = start(&[]).await;
        let first = gw.post_json("/pay", Some(&key), PAY_BODY).await;
        assert_eq!(first.status, 201, "{first}");
        let other = gw.post_json(path, Some(&key), body).await;
        other.assert_problem(422, "key-mismatch");
        assert!(
            other.detail().to_lowercase().contains(differs),
            "the detail names the {differs}: {other}"
        );
        assert!(!other.replayed(), "{other}");
        assert_eq!(count(&upstream.state.pay), 1, "another {differs}");
        assert_eq!(
            count(&upstream.state.status),
            0,
            "a mismatch never reaches the upstream"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Concurrent copies
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_copy_waits_and_gets_the_replay() {
    let (upstream, gw, key) = start(&[]).await;

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
    let (upstream, gw, key) = start(&["--wait", "200ms"]).await;

    let first = {
        let request = gw.keyed("/pay?delay=3000", &key, PAY_BODY);
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

/// Two callers with the same key, told apart by their credential or by the header a scope names:
/// neither gets the other's answer, and each one's retry gets its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_callers_with_the_same_key_never_share_an_answer() {
    let cases: [(&[&str], &str, [&str; 2]); 2] = [
        (&[], "authorization", ["Bearer alice", "Bearer bob"]),
        (&["--scope", "header:X-User-Id"], "x-user-id", ["u1", "u2"]),
    ];
    for (flags, header, [a, b]) in cases {
        println!("case: {header} {a} and {b} ({flags:?})");
        let (upstream, gw, key) = start(flags).await;
        let pay_as = |who: &str| send(gw.keyed("/pay", &key, PAY_BODY).header(header, who));
        let first = pay_as(a).await;
        let other = pay_as(b).await;
        assert_eq!((first.status, other.status), (201, 201), "{first}\n{other}");
        assert!(!other.replayed(), "{b} never gets {a}'s answer: {other}");
        assert_ne!(first.charge(), other.charge(), "two callers, two charges");
        assert_eq!(count(&upstream.state.pay), 2);
        let again = pay_as(a).await;
        assert!(again.replayed(), "{again}");
        assert_eq!(again.body, first.body, "{a}'s retry gets {a}'s answer");
        assert_eq!(count(&upstream.state.pay), 2);
    }
}

/// An authentication scheme is case-insensitive and may be followed by more than one space (RFC
/// 9110 §11): a retry that spells the same credential otherwise is the same caller, and replays;
/// the credential itself is case-sensitive, and another is another caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spellings_of_one_credential_are_one_caller() {
    let (upstream, gw, key) = start(&[]).await;
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

// ---------------------------------------------------------------------------------------------
// Keys: missing and invalid
// ---------------------------------------------------------------------------------------------

/// A keyless request where a key is required (`--missing-key require`, or a grace period that
/// has ended) is refused `400 key-missing` and never processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyless_request_is_refused_where_a_key_is_required() {
    for policy in ["require", "grace:2000-01-01T00:00:00Z"] {
        println!("case: --missing-key {policy}");
        let (upstream, gw, _) = start(&["--missing-key", policy]).await;
        gw.post_json("/pay", None, PAY_BODY)
            .await
            .assert_problem(400, "key-missing");
        assert_eq!(count(&upstream.state.pay), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_keys_are_refused_and_never_processed() {
    let (upstream, gw, _) = start(&[]).await;

    let two_headers = gw
        .keyed("/pay", "first-key", PAY_BODY)
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
async fn a_keyless_post_passes_through_by_default() {
    let (upstream, gw, _) = start(&[]).await;

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
    let (upstream, gw, _) = start(&["--missing-key", "fingerprint:10s"]).await;
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
    let (upstream, gw, _) = start(&["--missing-key", "fingerprint:10s"]).await;

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
    let (upstream, gw, _) = start(&["--missing-key", "grace:2099-01-01T00:00:00Z"]).await;

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
async fn a_get_with_a_key_passes_through_untouched() {
    let (upstream, gw, key) = start(&[]).await;

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

/// A keyed request sent again and again to an upstream route that answers one way.
struct Storing {
    case: &'static str,
    flags: &'static [&'static str],
    path: &'static str,
    /// Each answer's status and whether it is a replay (of the answer before it).
    answers: &'static [(u16, bool)],
    /// The route's counter, and how often the upstream ran it.
    runs: (fn(&UpstreamState) -> &AtomicUsize, usize),
}

/// Which answers are stored: a `5xx` releases the key, so the retry runs again, unless
/// `--store-5xx`; a `4xx` is a final answer; a `429` asks for a retry, which runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_stored_is_replayed_and_what_is_not_runs_again() {
    let cases = [
        Storing {
            case: "a 5xx releases the key",
            flags: &[],
            path: "/flaky",
            answers: &[(500, false), (201, false), (201, true)],
            runs: (|state| &*state.flaky, 2),
        },
        Storing {
            case: "--store-5xx keeps the 500",
            flags: &["--store-5xx"],
            path: "/flaky",
            answers: &[(500, false), (500, true)],
            runs: (|state| &*state.flaky, 1),
        },
        Storing {
            case: "a 404 is a final answer",
            flags: &[],
            path: "/status/404",
            answers: &[(404, false), (404, true)],
            runs: (|state| &*state.status, 1),
        },
        Storing {
            case: "a 429 asks for a retry, which runs again",
            flags: &[],
            path: "/status/429",
            answers: &[(429, false), (429, false)],
            runs: (|state| &*state.status, 2),
        },
    ];
    for Storing {
        case,
        flags,
        path,
        answers,
        runs: (counter, runs),
    } in cases
    {
        println!("case: {case}");
        let (upstream, gw, key) = start(flags).await;
        let mut before: Option<common::Reply> = None;
        for &(status, replayed) in answers {
            let reply = gw.post_json(path, Some(&key), "{}").await;
            assert_eq!((reply.status, reply.replayed()), (status, replayed), "{case}: {reply}");
            if replayed {
                let before = before.as_ref().expect("an answer before the replay");
                assert_eq!(reply.body, before.body, "{case}: the replay is the stored answer");
            }
            before = Some(reply);
        }
        assert_eq!(count(counter(&upstream.state)), runs, "{case}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_answer_is_never_re_run_and_replays_compact() {
    let (upstream, gw, key) = start(&["--max-stored-body", "1KiB"]).await;

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
    let (upstream, gw, key) = start(&[]).await;

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
    let (upstream, gw, key) = start(&[]).await;

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
    let (upstream, gw, key) = start(&["--ttl", "1s"]).await;

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
    let (upstream, gw, _) = start(&[]).await;
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
    let (upstream, gw, key) = start(&["--max-body", "1KiB"]).await;
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
    let (upstream, gw, key) = start(&[]).await;

    let request = gw.keyed("/break-once", &key, PAY_BODY);
    let broken = common::try_send(request)
        .await
        .unwrap_or_else(|err| panic!("expected a whole 502 upstream-failed answer; {err}"));
    broken.assert_problem(502, "upstream-failed");

    let retry = gw.post_json("/break-once", Some(&key), PAY_BODY).await;
    assert_eq!(retry.status, 201, "{retry}");
    assert_eq!(
        upstream.state.recovered("break_once"),
        [None, Some("true".to_owned())],
        "the re-run (and only it) tells the upstream that an earlier run may have happened"
    );
    let rerun = &upstream.state.seen("break_once")[1];
    assert_eq!(rerun.key.as_deref().map(unquote), Some(key.as_str()));

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
    let pay = || gw.keyed("/break-once", &key, PAY_BODY);

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
    let (upstream, gw, key) = start(&["--ttl", "1s", "--tombstone-ttl", "1h"]).await;

    let request = gw.keyed("/break-once", &key, PAY_BODY);
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
    let (upstream, gw, key) = start(&["--upstream-timeout", "300ms"]).await;

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
    let (upstream, gw, _) = start(&[]).await;
    for size in [401 * 1024, 450 * 1024, 600 * 1024] {
        let key = new_key();
        let request = gw.keyed("/pay", &key, PAY_BODY).header("x-junk", "j".repeat(size));
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
    let (upstream, gw, key) = start(&[]).await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let request = gw
        .keyed("/pay", &key, PAY_BODY)
        .header("traceparent", traceparent)
        .header("tracestate", "vendor=opaque");
    assert_eq!(send(request).await.status, 201);
    let seen = upstream.state.last_headers("pay").expect("the upstream was called");
    assert_eq!(seen.get("traceparent").and_then(|v| v.to_str().ok()), Some(traceparent));
    assert_eq!(
        seen.get("tracestate").and_then(|v| v.to_str().ok()),
        Some("vendor=opaque")
    );
    let json = common::inspect_json(&gw.store, &key, None, &[]).await;
    assert_eq!(json["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736", "{json}");
}
