//! [`IdempotencyService`]: moves bytes between the caller, the protocol and the inner service.
//! Every decision is the protocol's; this module buffers bodies, runs the handler in its own
//! task (renewing its lease) and hands the answer back.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderMap, Request, Response, header};
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, Limited};
use idem_core::{
    Admission, Claim, Decision, Disposition, Fingerprint, IdempotencyKey, Outcome, Problem, ProblemKind, Protocol,
    RecordId, Scope,
};
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;
use tower_service::Service;

use crate::body::{Body, BoxError, Collected, boxed, collect_up_to, full};

/// What the layer tells the handler about the keyed request it runs, in the request extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyInfo {
    /// The caller's scope.
    pub scope: Scope,
    /// The key (for a keyless request under `fingerprint:<window>`, the derived provisional key).
    pub key: IdempotencyKey,
    /// True if an earlier run of this key may have had effects (its holder crashed, or its outcome
    /// is unknown): check before acting again.
    pub recovered: bool,
}

/// Put into a response's extensions by an inner service whose response is not the handler's
/// answer, such as a proxy that could not reach its upstream. The key is released instead of
/// storing the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoAnswer {
    /// Nothing was sent: the request can be run again as if new.
    NotSent,
    /// The request was sent but no answer came back: the next run is marked recovered.
    OutcomeUnknown,
}

/// The service made by [`IdempotencyLayer`](crate::IdempotencyLayer).
#[derive(Clone, Debug)]
pub struct IdempotencyService<S> {
    inner: S,
    protocol: Protocol,
    response_timeout: Option<Duration>,
    tasks: TaskTracker,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, protocol: Protocol, response_timeout: Option<Duration>, tasks: TaskTracker) -> Self {
        Self {
            inner,
            protocol,
            response_timeout,
            tasks,
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: HttpBody<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The clone that was driven to readiness is the one that serves this request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let handling = Handling {
            inner,
            protocol: self.protocol.clone(),
            response_timeout: self.response_timeout,
            tasks: self.tasks.clone(),
        };
        // A panic anywhere in the request's path is a bug, but the caller still gets an answer
        // that says so, and the connection lives.
        Box::pin(
            AssertUnwindSafe(handling.handle(request))
                .catch_unwind()
                .map(|handled| {
                    handled.unwrap_or_else(|panic| {
                        tracing::error!(panic = panic_message(&*panic), "the idempotency layer panicked");
                        record_outcome(None, Outcome::Internal, http::StatusCode::INTERNAL_SERVER_ERROR);
                        Ok(internal_error())
                    })
                }),
        )
    }
}

struct Handling<S> {
    inner: S,
    protocol: Protocol,
    response_timeout: Option<Duration>,
    tasks: TaskTracker,
}

