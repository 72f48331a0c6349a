//! The middleware: stamps a key, then runs attempts until an answer is final or a limit (retries,
//! budget, deadline, safety) says stop. Reads top to bottom in [`IdempotencyMiddleware::handle`].

use std::time::{Duration, SystemTime};

use http::{Extensions, HeaderName, Method};
use idem_core::{IDEMPOTENCY_KEY, IDEMPOTENCY_REPLAYED, IdempotencyKey};
use rand::Rng;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use tokio::time::Instant;

use crate::backoff::{Backoff, retry_after};
use crate::budget::RetryBudget;
use crate::classify::{DefaultClassifier, ResponseInfo, RetryClassifier, Retryable};
use crate::error::RetryError;
use crate::problem::read_problem_type;
use crate::report::{RetryReport, StopReason};

/// A per-request override of the number of retries, set with
/// `RequestBuilder::with_extension(MaxRetries(n))`.
///
/// `MaxRetries(0)` sends the request once; it is also how a request with a streaming body (which
/// cannot be sent twice) gets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxRetries(pub u32);

/// The `reqwest_middleware` middleware that makes requests safe to retry, and retries them.
///
/// For each request it:
/// 1. stamps a fresh UUIDv7 `Idempotency-Key` (as an RFC 8941 string) on a `POST` or `PATCH`
///    that has none, and keeps a key the caller set;
/// 2. sends it, with the same key on every attempt;
/// 3. retries what the [`RetryClassifier`] calls transient ([`DefaultClassifier`]: no answer,
///    408, 429, 500, 502, 503, 504, 409 `key-in-flight`), after a backoff with full jitter or
///    the server's `Retry-After` (capped), while retries, the shared [`RetryBudget`] and the
///    deadline allow;
/// 4. never repeats a request that has no key and a non-idempotent method once it may have
///    reached the server (only a connect error proves it did not);
/// 5. puts a [`RetryReport`] into the final response's extensions.
///
/// A final answer is returned as `Ok` even when it is an error status: a 503 that could not be
/// retried further comes back as the 503, with [`RetryReport::stopped`] saying why. Errors are
/// [`RetryError`]s inside `reqwest_middleware::Error::Middleware`. Attach it first (outermost),
/// so that middleware added after it runs once per attempt; do not combine it with another retry
/// middleware.
///
/// Clones share the retry budget, so one middleware, however many clients it is attached to, is
/// one budget.
#[derive(Debug, Clone)]
pub struct IdempotencyMiddleware<C = DefaultClassifier> {
    max_retries: u32,
    backoff: Backoff,
    deadline: Option<Duration>,
    retry_after_cap: Duration,
    budget: RetryBudget,
    key_header: HeaderName,
    stamp_keys: bool,
    classifier: C,
}

impl Default for IdempotencyMiddleware {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyMiddleware {
    /// The defaults: 3 retries, backoff from 200 ms capped at 10 s, `Retry-After` capped at 30 s,
    /// a 60 s deadline, [`RetryBudget::default`], keys stamped in `Idempotency-Key`.
    pub fn new() -> Self {
        Self {
            max_retries: 3,
            backoff: Backoff::default(),
            deadline: Some(Duration::from_secs(60)),
            retry_after_cap: Duration::from_secs(30),
            budget: RetryBudget::default(),
            key_header: IDEMPOTENCY_KEY,
            stamp_keys: true,
            classifier: DefaultClassifier,
        }
    }
}

impl<C> IdempotencyMiddleware<C> {
    /// Retries after the first attempt (0: send once). A request can override it with
    /// [`MaxRetries`].
    pub fn with_max_retries(mut self, retries: u32) -> Self {
        self.max_retries = retries;
        self
    }

    /// The first retry's backoff window (doubling for each further retry).
    pub fn with_base_delay(mut self, base: Duration) -> Self {
        self.backoff = Backoff::new(base, self.backoff.cap());
        self
    }

    /// The longest backoff wait.
    pub fn with_max_delay(mut self, cap: Duration) -> Self {
        self.backoff = Backoff::new(self.backoff.base(), cap);
        self
    }

    /// The longest wait a `Retry-After` can impose; a longer one is shortened to this.
    pub fn with_retry_after_cap(mut self, cap: Duration) -> Self {
        self.retry_after_cap = cap;
        self
    }

    /// The overall time limit of one request, all attempts and waits included. An attempt still
    /// running at the deadline is abandoned.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// No overall time limit: only the retries, the budget and each attempt's own timeout limit
    /// a request.
    pub fn without_deadline(mut self) -> Self {
        self.deadline = None;
        self
    }

