//! What a keyed request leaves in a trace and in the log: its span (`idempotency`, with a child
//! `upstream` span around the inner service and the protocol's store spans), and its one log line.
//!
//! Every span has the target [`idem_core::spans::TARGET`]: a subscriber that does not enable it
//! (no OpenTelemetry layer) makes none, and pays a disabled callsite's check for each. With the
//! `opentelemetry` feature, the request's span continues the caller's trace (read with the global
//! text-map propagator) unless it already sits in one, its record names it, and a replay's span
//! links to the span of the run that made the answer.

use http::{Method, StatusCode};
use idem_core::metric_names;
use idem_core::protocol::{Keyed, Outcome};
use idem_core::spans::TARGET;
use idem_core::store::RecordId;
use idem_core::trace_context::RunTrace;
use metrics::SharedString;
use tracing::Span;
use tracing::field::{Empty, display};

/// What a keyed request's reports carry: its route's metrics label, its span and where its run
/// sits in its trace. The span is named here rather than looked up as the current one: with
/// tracing off it is disabled, and every report skips it at the cost of one check.
#[derive(Debug, Clone)]
pub(crate) struct Report {
    /// The metrics label of the request's route.
    pub(crate) route: SharedString,
    /// The request's span (disabled until it has one).
    pub(crate) span: Span,
    /// The request's run trace, once known.
    pub(crate) trace: Option<RunTrace>,
}

impl Report {
    pub(crate) fn new(route: SharedString) -> Self {
        Self {
            route,
            span: Span::none(),
            trace: None,
        }
    }

    /// The request's one log line, its count by outcome and route, and what its span records of
    /// how it ended.
    pub(crate) fn outcome(&self, id: Option<&RecordId>, outcome: Outcome, status: StatusCode) {
        self.refused(
            id.map(|id| id.scope.as_str()),
            id.map(|id| id.key.as_str()),
            outcome,
            status,
        );
        let span = &self.span;
        if span.is_disabled() {
            return;
        }
        if let Some(id) = id {
            span.record("idem.scope", id.scope.as_str());
            span.record("idem.key", id.key.as_str());
        }
        span.record("idem.outcome", outcome.as_str());
        span.record("idem.replayed", matches!(outcome, Outcome::Replayed | Outcome::Waited));
        span.record("http.response.status_code", i64::from(status.as_u16()));
        if status.is_server_error() {
            span.record("otel.status_code", "ERROR");
        }
    }

    /// The log line and count of a request answered before its record was known (its scope and
    /// key as far as they are known).
    pub(crate) fn refused(&self, scope: Option<&str>, key: Option<&str>, outcome: Outcome, status: StatusCode) {
        tracing::info!(
            scope,
            key,
            outcome = %outcome,
            status = status.as_u16(),
            route = %self.route,
            trace_id = self.trace.map(|t| display(t.trace_id)),
            span_id = self.trace.and_then(|t| t.span_id).map(display),
            "idempotency"
        );
        self.count(outcome);
    }

    /// The request's span learns that its run was claimed (and whether it was a recovered run).
    pub(crate) fn claimed(&self, recovered: bool) {
        if !self.span.is_disabled() {
            self.span.record("idem.recovered", recovered);
        }
    }

    /// The request was answered from a record that the run `answered_by` made: its span records
    /// that run's trace, and links to its span when both are known.
    pub(crate) fn answered_by(&self, answered_by: Option<RunTrace>) {
        let span = &self.span;
        let Some(trace) = answered_by else { return };
        if span.is_disabled() {
            return;
        }
        span.record("idem.answered_by", display(trace.trace_id));
        #[cfg(feature = "opentelemetry")]
        otel::link(span, trace);
    }

    /// One request in `idem_requests_total`, by outcome and route.
    fn count(&self, outcome: Outcome) {
        metrics::counter!(metric_names::REQUESTS_TOTAL, "outcome" => outcome.as_str(), "route" => self.route.clone())
            .increment(1);
    }
}

/// The span of a keyed request, a child of the current span; disabled unless a subscriber wants
/// idem's spans.
pub(crate) fn request_span(method: &Method, route: &str) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "idempotency",
        "otel.name" = Empty,
        "otel.kind" = "server",
        "otel.status_code" = Empty,
        "http.request.method" = method.as_str(),
        "http.response.status_code" = Empty,
        "idem.route" = route,
        "idem.scope" = Empty,
        "idem.key" = Empty,
        "idem.outcome" = Empty,
        "idem.replayed" = Empty,
        "idem.recovered" = Empty,
        "idem.answered_by" = Empty,
    );
    if !span.is_disabled() {
        span.record("otel.name", format!("{method} {route}"));
    }
    span
}