impl<S, ResBody> Handling<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    async fn handle<ReqBody>(mut self, request: Request<ReqBody>) -> Result<Response<Body>, S::Error>
    where
        ReqBody: HttpBody<Data = Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
    {
        let (mut parts, body) = request.into_parts();
        let keyed = match self.protocol.admit(&parts) {
            Admission::PassThrough { headers } => {
                let response = self.inner.call(Request::from_parts(parts, boxed(body))).await?;
                return Ok(with_headers(response.map(boxed), headers));
            }
            Admission::Refuse(problem, outcome) => {
                record_outcome(None, outcome, problem.kind.status());
                return Ok(problem.to_response().map(full));
            }
            Admission::Keyed(keyed) => keyed,
        };

        let bytes = match read_body(&parts.headers, body, self.protocol.policy().max_body).await {
            Ok(bytes) => bytes,
            Err(problem) => {
                let outcome = if problem.kind == ProblemKind::BodyTooLarge {
                    Outcome::TooLarge
                } else {
                    Outcome::BodyIncomplete
                };
                tracing::info!(scope = %keyed.scope(), key = keyed.key().map(|k| k.as_str()), outcome = %outcome, "idempotency");
                record_outcome(None, outcome, problem.kind.status());
                return Ok(problem.to_response().map(full));
            }
        };
        let fingerprint = Fingerprint::of(&parts.method, &parts.uri, &parts.headers, &bytes);
        let started = std::time::Instant::now();
        let claim = match self.protocol.begin(keyed, &fingerprint).await {
            Decision::Respond { response, outcome, id } => {
                if matches!(outcome, Outcome::Waited | Outcome::InFlight) {
                    metrics::histogram!("idem_wait_seconds").record(started.elapsed().as_secs_f64());
                }
                record_outcome(Some(&id), outcome, response.status());
                return Ok(response.map(full));
            }
            Decision::PassThrough { id } => {
                tracing::warn!(scope = %id.scope, key = %id.key, "store unavailable: running the request unprotected (fail-open)");
                let response = self.inner.call(Request::from_parts(parts, full(bytes))).await?;
                return Ok(response.map(boxed));
            }
            Decision::Run(claim) => claim,
        };

        parts.extensions.insert(IdempotencyInfo {
            scope: claim.id().scope.clone(),
            key: claim.id().key.clone(),
            recovered: claim.recovered(),
        });
        let request = Request::from_parts(parts, full(bytes));
        let (answer, answered) = oneshot::channel();
        // The handler runs in its own task: a caller that hangs up does not cancel it, so a retry
        // finds the stored answer instead of a half-done one.
        self.tasks
            .spawn(run(self.protocol.clone(), claim, self.inner, request, answer));
        let answered = async {
            match answered.await {
                Ok(result) => result,
                // The task ended without answering: it panicked after the handler's answer.
                Err(_) => Ok(internal_error()),
            }
        };
        match self.response_timeout {
            None => answered.await,
            Some(limit) => match tokio::time::timeout(limit, answered).await {
                Ok(result) => result,
                Err(_) => {
                    let secs = self.protocol.policy().retry_after.as_secs().max(1);
                    let detail = format!(
                        "no answer within {}; the request is still running and its answer will be kept: retry in {secs} s with the same key to receive it",
                        humantime_secs(limit)
                    );
                    let problem = Problem::new(ProblemKind::UpstreamTimeout, detail)
                        .retry_after(self.protocol.policy().retry_after);
                    Ok(problem.to_response().map(full))
                }
            },
        }
    }
}

/// Runs the handler under `claim`, renewing the lease, then keeps or releases its answer and
/// sends the answer to the caller (who may have gone).
fn run<S, ResBody>(
    protocol: Protocol,
    claim: Claim,
    mut inner: S,
    request: Request<Body>,
    answer: oneshot::Sender<Result<Response<Body>, S::Error>>,
) -> impl Future<Output = ()> + Send + 'static
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let call = std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(request)));
    async move {
        let id = claim.id().clone();
        let ran = match call {
            Ok(call) => renewing(&protocol, &claim, AssertUnwindSafe(call).catch_unwind()).await,
            Err(panic) => Err(panic),
        };
        let response = match ran {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => {
                settle(protocol.abandon(&claim, true).await, &id, "release");
                record_outcome(Some(&id), claim.outcome(), http::StatusCode::INTERNAL_SERVER_ERROR);
                let _ = answer.send(Err(err));
                return;
            }
            Err(panic) => {
                // The handler may have acted before it panicked: the retry runs, marked recovered.
                tracing::error!(scope = %id.scope, key = %id.key, panic = panic_message(&*panic), "the handler panicked");
                settle(protocol.abandon(&claim, true).await, &id, "release");
                record_outcome(Some(&id), Outcome::Internal, http::StatusCode::INTERNAL_SERVER_ERROR);
                let _ = answer.send(Ok(internal_error()));
                return;
            }
        };
        let (head, body) = response.into_parts();
        let body = boxed(body);
        let status = head.status;
        let release = head.extensions.get::<NoAnswer>().copied();
        let disposition = match release {
            Some(_) => Disposition::Release,
            None => protocol.disposition(status, body.size_hint().exact().and_then(|n| usize::try_from(n).ok())),
        };
        record_outcome(Some(&id), claim.outcome(), status);
        let response = match disposition {
            Disposition::Release => {
                let unknown = release == Some(NoAnswer::OutcomeUnknown);
                settle(protocol.abandon(&claim, unknown).await, &id, "release");
                Response::from_parts(head, body)
            }
            Disposition::StoreCompact => {
                settle(protocol.finish(&claim, &head, None).await, &id, "complete");
                Response::from_parts(head, body)
            }
            Disposition::Store => {
                let limit = protocol.policy().max_stored_body;
                match renewing(&protocol, &claim, collect_up_to(body, limit)).await {
                    Collected::Whole(bytes) => {
                        settle(
                            protocol.finish(&claim, &head, Some(bytes.clone())).await,
                            &id,
                            "complete",
                        );
                        Response::from_parts(head, full(bytes))
                    }
                    Collected::Overflow(body) => {
                        settle(protocol.finish(&claim, &head, None).await, &id, "complete");
                        Response::from_parts(head, body)
                    }
                    Collected::Failed(err) => {
                        // The handler acted but its answer was lost on the way: whether it took effect
                        // is unknown, so the next run is marked recovered.
                        tracing::warn!(scope = %id.scope, key = %id.key, error = %err, "the answer's body failed before it was complete");
                        settle(protocol.abandon(&claim, true).await, &id, "release");
                        let detail = "the answer was lost before it was complete; retry with the same key (the retry is marked recovered)";
                        Problem::new(ProblemKind::UpstreamFailed, detail)
                            .to_response()
                            .map(full)
                    }
                }
            }
        };
        let _ = answer.send(Ok(response));
    }
}

