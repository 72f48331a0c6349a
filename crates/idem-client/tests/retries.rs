//! The middleware against real local servers that misbehave on purpose: what is retried, with
//! which key, after how long, and when it stops.

mod support;

use std::time::{Duration, SystemTime};

use idem_client::{
    ErrorExt, IdempotencyKey, MaxRetries, ResponseExt, RetryBudget, RetryError, RetryReport, StopReason,
};
use support::{HangUp, Scripted, client, fast, problem, reply, unused_port};

fn report(response: &reqwest::Response) -> RetryReport {
    response
        .retry_report()
        .expect("the middleware reports on every answer")
        .clone()
}

#[tokio::test]
async fn two_503s_then_201_succeed_on_the_third_attempt_with_one_key() {
    let server = Scripted::start(|n| match n {
        1 | 2 => reply(503, &[], "busy"),
        _ => reply(201, &[], "created"),
    })
    .await;
    let response = client(fast())
        .post(server.url("/pay"))
        .body(r#"{"amount":1}"#)
        .send()
        .await
        .unwrap();

    assert_eq!(response.status(), 201);
    let report = report(&response);
    assert_eq!(report.attempts, 3);
    assert!(!report.replayed);
    assert_eq!(report.stopped, None);
    let hits = server.hits();
    assert_eq!(hits.len(), 3);
    let key = report.key.clone().expect("a POST gets a key");
    for hit in &hits {
        assert_eq!(
            hit.parsed_key().as_ref(),
            Some(&key),
            "every attempt carries the one key"
        );
        assert_eq!(hit.body, r#"{"amount":1}"#, "every attempt carries the whole body");
    }
    let raw = hits[0].key.as_deref().unwrap();
    assert!(
        raw.starts_with('"') && raw.ends_with('"'),
        "sent as an sf-string: {raw}"
    );
    let uuid = uuid::Uuid::parse_str(key.as_str()).expect("the key is a UUID");
    assert_eq!(uuid.get_version_num(), 7, "a time-ordered UUIDv7");
    assert_eq!(response.text().await.unwrap(), "created");
}

#[tokio::test]
async fn every_logical_request_gets_its_own_key() {
    let server = Scripted::start(|_| reply(201, &[], "")).await;
    let client = client(fast());
    for _ in 0..2 {
        client.post(server.url("/pay")).send().await.unwrap();
    }
    let hits = server.hits();
    assert_ne!(hits[0].key, hits[1].key);
}

/// A `Retry-After` the server sends with its first answer.
struct RetryAfter {
    case: &'static str,
    status: u16,
    value: fn() -> String,
    /// Whether the report counts the wait.
    reported: bool,
}

/// `Retry-After` in seconds (on a `429`) or as an HTTP date (on a `503`) delays the next attempt
/// by what it says; the report counts the wait asked in seconds.
#[tokio::test]
async fn retry_after_delays_the_next_attempt() {
    let cases = [
        RetryAfter {
            case: "in seconds",
            status: 429,
            value: || "1".to_owned(),
            reported: true,
        },
        RetryAfter {
            case: "as an HTTP date",
            status: 503,
            // Dates have whole seconds: two seconds ahead is at least one second ahead.
            value: || httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(2)),
            reported: false,
        },
    ];
    for RetryAfter {
        case,
        status,
        value,
        reported,
    } in cases
    {
        println!("case: Retry-After {case}");
        let server = Scripted::start(move |n| match n {
            1 => reply(status, &[("retry-after", value().as_str())], "later"),
            _ => reply(201, &[], "created"),
        })
        .await;
        let response = client(fast()).post(server.url("/pay")).send().await.unwrap();
        assert_eq!(response.status(), 201, "{case}");
        let hits = server.hits();
        assert_eq!(hits.len(), 2, "{case}");
        let gap = hits[1].at - hits[0].at;
        assert!(
            gap >= Duration::from_secs(1),
            "{case}: the server asked for a second or more and the retry came after {gap:?}"
        );
        if reported {
            assert!(report(&response).waited >= Duration::from_secs(1), "{case}");
        }
    }
}

#[tokio::test]
async fn client_errors_get_exactly_one_attempt() {
    for status in [400u16, 401, 403, 404, 409, 410, 422] {
        let server = Scripted::start(move |_| reply(status, &[], "no")).await;
        let response = client(fast()).post(server.url("/pay")).send().await.unwrap();
        assert_eq!(response.status(), status);
        assert_eq!(server.count(), 1, "{status} is not retried");
        let report = report(&response);
        assert_eq!(report.attempts, 1);
        assert_eq!(report.stopped, None, "{status} is a final answer");
    }
}

#[tokio::test]
async fn idem_problems_other_than_key_in_flight_are_final_and_stay_readable() {
    for (status, name) in [
        (422, "key-mismatch"),
        (422, "key-expired"),
        (400, "key-invalid"),
        (409, "other"),
    ] {
        let server = Scripted::start(move |_| problem(status, name, &[])).await;
        let response = client(fast()).post(server.url("/pay")).send().await.unwrap();
        assert_eq!(server.count(), 1, "{name} is not retried");
        assert_eq!(response.status(), status);
        assert_eq!(response.headers()["content-type"], "application/problem+json");
        let body: serde_json::Value = response.json_body().await;
        assert_eq!(
            body["type"],
            format!("urn:idem:problem:{name}"),
            "the body was read for its type and kept"
        );
    }
}

#[tokio::test]
async fn key_in_flight_is_retried_until_the_first_copy_answers() {
    let server = Scripted::start(|n| match n {
        1 => problem(409, "key-in-flight", &[("retry-after", "0")]),
        _ => reply(201, &[("idempotency-replayed", "true")], "stored answer"),
    })
    .await;
    let response = client(fast()).post(server.url("/pay")).send().await.unwrap();
    assert_eq!(response.status(), 201);
    let report = report(&response);
    assert_eq!(report.attempts, 2);
    assert!(report.replayed, "the final answer was marked as a replay");
    let hits = server.hits();
    assert_eq!(hits[0].key, hits[1].key);
}

#[tokio::test]
async fn a_large_problem_body_is_handed_back_whole() {
    // Chunked, with no Content-Length, and larger than what the middleware reads for the type.
    let detail = "x".repeat(200_000);
    let body = format!(r#"{{"type":"urn:idem:problem:key-mismatch","detail":"{detail}"}}"#);
    let expected = body.clone();
    let server = Scripted::start(move |_| {
        let chunks: Vec<Result<String, std::io::Error>> = body
            .as_bytes()
            .chunks(10_000)
            .map(|c| Ok(String::from_utf8(c.to_vec()).unwrap()))
            .collect();
        axum::response::Response::builder()
            .status(409)
            .header("content-type", "application/problem+json")
            .body(axum::body::Body::from_stream(futures_util::stream::iter(chunks)))
            .unwrap()
    })
    .await;
    let response = client(fast()).post(server.url("/pay")).send().await.unwrap();
    assert_eq!(response.status(), 409);
    assert_eq!(response.text().await.unwrap(), expected);
    assert_eq!(server.count(), 1);
}

#[tokio::test]
async fn a_refused_connection_is_retried_and_then_reported() {
    let addr = unused_port();
    let err = client(fast().with_max_retries(2))
        .post(format!("http://{addr}/pay"))
        .send()
        .await
        .unwrap_err();
    let Some(RetryError::GaveUp { reason, report, source }) = err.retry_error() else {
        panic!("expected GaveUp, got {err:?}");
    };
    assert_eq!(*reason, StopReason::RetriesExhausted);
    assert_eq!(report.attempts, 3, "one attempt and two retries");
    assert!(report.key.is_some());
    assert!(source.is_connect(), "the cause is kept: {source:?}");
    assert!(err.to_string().contains("3 attempt"), "{err}");
}

#[tokio::test]
async fn a_refused_connection_is_retried_until_the_server_comes_up() {
    let addr = unused_port();
    let late = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        Scripted::start_on(listener, |_| reply(201, &[], "created"))
    });
    // Stamping off: a keyless POST may still be retried when nothing was sent.
    let middleware = fast()
        .with_stamp_keys(false)
        .with_max_retries(50)
        .with_budget(RetryBudget::unlimited());
    let response = client(middleware)
        .post(format!("http://{addr}/pay"))
        .send()
        .await
        .unwrap();
    let server = late.await.unwrap();
    assert_eq!(response.status(), 201);
    let report = report(&response);
    assert!(report.attempts >= 2, "{report:?}");
    assert_eq!(report.key, None);
    assert_eq!(server.count(), 1, "only the attempt that connected reached the server");
}

