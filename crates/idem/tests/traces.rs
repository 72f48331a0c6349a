//! Traces across idem: `idem serve` exporting its spans over OTLP to a real receiver (built on the
//! published protobuf definitions), in front of an upstream instrumented with the OpenTelemetry
//! SDK that exports to the same receiver. One payment must read as one trace — the caller's span,
//! idem's request span, its store and upstream spans, the service's own span — and every replay's
//! span must link to the run that made the answer.

mod common;
mod otlp;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::{Gateway, new_key, send};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanKind, Tracer, TracerProvider};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind as ReceivedKind;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use otlp::{Received, Receiver};

const PAY_BODY: &str = r#"{"amount":1000,"currency":"EUR"}"#;
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// A payments service instrumented as any service would be: it continues the `traceparent` it is
/// sent in a server span of its own, exported by the OpenTelemetry SDK to the receiver.
struct Payments {
    provider: SdkTracerProvider,
    charges: AtomicUsize,
    headers: Mutex<Vec<HeaderMap>>,
}

impl Payments {
    fn start(receiver: &Receiver) -> (Arc<Self>, String, tokio::task::JoinHandle<()>) {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(format!("{}/v1/traces", receiver.url()))
            .build()
            .expect("an OTLP exporter");
        let batches = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_scheduled_delay(Duration::from_millis(100))
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batches)
            .with_resource(
                opentelemetry_sdk::Resource::builder_empty()
                    .with_service_name("payments")
                    .build(),
            )
            .build();
        let payments = Arc::new(Self {
            provider,
            charges: AtomicUsize::new(0),
            headers: Mutex::default(),
        });
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the service");
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = Router::new().route("/pay", post(pay)).with_state(payments.clone());
        let task = tokio::spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, app).await.expect("the service serves");
        });
        (payments, url, task)
    }
}

async fn pay(State(payments): State<Arc<Payments>>, headers: HeaderMap) -> (StatusCode, String) {
    let parent = TraceContextPropagator::new().extract(&Headers(&headers));
    let tracer = payments.provider.tracer("payments");
    let span = tracer
        .span_builder("POST /pay")
        .with_kind(SpanKind::Server)
        .start_with_context(&tracer, &parent);
    let charge = payments.charges.fetch_add(1, Ordering::SeqCst) + 1;
    payments.headers.lock().unwrap().push(headers);
    drop(span);
    (StatusCode::CREATED, format!(r#"{{"charge":{charge}}}"#))
}

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key)?.to_str().ok()
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The environment that turns a gateway's traces on, exported to `receiver` every 100 ms.
fn traced(receiver: &Receiver, service: &'static str) -> Vec<(&'static str, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url()),
        ("OTEL_SERVICE_NAME", service.to_owned()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned()),
        ("IDEM_LOG_FORMAT", "json".to_owned()),
    ]
}

fn env<'a>(pairs: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    pairs.iter().map(|(name, value)| (*name, value.as_str())).collect()
}