    /// The retry budget; pass a clone of one budget to several middlewares to share it.
    pub fn with_budget(mut self, budget: RetryBudget) -> Self {
        self.budget = budget;
        self
    }

    /// The header that carries the key (default `Idempotency-Key`).
    pub fn with_key_header(mut self, name: HeaderName) -> Self {
        self.key_header = name;
        self
    }

    /// Whether to stamp a key on `POST` and `PATCH` requests that have none (default `true`).
    /// Without a key such a request is retried only when it certainly never left (a connect
    /// error).
    pub fn with_stamp_keys(mut self, stamp: bool) -> Self {
        self.stamp_keys = stamp;
        self
    }

    /// Replaces the retry table.
    pub fn with_classifier<D: RetryClassifier>(self, classifier: D) -> IdempotencyMiddleware<D> {
        IdempotencyMiddleware {
            max_retries: self.max_retries,
            backoff: self.backoff,
            deadline: self.deadline,
            retry_after_cap: self.retry_after_cap,
            budget: self.budget,
            key_header: self.key_header,
            stamp_keys: self.stamp_keys,
            classifier,
        }
    }

    /// The retry budget (shared with this middleware's clones).
    pub fn budget(&self) -> &RetryBudget {
        &self.budget
    }

    /// The backoff.
    pub fn backoff(&self) -> Backoff {
        self.backoff
    }

    /// Stamps a key on a `POST`/`PATCH` without one; returns the key the request carries, if
    /// it carries exactly one valid key.
    fn key_for(&self, request: &mut Request) -> Option<IdempotencyKey> {
        let headers = request.headers_mut();
        if !headers.contains_key(&self.key_header)
            && self.stamp_keys
            && matches!(*request.method(), Method::POST | Method::PATCH)
        {
            let key = IdempotencyKey::new(&uuid::Uuid::now_v7().to_string()).expect("a UUID is a valid key");
            request
                .headers_mut()
                .insert(self.key_header.clone(), key.to_header_value());
            return Some(key);
        }
        // A key the caller set is sent as it is; if it is not one valid key, the request counts as
        // keyless, which only ever makes the middleware more careful.
        IdempotencyKey::from_headers(request.headers().get_all(&self.key_header))
            .ok()
            .flatten()
    }

    /// The wait before the next attempt: the server's `Retry-After` (capped, plus up to a tenth
    /// of jitter so that clients told the same second do not all come back in the same
    /// millisecond), or the backoff.
    fn next_delay(&self, retry: u32, asked: Option<Duration>) -> Duration {
        match asked {
            Some(asked) => {
                let capped = asked.min(self.retry_after_cap);
                capped + capped.mul_f64(rand::rng().random_range(0.0..=0.1))
            }
            None => self.backoff.delay(retry),
        }
    }
}

/// RFC 9110 §9.2.2: repeating these has the effect of sending them once.
fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Only a connect error proves that nothing reached the server.
fn never_sent(error: &reqwest_middleware::Error) -> bool {
    matches!(error, reqwest_middleware::Error::Reqwest(err) if err.is_connect())
}

fn replayed(response: &Response) -> bool {
    response
        .headers()
        .get(IDEMPOTENCY_REPLAYED)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "?1")
}

fn middleware_error(err: RetryError) -> reqwest_middleware::Error {
    reqwest_middleware::Error::middleware(err)
}

/// One attempt's outcome: an answer (with the type of its problem body, if any) or an error.
type Outcome = Result<(Response, Option<String>), reqwest_middleware::Error>;

#[async_trait::async_trait]
impl<C: RetryClassifier> Middleware for IdempotencyMiddleware<C> {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let started = Instant::now();
        let deadline = self.deadline.map(|limit| (limit, started + limit));
        let max_retries = extensions.get::<MaxRetries>().map_or(self.max_retries, |m| m.0);
        let key = self.key_for(&mut request);
        let repeatable_once_sent = key.is_some() || idempotent(request.method());
        let streaming = request.body().is_some_and(|body| body.as_bytes().is_none());
        if max_retries > 0 && streaming {
            return Err(middleware_error(RetryError::BodyNotReplayable {
                method: request.method().clone(),
                url: request.url().to_string(),
            }));
        }