#[tokio::test]
async fn a_keyed_post_is_retried_after_the_server_hung_up_but_a_keyless_one_is_not() {
    let server = HangUp::start().await;
    let err = client(fast().with_max_retries(2))
        .post(server.url("/pay"))
        .body("x")
        .send()
        .await
        .unwrap_err();
    let report = err.retry_report().expect("a report").clone();
    assert_eq!(report.attempts, 3, "{err:?}");
    assert_eq!(server.received(), 3);

    let server = HangUp::start().await;
    let err = client(fast().with_max_retries(2).with_stamp_keys(false))
        .post(server.url("/pay"))
        .body("x")
        .send()
        .await
        .unwrap_err();
    let Some(RetryError::GaveUp { reason, report, .. }) = err.retry_error() else {
        panic!("expected GaveUp, got {err:?}");
    };
    assert_eq!(*reason, StopReason::UnsafeToRepeat, "{err}");
    assert_eq!(report.attempts, 1);
    assert_eq!(
        server.received(),
        1,
        "a keyless POST that may have run is never sent again"
    );

    // An idempotent method needs no key to be repeated.
    let server = HangUp::start().await;
    let err = client(fast().with_max_retries(2))
        .get(server.url("/pay"))
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.retry_report().unwrap().attempts, 3);
    assert_eq!(server.received(), 3);
}

