//! [`IdempotencyService`]: moves bytes between the caller, the protocol and the inner service.
//! Every decision is the protocol's (`Protocol::admit`, `begin`, then `settle` for how the run
//! ended); this module buffers bodies, runs the handler in its own task (renewing its lease),
//! carries the settlement out and hands the answer back.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderMap, Request, Response, header};
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, Limited};
use idem_core::{
    Fingerprint, Problem, metric_names,
    protocol::{
        Admission, Claim, CompletedInTransaction, Decision, InTransaction, Keep, NoAnswer, Outcome, PendingAnswer,
        Protocol, Reply, RunEnd, RunTimedOut, Settlement, Unstored,
    },
    store::RecordId,
};
use metrics::SharedString;
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{Body, BoxError, Collected, boxed, collect_up_to, full};
use crate::checkpoints::Checkpoints;
use crate::routing::{DEFAULT_ROUTE, Routing};
use crate::trace::{self, Report};

/// The service made by [`IdempotencyLayer`](crate::IdempotencyLayer).
#[derive(Clone, Debug)]
pub struct IdempotencyService<S> {
    inner: S,
    routing: Arc<Routing>,
    response_timeout: Option<Duration>,
    tasks: TaskTracker,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, routing: Arc<Routing>, response_timeout: Option<Duration>, tasks: TaskTracker) -> Self {
        Self {
            inner,
            routing,
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
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let pick = match self.routing.pick(request.method(), request.uri().path()) {
            Ok(pick) => pick,
            Err(problem) => {
                // Refused before any rule applies: no route to label it with but the default's.
                let report = Report::new(SharedString::const_str(DEFAULT_ROUTE));
                report.outcome(None, Outcome::PathAmbiguous, problem.kind.status());
                return Box::pin(std::future::ready(Ok(problem.to_response().map(full))));
            }
        };
        let Some(protocol) = pick.protocol.clone() else {
            // A route that passes through untouched: no key is read, nothing is stored.
            let call = inner.call(request.map(boxed));
            let retry_after = self.routing.retry_after();
            return Box::pin(async move { Ok(outside_protocol(call.await?, retry_after)) });
        };
        let report = Report::new(pick.route.clone());
        let handling = Handling {
            inner,
            protocol,
            report: report.clone(),
            response_timeout: self.response_timeout,
            tasks: self.tasks.clone(),
        };
        // A panic anywhere in the request's path is a bug, but the caller still gets an answer
        // that says so, and the connection lives.
        Box::pin(
            AssertUnwindSafe(handling.handle(request))
                .catch_unwind()
                .map(move |handled| {
                    handled.unwrap_or_else(|panic| {
                        tracing::error!(panic = panic_message(&*panic), "the idempotency layer panicked");
                        report.outcome(None, Outcome::Internal, internal_status());
                        Ok(internal_error())
                    })
                }),
        )
    }
}

