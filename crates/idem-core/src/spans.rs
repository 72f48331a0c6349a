//! The spans idem makes for a trace: one per keyed request (made by the layer), and inside it one
//! per store operation (made here, where the protocol calls the store). Every one has the target
//! [`TARGET`], so that a subscriber can send them to an OpenTelemetry layer and nowhere else
//! (`idem serve` does; with tracing off their callsites are disabled and cost a check each).
//!
//! The fields follow `tracing-opentelemetry`'s conventions: `otel.name` names the span,
//! `otel.kind` gives its kind, `otel.status_code` is set to `ERROR` when the operation failed.

use std::future::Future;

use tracing::Instrument;
use tracing::field::Empty;

use crate::store::StoreError;
use crate::store::StoreOperation;

/// The target of every span idem makes.
pub const TARGET: &str = "idem_spans";

/// `work`, a store `operation`, in a span of its own inside the current span: none outside a
/// span (a purge batch, a background release), so that no operation is exported as a trace of its
/// own. A fenced claim is an answer, not a failure; every other error marks the span failed.
pub(crate) async fn traced<T>(
    operation: StoreOperation,
    work: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let span = store_span(operation);
    if span.is_disabled() {
        return work.await;
    }
    let result = work.instrument(span.clone()).await;
    if let Err(err) = &result
        && !matches!(err, StoreError::Fenced)
    {
        span.record("otel.status_code", "ERROR");
        span.record("error.message", tracing::field::display(err));
    }
    result
}

/// The span of one store operation, a child of the current span; disabled if there is none.
fn store_span(operation: StoreOperation) -> tracing::Span {
    // A callsite's cached answer first: with tracing off, the current span is never looked up.
    if !tracing::enabled!(target: TARGET, tracing::Level::INFO) {
        return tracing::Span::none();
    }
    let parent = tracing::Span::current();
    if parent.is_none() {
        return tracing::Span::none();
    }
    tracing::info_span!(
        target: TARGET,
        parent: &parent,
        "store",
        "otel.name" = operation.span_name(),
        "otel.kind" = "client",
        "idem.store.operation" = operation.as_str(),
        "otel.status_code" = Empty,
        "error.message" = Empty,
    )
}