        let mut report = RetryReport {
            attempts: 0,
            key,
            replayed: false,
            waited: Duration::ZERO,
            elapsed: Duration::ZERO,
            stopped: None,
        };
        let mut pending = Some(request);
        loop {
            report.attempts += 1;
            let last_allowed = report.attempts > max_retries;
            let attempt = if last_allowed {
                pending.take()
            } else {
                pending.as_ref().and_then(Request::try_clone)
            }
            .expect("the body was checked to be clonable, or this is the only attempt");

            let run = async {
                let response = next.clone().run(attempt, extensions).await?;
                read_problem_type(response)
                    .await
                    .map_err(reqwest_middleware::Error::Reqwest)
            };
            let outcome: Outcome = match deadline {
                Some((limit, at)) => match tokio::time::timeout_at(at, run).await {
                    Ok(outcome) => outcome,
                    Err(_) => {
                        report.elapsed = started.elapsed();
                        return Err(middleware_error(RetryError::DeadlineExceeded {
                            deadline: limit,
                            report,
                        }));
                    }
                },
                None => run.await,
            };

            let verdict = match &outcome {
                Ok((response, problem)) => self.classifier.classify_response(&ResponseInfo::new(
                    response.status(),
                    response.headers(),
                    problem.as_deref(),
                )),
                Err(err) => self.classifier.classify_error(err),
            };
            let sent = outcome.as_ref().err().is_none_or(|err| !never_sent(err));
            let plan = if verdict == Retryable::Fatal {
                Plan::Stop(StopReason::NotRetryable)
            } else if sent && !repeatable_once_sent {
                Plan::Stop(StopReason::UnsafeToRepeat)
            } else if last_allowed {
                Plan::Stop(StopReason::RetriesExhausted)
            } else {
                self.plan_retry(report.attempts, &outcome, deadline)
            };

            let stop = match plan {
                Plan::Retry(delay) => {
                    tracing::debug!(
                        attempt = report.attempts,
                        delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                        outcome = %describe(&outcome),
                        "retrying"
                    );
                    // Let go of the failed answer (and its connection) before waiting.
                    drop(outcome);
                    tokio::time::sleep(delay).await;
                    report.waited += delay;
                    continue;
                }
                Plan::BeyondDeadline { asked, capped, left } => {
                    let status = outcome.map(|(response, _)| response.status()).unwrap_or_default();
                    let deadline = deadline.map(|(limit, _)| limit).unwrap_or_default();
                    report.elapsed = started.elapsed();
                    return Err(middleware_error(RetryError::RetryAfterBeyondDeadline {
                        status,
                        retry_after: asked,
                        capped,
                        left,
                        deadline,
                        report,
                    }));
                }
                Plan::Stop(stop) => stop,
            };

            report.elapsed = started.elapsed();
            return match outcome {
                Ok((mut response, _)) => {
                    if stop == StopReason::NotRetryable {
                        // A final answer: the server is healthy enough to pay back into the budget.
                        self.budget.deposit();
                    } else {
                        report.stopped = Some(stop);
                    }
                    report.replayed = replayed(&response);
                    response.extensions_mut().insert(report);
                    Ok(response)
                }
                Err(source) => {
                    report.stopped = Some(stop);
                    Err(middleware_error(RetryError::GaveUp {
                        reason: stop,
                        report,
                        source,
                    }))
                }
            };
        }
    }
}

/// What to do after an attempt.
enum Plan {
    /// Wait this long, then try again.
    Retry(Duration),
    /// Hand back the outcome as it is.
    Stop(StopReason),
    /// Fail: the server asked for a wait longer than the deadline leaves.
    BeyondDeadline {
        asked: Duration,
        capped: Duration,
        left: Duration,
    },
}

impl<C> IdempotencyMiddleware<C> {
    /// For an outcome worth a retry that is safe and allowed: the wait, unless the deadline or the
    /// budget forbids it. The deadline is checked first so that no token is spent in vain.
    fn plan_retry(&self, attempts: u32, outcome: &Outcome, deadline: Option<(Duration, Instant)>) -> Plan {
        let asked = outcome
            .as_ref()
            .ok()
            .and_then(|(response, _)| retry_after(response.headers(), SystemTime::now()));
        let mut delay = self.next_delay(attempts, asked);
        if let Some((_, at)) = deadline {
            let left = at.saturating_duration_since(Instant::now());
            match asked {
                Some(asked) if asked.min(self.retry_after_cap) > left => {
                    let capped = asked.min(self.retry_after_cap);
                    return Plan::BeyondDeadline { asked, capped, left };
                }
                // The server's wait fits; its jitter is trimmed to fit too.
                Some(_) => delay = delay.min(left),
                None if delay >= left => return Plan::Stop(StopReason::DeadlineTooClose),
                None => {}
            }
        }
        if !self.budget.try_withdraw() {
            return Plan::Stop(StopReason::BudgetExhausted);
        }
        Plan::Retry(delay)
    }
}

fn describe(outcome: &Outcome) -> String {
    match outcome {
        Ok((response, Some(problem))) => format!("{} {problem}", response.status()),
        Ok((response, None)) => response.status().to_string(),
        Err(err) => err.to_string(),
    }
}