struct Handling<S> {
    inner: S,
    protocol: Protocol,
    /// The request's route label and (once known) trace, for its log line, count and span.
    report: Report,
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
        let (parts, body) = request.into_parts();
        let mut keyed = match self.protocol.admit(&parts) {
            Admission::PassThrough { headers } => {
                let response = self.inner.call(Request::from_parts(parts, boxed(body))).await?;
                let retry_after = self.protocol.policy().retry_after;
                return Ok(with_headers(outside_protocol(response, retry_after), headers));
            }
            Admission::Refuse(problem, outcome) => {
                self.report.outcome(None, outcome, problem.kind.status());
                return Ok(problem.to_response().map(full));
            }
            Admission::Keyed(keyed) => keyed,
        };
        let span = trace::request_span(&parts.method, &self.report.route);
        trace::join(&span, &parts.headers, &mut keyed);
        self.report.trace = keyed.trace();
        self.report.span = span.clone();
        self.keyed(parts, body, keyed).instrument(span).await
    }

    /// Handles a keyed request, in its span.
    async fn keyed<ReqBody>(
        self,
        mut parts: http::request::Parts,
        body: ReqBody,
        keyed: idem_core::protocol::Keyed,
    ) -> Result<Response<Body>, S::Error>
    where
        ReqBody: HttpBody<Data = Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
    {
        let bytes = match read_body(&self.protocol, &parts.headers, body).await {
            Ok(bytes) => bytes,
            Err((problem, outcome)) => {
                let (scope, key) = (keyed.scope().map(|s| s.as_str()), keyed.key().map(|k| k.as_str()));
                self.report.refused(scope, key, outcome, problem.kind.status());
                return Ok(problem.to_response().map(full));
            }
        };
        let fingerprint = Fingerprint::of(&parts.method, &parts.uri, &parts.headers, &bytes);
        let started = std::time::Instant::now();
        // The claim is made, and the handler run, in a task of their own: a caller that hangs up
        // cancels neither, so a claim is never left made with nothing running under it.
        let (decided, decision) = oneshot::channel();
        let protocol = self.protocol.clone();
        let inner = self.inner;
        let report = self.report.clone();
        let task = async move {
            let claim = match protocol.begin(keyed, &fingerprint).await {
                Decision::Run(claim) => claim,
                Decision::Respond {
                    response,
                    outcome,
                    id,
                    answered_by,
                } => {
                    report.answered_by(answered_by);
                    let _ = decided.send(Decided::Respond { response, outcome, id });
                    return;
                }
                Decision::PassThrough { id } => {
                    tracing::warn!(scope = %id.scope, key = %id.key, "store unavailable: running the request unprotected (fail-open)");
                    let (answer, answered) = oneshot::channel();
                    if decided.send(Decided::Running(answered)).is_ok() {
                        let request = Request::from_parts(parts, full(bytes));
                        let upstream = trace::upstream_span();
                        let _ = answer.send(pass_through(inner, request).instrument(upstream).await);
                    }
                    return;
                }
            };
            report.claimed(claim.recovered());
            let (answer, answered) = oneshot::channel();
            if decided.send(Decided::Running(answered)).is_err() {
                // The caller hung up while the claim was made: nothing was sent, so the key is
                // free again at once (no lease to wait out, no phantom recovered run).
                tracing::info!(scope = %claim.id().scope, key = %claim.id().key, "the caller left before the request ran; releasing its claim");
                let settlement = protocol.settle(&claim, RunEnd::CallerLeft);
                let _ = protocol.release_settled(&claim, settlement).await;
                return;
            }
            parts.extensions.insert(claim.info());
            parts
                .extensions
                .insert(Checkpoints::new(protocol.clone(), claim.clone()));
            if protocol.completes_in_transactions() {
                parts
                    .extensions
                    .insert(InTransaction::new(protocol.clone(), claim.clone()));
            }
            // Boxed: the handler's future can be large, and it is needed only when the request
            // runs, so a replay's task is small to spawn.
            Box::pin(run(
                protocol,
                report,
                claim,
                inner,
                Request::from_parts(parts, full(bytes)),
                answer,
            ))
            .await;
        };
        // Boxed: the task's future holds the request until it runs, and spawning moves a future
        // whole several times (into the runtime's task cell); a box is moved as a pointer.
        self.tasks.spawn(Box::pin(task).instrument(self.report.span.clone()));
        let answered = match decision.await {
            Ok(Decided::Respond { response, outcome, id }) => {
                if matches!(outcome, Outcome::Waited | Outcome::InFlight) {
                    metrics::histogram!(metric_names::WAIT_SECONDS).record(started.elapsed().as_secs_f64());
                }
                self.report.outcome(Some(&id), outcome, response.status());
                return Ok(response.map(full));
            }
            Ok(Decided::Running(answered)) => answered,
            // The task panicked before it decided (logged by the runtime).
            Err(_) => {
                self.report.outcome(None, Outcome::Internal, internal_status());
                return Ok(internal_error());
            }
        };
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
                Err(_) => Ok(self.protocol.still_running(limit).map(full)),
            },
        }
    }
}

/// What the task that claims and runs a request tells its caller.
enum Decided<E> {
    /// Answer with this; nothing ran.
    Respond {
        response: Response<Bytes>,
        outcome: Outcome,
        id: RecordId,
    },
    /// The request runs; its answer comes here.
    Running(oneshot::Receiver<Result<Response<Body>, E>>),
}

/// Runs a request unprotected (the store is down and the policy is fail-open).
async fn pass_through<S, ResBody>(mut inner: S, request: Request<Body>) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    Ok(inner.call(request).await?.map(boxed))
}