/// The span of the inner service's run (the upstream, behind `idem serve`), a child of the
/// current (the request's) span.
pub(crate) fn upstream_span() -> Span {
    tracing::info_span!(target: TARGET, "upstream", "http.response.status_code" = Empty, "otel.status_code" = Empty)
}

/// Records how the inner service's run ended on its span: the answer's status, or a failure (an
/// error, a panic, the run timeout).
pub(crate) fn upstream_ended<B, E, P, T>(span: &Span, ran: &Result<Result<Result<http::Response<B>, E>, P>, T>) {
    if span.is_disabled() {
        return;
    }
    match ran {
        Ok(Ok(Ok(response))) => {
            span.record("http.response.status_code", i64::from(response.status().as_u16()));
            if response.status().is_server_error() {
                span.record("otel.status_code", "ERROR");
            }
        }
        _ => {
            span.record("otel.status_code", "ERROR");
        }
    }
}

/// Continues the caller's trace in `span` and names the span as the run's in `keyed` (so its
/// record, and the log line, carry it).
#[cfg(feature = "opentelemetry")]
pub(crate) fn join(span: &Span, headers: &http::HeaderMap, keyed: &mut Keyed) {
    if let Some(trace) = otel::join(span, headers) {
        keyed.set_trace(trace);
    }
}

/// Without OpenTelemetry, the request's run trace is its caller's.
#[cfg(not(feature = "opentelemetry"))]
pub(crate) fn join(_span: &Span, _headers: &http::HeaderMap, _keyed: &mut Keyed) {}

#[cfg(feature = "opentelemetry")]
mod otel {
    use http::HeaderMap;
    use idem_core::trace_context::{RunTrace, SpanId, TraceId};
    use opentelemetry::KeyValue;
    use opentelemetry::propagation::Extractor;
    use opentelemetry::trace::{self, TraceContextExt};
    use tracing::Span;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    /// Makes `span` a child of the caller's trace context (unless it already has a parent in a
    /// trace: a layer outside this one continued it) and returns the span's place in its trace,
    /// if it has one (it has none unless an OpenTelemetry layer sees it).
    pub(super) fn join(span: &Span, headers: &HeaderMap) -> Option<RunTrace> {
        if span.is_disabled() {
            return None;
        }
        if !Span::current().context().span().span_context().is_valid() {
            let caller = opentelemetry::global::get_text_map_propagator(|p| p.extract(&Headers::of(headers)));
            let _ = span.set_parent(caller);
        }
        let context = span.context();
        let own = context.span().span_context().clone();
        if !own.is_valid() {
            return None;
        }
        Some(RunTrace {
            trace_id: TraceId::from_bytes(own.trace_id().to_bytes())?,
            span_id: SpanId::from_bytes(own.span_id().to_bytes()),
        })
    }

    /// Links `span` to the span of the run that made its answer.
    pub(super) fn link(span: &Span, to: RunTrace) {
        let Some(span_id) = to.span_id else { return };
        let linked = trace::SpanContext::new(
            trace::TraceId::from_bytes(*to.trace_id.as_bytes()),
            trace::SpanId::from_bytes(*span_id.as_bytes()),
            trace::TraceFlags::SAMPLED,
            true,
            trace::TraceState::NONE,
        );
        span.add_link_with_attributes(linked, vec![KeyValue::new("idem.link", "answered-by")]);
    }

    /// A request's headers, as a propagator reads them: a header sent twice is not read (two
    /// `traceparent`s name no parent, as the record's reading has it), but `tracestate`, whose
    /// headers are one list (Trace Context: combined as one, in order).
    struct Headers<'a> {
        map: &'a HeaderMap,
        tracestate: Option<String>,
    }

    impl<'a> Headers<'a> {
        fn of(map: &'a HeaderMap) -> Self {
            let values: Vec<&str> = map
                .get_all("tracestate")
                .iter()
                .filter_map(|value| value.to_str().ok())
                .collect();
            Self {
                map,
                tracestate: (values.len() > 1).then(|| values.join(",")),
            }
        }
    }

    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            if key.eq_ignore_ascii_case("tracestate")
                && let Some(combined) = &self.tracestate
            {
                return Some(combined);
            }
            let mut values = self.map.get_all(key).iter();
            let value = values.next()?;
            if values.next().is_some() {
                return None;
            }
            value.to_str().ok()
        }

        fn keys(&self) -> Vec<&str> {
            self.map.keys().map(|name| name.as_str()).collect()
        }
    }
}
