//! A real OTLP/HTTP trace receiver for the tests, built on the published OTLP protobuf
//! definitions (`opentelemetry-proto`): it decodes every `POST /v1/traces` it is sent and keeps
//! the spans, each with the `service.name` of the resource that sent it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_test_support::task::AbortOnDrop;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

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

/// The receiver, on `127.0.0.1`. Stops when dropped.
#[derive(Debug)]
pub(crate) struct Receiver {
    pub(crate) addr: SocketAddr,
    spans: Arc<Mutex<Vec<Received>>>,
    _task: AbortOnDrop,
}

impl Receiver {
    pub(crate) async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the receiver");
        let addr = listener.local_addr().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new()
            .route("/v1/traces", post(export))
            .with_state(spans.clone());
        let _task = AbortOnDrop::serve(listener, app);
        Self { addr, spans, _task }
    }

    /// `http://127.0.0.1:PORT`: what `OTEL_EXPORTER_OTLP_ENDPOINT` names.
    pub(crate) fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub(crate) fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans received once `ready` holds of them, waiting up to `limit`.
    pub(crate) async fn wait_for(&self, limit: Duration, ready: impl Fn(&[Received]) -> bool) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let spans = self.spans();
            if ready(&spans) {
                return spans;
            }
            if tokio::time::Instant::now() >= deadline {
                let names: Vec<_> = spans.iter().map(|s| format!("{}:{}", s.service, s.name())).collect();
                panic!("the receiver did not get the spans expected within {limit:?}; it has {names:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
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