/// Runs the handler under `claim` (lease renewed beside it, given up after the run timeout), then
/// keeps or releases its answer and sends the answer to the caller (who may have gone). An answer
/// the store refuses is sent all the same, then stored again until the store takes it.
async fn run<S, ResBody>(
    protocol: Protocol,
    report: Report,
    claim: Claim,
    mut inner: S,
    request: Request<Body>,
    answer: oneshot::Sender<Result<Response<Body>, S::Error>>,
) where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let id = claim.id().clone();
    let upstream = trace::upstream_span();
    let started = std::time::Instant::now();
    let call = upstream.in_scope(|| std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(request))));
    let ran = match call {
        Ok(call) => {
            // Boxed once here: the handler's future would otherwise be moved whole through each
            // layer that drives it (the run timeout, the lease renewal beside it).
            let call = Box::pin(AssertUnwindSafe(call.instrument(upstream.clone())).catch_unwind());
            protocol.drive(&claim, call).await
        }
        Err(panic) => Ok(Err(panic)),
    };
    // Every run, those given up at the run timeout included: what the run timeout is judged by.
    metrics::histogram!(metric_names::RUN_SECONDS, "route" => report.route.clone())
        .record(started.elapsed().as_secs_f64());
    trace::upstream_ended(&upstream, &ran);
    let response = match ran {
        Ok(Ok(Ok(response))) => response,
        Ok(Ok(Err(err))) => {
            let settlement = protocol.settle(&claim, RunEnd::HandlerFailed);
            let settlement = protocol.release_settled(&claim, settlement).await;
            let status = settlement.status.unwrap_or(internal_status());
            report.outcome(Some(&id), settlement.outcome, status);
            let _ = answer.send(Err(err));
            return;
        }
        Ok(Err(panic)) => {
            // The handler may have acted before it panicked: the retry runs, marked recovered.
            tracing::error!(scope = %id.scope, key = %id.key, panic = panic_message(&*panic), "the handler panicked");
            let settlement = protocol.settle(&claim, RunEnd::Panicked);
            let _ = answer.send(Ok(settled(&protocol, &report, &claim, settlement).await));
            return;
        }
        Err(RunTimedOut) => {
            let _ = answer.send(Ok(run_timed_out(&protocol, &report, &claim).await));
            return;
        }
    };
    let (head, body) = response.into_parts();
    let body = boxed(body);
    let marked = head
        .extensions
        .get::<CompletedInTransaction>()
        .is_some_and(|done| done.is_of(&claim));
    let settlement = match head.extensions.get::<NoAnswer>() {
        // Stored by the handler's own transaction, if that committed (or, on a route declared to
        // complete in transactions, stored by no run at all): read whether it did.
        None if marked || protocol.in_transaction() => {
            let confirmed = protocol.confirm(&claim).await;
            protocol.settle(
                &claim,
                RunEnd::AnsweredInTransaction {
                    marked,
                    state: confirmed.as_ref().copied(),
                },
            )
        }
        Some(no_answer) => protocol.settle(&claim, RunEnd::NoAnswer(no_answer)),
        None => protocol.settle(
            &claim,
            RunEnd::Answered {
                status: head.status,
                body_len: body.size_hint().exact().and_then(|n| usize::try_from(n).ok()),
            },
        ),
    };
    let (response, pending) = match settlement.keep {
        Keep::Release(_) | Keep::Leave => {
            let settlement = protocol.release_settled(&claim, settlement).await;
            let status = settlement.status.unwrap_or(head.status);
            report.outcome(Some(&id), settlement.outcome, status);
            let response = match settlement.reply {
                Reply::Handler => Response::from_parts(head, body),
                Reply::Problem(problem) => problem.map(full),
            };
            (response, None)
        }
        Keep::StoreCompact => {
            report.outcome(Some(&id), settlement.outcome, head.status);
            let pending = kept(protocol.finish(&claim, &head, None).await, &id);
            (Response::from_parts(head, body), pending)
        }
        Keep::Store => {
            let limit = protocol.policy().max_stored_body;
            match protocol.drive(&claim, collect_up_to(body, limit)).await {
                Ok(Collected::Whole(bytes)) => {
                    report.outcome(Some(&id), settlement.outcome, head.status);
                    let pending = kept(protocol.finish(&claim, &head, Some(bytes.clone())).await, &id);
                    (Response::from_parts(head, full(bytes)), pending)
                }
                Ok(Collected::Overflow(body)) => {
                    report.outcome(Some(&id), settlement.outcome, head.status);
                    let pending = kept(protocol.finish(&claim, &head, None).await, &id);
                    (Response::from_parts(head, body), pending)
                }
                Ok(Collected::Failed(err)) => {
                    // The handler acted but its answer was lost on the way: whether it took effect
                    // is unknown, so the next run is marked recovered.
                    tracing::warn!(scope = %id.scope, key = %id.key, error = %err, "the answer's body failed before it was complete");
                    let settlement = protocol.settle(&claim, RunEnd::AnswerBroke);
                    (settled(&protocol, &report, &claim, settlement).await, None)
                }
                Err(RunTimedOut) => (run_timed_out(&protocol, &report, &claim).await, None),
            }
        }
    };
    let _ = answer.send(Ok(response));
    if let Some(pending) = pending {
        match pending.store().await {
            Ok(()) => {}
            // Not necessarily lost: an attempt whose reply the store lost may have stored it.
            Err(idem_core::StoreError::Fenced) => {
                tracing::warn!(scope = %id.scope, key = %id.key, "the held answer's record is no longer this run's: an earlier attempt stored it (its reply was lost), or another run took the record over after the lease")
            }
            Err(err) => {
                tracing::error!(scope = %id.scope, key = %id.key, error = %err, "the held answer could not be stored; a retry runs again, marked recovered")
            }
        }
    }
}