fn request_spans<'a>(spans: &'a [Received], outcome: &str) -> Vec<&'a Received> {
    spans
        .iter()
        .filter(|s| s.name().ends_with(" default") && s.attribute("idem.outcome").as_deref() == Some(outcome))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_is_one_trace_and_every_replay_links_to_its_run() {
    let receiver = Receiver::start().await;
    let (payments, upstream, _service) = Payments::start(&receiver);
    let (a_env, b_env) = (traced(&receiver, "idem-a"), traced(&receiver, "idem-b"));
    let a = Gateway::start_with_env(&upstream, &[], &env(&a_env)).await;
    let b = Gateway::start_on_store_with_env(&upstream, &a.store, &[], &env(&b_env)).await;
    let key = new_key();
    let payment = |gw: &Gateway| gw.keyed("/pay", key.as_str(), PAY_BODY);

    // The payment, in the caller's trace.
    let first = send(
        payment(&a)
            .header("traceparent", format!("00-{TRACE_ID}-{CALLER_SPAN}-01"))
            .header("tracestate", "vendor=opaque"),
    )
    .await;
    assert_eq!((first.status, first.replayed()), (201, false), "{}", first.text());
    // Its copies, in traces of their own: through the other instance (from the store), then the
    // first twice (from the store, then from its replay cache).
    for gw in [&b, &a, &a] {
        let copy = send(payment(gw)).await;
        assert_eq!((copy.status, copy.replayed()), (201, true), "{}", copy.text());
    }
    assert_eq!(payments.charges.load(Ordering::SeqCst), 1, "the payment ran once");
    let provider = payments.provider.clone();
    tokio::task::spawn_blocking(move || provider.force_flush())
        .await
        .unwrap()
        .expect("the service's spans are sent");

    let spans = receiver
        .wait_for(Duration::from_secs(20), |spans| {
            request_spans(spans, "new").len() == 1
                && request_spans(spans, "replayed").len() == 3
                && spans.iter().any(|s| s.service == "payments")
                && spans.iter().any(|s| s.name() == "store complete")
        })
        .await;

    // The run: a child of the caller's span, in the caller's trace.
    let run = request_spans(&spans, "new")[0];
    assert_eq!(run.service, "idem-a");
    assert_eq!(
        (run.trace_id(), run.parent_span_id()),
        (TRACE_ID.to_owned(), CALLER_SPAN.to_owned())
    );
    assert_eq!(run.span.kind, ReceivedKind::Server as i32);
    assert_eq!(run.name(), "POST default");
    for (attribute, value) in [
        ("idem.key", key.as_str()),
        ("idem.scope", "anonymous"),
        ("idem.route", "default"),
        ("idem.replayed", "false"),
        ("idem.recovered", "false"),
        ("http.request.method", "POST"),
        ("http.response.status_code", "201"),
    ] {
        assert_eq!(
            run.attribute(attribute).as_deref(),
            Some(value),
            "{attribute} of {run:?}"
        );
    }
    // Its store operations and its upstream call are its children.
    let children: Vec<&str> = spans
        .iter()
        .filter(|s| s.parent_span_id() == run.span_id())
        .map(Received::name)
        .collect();
    for child in ["store begin", "store complete", "upstream"] {
        assert!(
            children.contains(&child),
            "{child} is not a child of the run: {children:?}"
        );
    }
    let upstream = spans
        .iter()
        .find(|s| s.name() == "upstream" && s.parent_span_id() == run.span_id())
        .unwrap();
    assert_eq!(upstream.attribute("http.response.status_code").as_deref(), Some("201"));
    // The service's span is a child of idem's upstream span: the service was sent idem's span as
    // its parent, and the caller's trace state.
    let service = spans.iter().find(|s| s.service == "payments").unwrap();
    assert_eq!(
        (service.trace_id(), service.parent_span_id()),
        (TRACE_ID.to_owned(), upstream.span_id())
    );
    let sent = payments.headers.lock().unwrap()[0].clone();
    assert_eq!(
        sent.get("tracestate").and_then(|v| v.to_str().ok()),
        Some("vendor=opaque")
    );
    // No store operation is a trace of its own.
    for span in spans.iter().filter(|s| s.name().starts_with("store ")) {
        assert!(!span.span.parent_span_id.is_empty(), "a root store span: {span:?}");
    }

    // Every replay is in a trace of its own, and links to the run.
    let replays = request_spans(&spans, "replayed");
    for replay in &replays {
        assert_ne!(replay.trace_id(), TRACE_ID, "{replay:?}");
        assert_eq!(replay.attribute("idem.answered_by").as_deref(), Some(TRACE_ID));
        assert_eq!(replay.attribute("idem.replayed").as_deref(), Some("true"));
        let links: Vec<(String, String)> = replay
            .span
            .links
            .iter()
            .map(|link| (otlp::hex(&link.trace_id), otlp::hex(&link.span_id)))
            .collect();
        assert_eq!(links, [(TRACE_ID.to_owned(), run.span_id())], "{replay:?}");
    }
    assert_eq!(
        replays.iter().filter(|r| r.service == "idem-b").count(),
        1,
        "one replay through the other instance"
    );

    // The record names the run's trace and span, for an operator to find it from the key.
    let inspect = common::run_idem(
        &["inspect", "--json", "--store", &a.store, &key],
        Duration::from_secs(60),
    )
    .await;
    let record: serde_json::Value = serde_json::from_slice(&inspect.stdout).expect("one JSON object");
    assert_eq!(
        (record["trace_id"].as_str(), record["span_id"].as_str()),
        (Some(TRACE_ID), Some(run.span_id().as_str()))
    );

    // The run's log line joins the trace, named as the OpenTelemetry log data model names it.
    let run_lines = |stderr: &str| -> Vec<serde_json::Value> {
        stderr
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .filter(|line: &serde_json::Value| line["Body"] == "idempotency" && line["Attributes"]["outcome"] == "new")
            .collect()
    };
    let stderr = a
        .stderr_once("the run's log line", |stderr| !run_lines(stderr).is_empty())
        .await;
    let lines = run_lines(&stderr);
    assert_eq!(lines.len(), 1, "{stderr}");
    assert_eq!(
        (lines[0]["TraceId"].as_str(), lines[0]["SpanId"].as_str()),
        (Some(TRACE_ID), Some(run.span_id().as_str()))
    );
    assert_eq!(
        (
            lines[0]["SeverityText"].as_str(),
            lines[0]["Attributes"]["key"].as_str()
        ),
        (Some("INFO"), Some(key.as_str()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_over_another_protocol_are_refused_at_start() {
    for (name, value) in [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
        ("OTEL_TRACES_EXPORTER", "zipkin"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url"),
    ] {
        let output = common::serve_refusing(
            &["--upstream", "http://127.0.0.1:9"],
            &[("OTEL_SERVICE_NAME", "idem"), (name, value)],
        )
        .await;
        assert_eq!(
            output.status.code(),
            Some(2),
            "{name}={value}: {}",
            common::describe(&output)
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(name), "{stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_endpoint_is_spoken_to_over_tls_and_a_failed_export_is_logged() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // A password in the endpoint is never printed.
    let endpoint = format!("https://idem:sekret@{}", listener.local_addr().unwrap());
    let upstream = common::Upstream::start().await;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "50"),
    ];
    let gw = Gateway::start_with_env(&upstream.url(), &[], &env).await;
    let key = new_key();
    let payment = gw.keyed("/pay", key.as_str(), PAY_BODY);
    assert_eq!(send(payment).await.status, 201);
    let (mut connection, _) = tokio::time::timeout(Duration::from_secs(20), listener.accept())
        .await
        .expect("the exporter connects to the https endpoint")
        .unwrap();
    let mut first = [0_u8; 1];
    tokio::io::AsyncReadExt::read_exact(&mut connection, &mut first)
        .await
        .unwrap();
    assert_eq!(first[0], 0x16, "a TLS handshake record, not plain HTTP");
    drop(connection);
    drop(listener);
    // The export fails (no TLS answers it): the gateway says so.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !gw.stderr().contains("ExportError") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no export error logged: {}",
            gw.stderr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!gw.stderr().contains("sekret"), "{}", gw.stderr());
}

/// At `debug` the OTLP exporter logs its own `HttpClient.NetworkError` line, with the endpoint's
/// URL, on every failed export: the password in it is masked all the same, in either log format.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_in_the_endpoint_is_masked_in_the_exporters_own_lines() {
    const PASSWORD: &str = "otlp-Pw-7xq";
    let upstream = common::Upstream::start().await;
    for format in ["text", "json"] {
        // Nothing listens there: every export fails to connect.
        let closed = common::reserve_port();
        let endpoint = format!("http://idem:{PASSWORD}@{closed}");
        let env = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "50"),
            ("IDEM_LOG", "debug"),
            ("IDEM_LOG_FORMAT", format),
        ];
        let gw = Gateway::start_with_env(&upstream.url(), &[], &env).await;
        let payment = gw.keyed("/pay", new_key().as_str(), PAY_BODY);
        assert_eq!(send(payment).await.status, 201);
        let stderr = gw
            .stderr_once("the exporter's failed export", |stderr| {
                stderr.contains("HttpClient.NetworkError")
            })
            .await;
        let network_error = stderr
            .lines()
            .find(|line| line.contains("HttpClient.NetworkError"))
            .unwrap();
        assert!(
            network_error.contains(&format!("http://idem:***@{closed}")),
            "{format}: the line shows the URL, masked: {network_error}"
        );
        assert!(
            !stderr.contains(PASSWORD),
            "{format}: a log line shows the password:\n{stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_hangs_neither_stops_the_payments_nor_holds_the_exit() {
    // Takes every connection and never answers one.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", hole.local_addr().unwrap());
    let _held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((connection, _)) = hole.accept().await {
            held.push(connection);
        }
    });
    let upstream = common::Upstream::start().await;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "50"),
    ];
    let mut gw = Gateway::start_with_env(&upstream.url(), &["--shutdown-grace", "1s"], &env).await;
    for _ in 0..20 {
        let key = new_key();
        let payment = || gw.keyed("/pay", key.as_str(), PAY_BODY);
        let first = send(payment()).await;
        assert_eq!((first.status, first.replayed()), (201, false), "{}", first.text());
        let copy = send(payment()).await;
        assert_eq!((copy.status, copy.replayed()), (201, true), "{}", copy.text());
    }
    assert_eq!(common::count(&upstream.state.pay), 20, "each payment ran once");
    // Within its grace (1 s), whatever the receiver does; a margin for a loaded machine.
    gw.terminate();
    let status = gw.wait_exit(Duration::from_secs(5)).await;
    assert!(status.success(), "{status:?}: {}", gw.stderr());
}