#[tokio::test]
async fn a_keyless_post_with_an_error_answer_is_not_repeated() {
    let server = Scripted::start(|_| reply(503, &[], "busy")).await;
    let response = client(fast().with_stamp_keys(false))
        .post(server.url("/pay"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(report(&response).stopped, Some(StopReason::UnsafeToRepeat));
    assert_eq!(server.count(), 1);
    assert_eq!(server.hits()[0].key, None);
}

#[tokio::test]
async fn gets_are_retried_without_a_key() {
    let server = Scripted::start(|n| match n {
        1 => reply(502, &[], "bad gateway"),
        _ => reply(200, &[], "ok"),
    })
    .await;
    let response = client(fast()).get(server.url("/thing")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(report(&response).attempts, 2);
    assert!(server.hits().iter().all(|h| h.key.is_none()), "reads are not stamped");
}

#[tokio::test]
async fn a_key_set_by_the_caller_is_kept_on_every_attempt() {
    let server = Scripted::start(|n| match n {
        1 => reply(500, &[], "oops"),
        _ => reply(201, &[], "created"),
    })
    .await;
    let response = client(fast())
        .patch(server.url("/order/1"))
        .header("idempotency-key", "order-42")
        .send()
        .await
        .unwrap();
    assert_eq!(report(&response).key, Some(IdempotencyKey::new("order-42").unwrap()));
    let keys: Vec<_> = server.hits().into_iter().map(|h| h.key).collect();
    assert_eq!(keys, [Some("order-42".to_owned()), Some("order-42".to_owned())]);
}

#[tokio::test]
async fn the_key_header_name_is_configurable() {
    let server = Scripted::start(|_| reply(201, &[], "")).await;
    let middleware = fast().with_key_header(http::HeaderName::from_static("x-request-key"));
    let response = client(middleware).post(server.url("/pay")).send().await.unwrap();
    assert!(report(&response).key.is_some());
    assert_eq!(server.hits()[0].key, None, "not in Idempotency-Key");
}

#[tokio::test]
async fn when_the_retries_run_out_the_last_answer_is_handed_back() {
    let server = Scripted::start(|_| reply(503, &[], "still busy")).await;
    let response = client(fast().with_max_retries(2))
        .post(server.url("/pay"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    let report = report(&response);
    assert_eq!(report.attempts, 3);
    assert_eq!(report.stopped, Some(StopReason::RetriesExhausted));
    assert_eq!(server.count(), 3);
    assert_eq!(response.text().await.unwrap(), "still busy");
}

#[tokio::test]
async fn a_retry_after_beyond_the_deadline_stops_at_once_and_says_why() {
    let server = Scripted::start(|_| reply(503, &[("retry-after", "30")], "come back later")).await;
    let started = std::time::Instant::now();
    let err = client(
        fast()
            .with_deadline(Duration::from_secs(5))
            .with_retry_after_cap(Duration::from_secs(60)),
    )
    .post(server.url("/pay"))
    .send()
    .await
    .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "no waiting in vain: {:?}",
        started.elapsed()
    );
    assert_eq!(server.count(), 1, "one attempt");
    let Some(RetryError::RetryAfterBeyondDeadline {
        status,
        retry_after,
        left,
        deadline,
        report,
        ..
    }) = err.retry_error()
    else {
        panic!("expected RetryAfterBeyondDeadline, got {err:?}");
    };
    assert_eq!(*status, 503);
    assert_eq!(*retry_after, Duration::from_secs(30));
    assert!(*left <= Duration::from_secs(5));
    assert_eq!(*deadline, Duration::from_secs(5));
    assert_eq!(report.attempts, 1);
    let message = err.to_string();
    assert!(message.contains("Retry-After 30s"), "{message}");
    assert!(message.contains("left of the 5s deadline"), "{message}");
}

#[tokio::test]
async fn a_retry_after_is_capped() {
    let server = Scripted::start(|n| match n {
        1 => reply(503, &[("retry-after", "3600")], ""),
        _ => reply(201, &[], ""),
    })
    .await;
    let middleware = fast().with_retry_after_cap(Duration::from_millis(200));
    let response = client(middleware).post(server.url("/pay")).send().await.unwrap();
    assert_eq!(response.status(), 201);
    let waited = report(&response).waited;
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
}

#[tokio::test]
async fn the_deadline_cuts_a_slow_attempt_short() {
    // A server that accepts and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let _silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let started = std::time::Instant::now();
    let err = client(fast().with_deadline(Duration::from_millis(300)))
        .post(format!("http://{addr}/pay"))
        .send()
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    assert!(
        matches!(err.retry_error(), Some(RetryError::DeadlineExceeded { report, .. }) if report.attempts == 1),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_streaming_body_is_refused_before_anything_is_sent() {
    let server = Scripted::start(|_| reply(201, &[], "")).await;
    let stream = || reqwest::Body::wrap(http_body_util::Full::new(bytes::Bytes::from_static(b"chunk")));
    let err = client(fast())
        .post(server.url("/upload"))
        .body(stream())
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(err.retry_error(), Some(RetryError::BodyNotReplayable { .. })),
        "{err:?}"
    );
    assert!(err.to_string().contains("stream"), "{err}");
    assert_eq!(server.count(), 0, "nothing was sent");

    // Sending it once is a choice the caller can make.
    let response = client(fast())
        .post(server.url("/upload"))
        .body(stream())
        .with_extension(MaxRetries(0))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(server.hits()[0].body, "chunk");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_server_gets_no_more_retries_than_the_budget() {
    const REQUESTS: usize = 200;
    const BUDGET: u32 = 20;
    let server = Scripted::start(|_| reply(503, &[], "down")).await;
    let budget = RetryBudget::new(BUDGET).with_min_per_second(0.0);
    let client = client(
        fast()
            .with_max_retries(3)
            .with_base_delay(Duration::from_millis(1))
            .with_budget(budget.clone()),
    );
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let client = client.clone();
            let url = server.url(&format!("/pay/{i}"));
            tokio::spawn(async move { client.post(url).send().await })
        })
        .collect();
    let mut stopped_by_budget = 0;
    for task in tasks {
        let response = task.await.unwrap().expect("every request gets its 503 back");
        assert_eq!(response.status(), 503);
        if report(&response).stopped == Some(StopReason::BudgetExhausted) {
            stopped_by_budget += 1;
        }
    }
    let retries = server.count() - REQUESTS;
    assert!(
        retries <= BUDGET as usize,
        "{retries} retries reached the server; the budget allows {BUDGET}"
    );
    assert_eq!(
        retries,
        BUDGET as usize,
        "the budget was spent, not more and not less (without it there would be {} retries)",
        REQUESTS * 3
    );
    assert!(stopped_by_budget >= REQUESTS - BUDGET as usize);
    assert!(budget.available() < 1.0);
}

#[tokio::test]
async fn successes_refill_the_budget() {
    let server = Scripted::start(|n| {
        if n % 2 == 1 {
            reply(503, &[], "")
        } else {
            reply(201, &[], "")
        }
    })
    .await;
    let budget = RetryBudget::new(1)
        .with_refill_per_success(0.5)
        .with_min_per_second(0.0);
    let client = client(fast().with_budget(budget.clone()));
    // 503 then 201: the retry spends the one token, the success pays back half of it.
    let first = client.post(server.url("/a")).send().await.unwrap();
    assert_eq!(report(&first).attempts, 2);
    assert_eq!(budget.available(), 0.5);
    let second = client.post(server.url("/b")).send().await.unwrap();
    assert_eq!(second.status(), 503, "half a token is not a retry");
    assert_eq!(report(&second).stopped, Some(StopReason::BudgetExhausted));
}

trait JsonBody {
    async fn json_body(self) -> serde_json::Value;
}

impl JsonBody for reqwest::Response {
    async fn json_body(self) -> serde_json::Value {
        serde_json::from_slice(&self.bytes().await.unwrap()).unwrap()
    }
}