/// Gives up a run that passed the run timeout, as the protocol settles it.
async fn run_timed_out(protocol: &Protocol, report: &Report, claim: &Claim) -> Response<Body> {
    let id = claim.id();
    tracing::warn!(scope = %id.scope, key = %id.key, limit = ?protocol.policy().run_timeout, "the request ran past the run timeout and was given up");
    let settlement = protocol.settle(claim, RunEnd::TimedOut);
    settled(protocol, report, claim, settlement).await
}

/// Carries out a settlement that answers with a problem: releases the record as it says, logs
/// it, and returns the problem (as the release found the claim).
async fn settled(protocol: &Protocol, report: &Report, claim: &Claim, settlement: Settlement) -> Response<Body> {
    let settlement = protocol.release_settled(claim, settlement).await;
    let status = settlement.status.unwrap_or(internal_status());
    report.outcome(Some(claim.id()), settlement.outcome, status);
    match settlement.reply {
        Reply::Problem(problem) => problem.map(full),
        // Every ending without an answer of the handler's is answered with a problem.
        Reply::Handler => internal_error(),
    }
}

/// What became of a stored answer: `Some` if it is held to be stored again.
fn kept(result: Result<(), Unstored>, id: &RecordId) -> Option<PendingAnswer> {
    match result {
        Ok(()) => None,
        Err(Unstored::Pending(pending)) => Some(pending),
        Err(Unstored::Lost(err)) => {
            // Fenced: the record has another holder. Otherwise the record stays in flight until its
            // lease ends; then a retry takes it over, marked recovered.
            tracing::error!(scope = %id.scope, key = %id.key, error = %err, "could not store the answer");
            None
        }
    }
}

/// Buffers a keyed request's body up to the policy's `max_body`; a larger body is `413`.
async fn read_body<B>(protocol: &Protocol, headers: &HeaderMap, body: B) -> Result<Bytes, (Problem, Outcome)>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let limit = protocol.policy().max_body;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(protocol.body_too_large());
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.is::<http_body_util::LengthLimitError>() => Err(protocol.body_too_large()),
        Err(err) => Err(idem_core::protocol::body_incomplete(&err)),
    }
}

/// A response to a request outside the protocol: the inner service's, or, when it says it has no
/// answer ([`NoAnswer`]), the problem the protocol makes of that.
fn outside_protocol<ResBody>(response: Response<ResBody>, retry_after: Duration) -> Response<Body>
where
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    match response.extensions().get::<NoAnswer>() {
        Some(no_answer) => idem_core::protocol::no_answer_problem(no_answer, retry_after).map(full),
        None => response.map(boxed),
    }
}

fn with_headers(mut response: Response<Body>, headers: HeaderMap) -> Response<Body> {
    response.headers_mut().extend(headers);
    response
}

/// The status of [`internal_error`], for logs.
fn internal_status() -> http::StatusCode {
    idem_core::protocol::internal_error().kind.status()
}

/// `500 internal-error`: a bug in the request's path, said as a problem rather than an empty answer.
fn internal_error() -> Response<Body> {
    idem_core::protocol::internal_error().to_response().map(full)
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}
