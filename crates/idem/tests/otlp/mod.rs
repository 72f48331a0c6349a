//! A real OTLP/HTTP trace receiver for the tests, built on the published OTLP protobuf
//! definitions (`opentelemetry-proto`): it decodes every `POST /v1/traces` it is sent and keeps
//! the spans, each with the `service.name` of the resource that sent it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

use crate::common::{Served, read_until};

/// A span as received, with the service that sent it.
#[derive(Debug, Clone)]
pub(crate) struct Received {
    pub(crate) service: String,
    pub(crate) span: Span,
}

impl Received {
    pub(crate) fn name(&self) -> &str {
        &self.span.name
    }

    pub(crate) fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }

    pub(crate) fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }

    pub(crate) fn parent_span_id(&self) -> String {
        hex(&self.span.parent_span_id)
    }

    /// The attribute `key`, as text (a string's value, or another value's debug form).
    pub(crate) fn attribute(&self, key: &str) -> Option<String> {
        attribute(&self.span.attributes, key)
    }
}

/// The value of `key` among `attributes`, as text.
pub(crate) fn attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    let value = attributes
        .iter()
        .find(|kv| kv.key == key)?
        .value
        .as_ref()?
        .value
        .as_ref()?;
    Some(match value {
        any_value::Value::StringValue(text) => text.clone(),
        any_value::Value::BoolValue(b) => b.to_string(),
        any_value::Value::IntValue(n) => n.to_string(),
        any_value::Value::DoubleValue(x) => x.to_string(),
        other => format!("{other:?}"),
    })
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The receiver, on `127.0.0.1`; its state is the spans it received. Its URL is what
/// `OTEL_EXPORTER_OTLP_ENDPOINT` names. Stops when dropped.
pub(crate) type Receiver = Served<Arc<Mutex<Vec<Received>>>>;

impl Receiver {
    pub(crate) async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the receiver");
        Self::on(
            listener,
            Arc::default(),
            Router::new().route("/v1/traces", post(export)),
        )
    }

    /// Every span received so far.
    pub(crate) fn spans(&self) -> Vec<Received> {
        self.state.lock().unwrap().clone()
    }

    /// The spans received once `ready` holds of them, waiting up to `limit`.
    pub(crate) async fn wait_for(&self, limit: Duration, ready: impl Fn(&[Received]) -> bool) -> Vec<Received> {
        read_until(
            limit,
            Duration::from_millis(50),
            async || self.spans(),
            |spans| ready(spans),
            |spans| {
                let names: Vec<_> = spans.iter().map(|s| format!("{}:{}", s.service, s.name())).collect();
                format!("the receiver did not get the spans expected within {limit:?}; it has {names:?}")
            },
        )
        .await
    }
}

async fn export(State(spans): State<Arc<Mutex<Vec<Received>>>>, body: Bytes) -> Response {
    let request = match ExportTraceServiceRequest::decode(body) {
        Ok(request) => request,
        Err(err) => return (StatusCode::BAD_REQUEST, format!("not an OTLP trace export: {err}")).into_response(),
    };
    let mut received = spans.lock().unwrap();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .as_ref()
            .and_then(|resource| attribute(&resource.attributes, "service.name"))
            .unwrap_or_default();
        for scope_spans in resource_spans.scope_spans {
            for span in scope_spans.spans {
                received.push(Received {
                    service: service.clone(),
                    span,
                });
            }
        }
    }
    let reply = ExportTraceServiceResponse { partial_success: None }.encode_to_vec();
    ([(header::CONTENT_TYPE, "application/x-protobuf")], reply).into_response()
}