/// Drives `work`, renewing the claim's lease every third of it, so a slow handler never loses its
/// record.
async fn renewing<F: Future>(protocol: &Protocol, claim: &Claim, work: F) -> F::Output {
    let every = protocol.renew_every();
    let mut work = pin!(work);
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            output = &mut work => return output,
            _ = ticks.tick() => {
                if let Err(err) = protocol.renew(claim).await {
                    tracing::warn!(scope = %claim.id().scope, key = %claim.id().key, error = %err, "could not renew the lease");
                }
            }
        }
    }
}

fn settle(result: Result<(), idem_core::StoreError>, id: &RecordId, operation: &str) {
    if let Err(err) = result {
        // The record stays in flight until its lease ends; then a retry takes it over, marked recovered.
        tracing::error!(scope = %id.scope, key = %id.key, error = %err, operation, "could not settle the record");
    }
}

/// Buffers a keyed request's body up to `limit`; a larger body is `413`.
async fn read_body<B>(headers: &HeaderMap, body: B, limit: usize) -> Result<Bytes, Problem>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        Problem::new(
            ProblemKind::BodyTooLarge,
            format!("the body of a request with an idempotency key may be at most {limit} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(err) => Err(Problem::new(
            ProblemKind::BodyIncomplete,
            format!(
                "the request body broke off before it was complete ({err}); nothing was processed, send the request again"
            ),
        )),
    }
}

fn with_headers(mut response: Response<Body>, headers: HeaderMap) -> Response<Body> {
    response.headers_mut().extend(headers);
    response
}

/// `500 internal-error`: a bug in the request's path, said as a problem rather than an empty answer.
fn internal_error() -> Response<Body> {
    let detail = "the idempotency layer failed unexpectedly (a bug, logged); if the request was keyed, retry it with the same key: a run that may have had effects is marked recovered";
    Problem::new(ProblemKind::Internal, detail).to_response().map(full)
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

fn record_outcome(id: Option<&RecordId>, outcome: Outcome, status: http::StatusCode) {
    match id {
        Some(id) => {
            tracing::info!(scope = %id.scope, key = %id.key, outcome = %outcome, status = status.as_u16(), "idempotency")
        }
        None => tracing::info!(outcome = %outcome, status = status.as_u16(), "idempotency"),
    }
    metrics::counter!("idem_requests_total", "outcome" => outcome.as_str()).increment(1);
}

fn humantime_secs(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}
