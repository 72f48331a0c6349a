//! Where the command's logs and traces go: log lines to stderr (text, or JSON in the
//! OpenTelemetry log data model, [`crate::log_format`]), filtered by `IDEM_LOG`; and, for
//! `idem serve` when the standard `OTEL_*` variables ask for it, idem's spans (target
//! [`idem_core::spans::TARGET`]) exported over OTLP/HTTP with protobuf. Every log line, its
//! dependencies' included, has the passwords of its URLs masked ([`crate::log_redact`]).
//!
//! With traces off, idem's spans are disabled at their callsites (the filter turns their target
//! off), so the request path pays one disabled-callsite check per span and nothing else.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idem_core::spans::TARGET;
use opentelemetry::propagation::Injector;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{EnvFilter, Targets};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{Layer as _, fmt};

use crate::log_format::OtelJson;
use crate::log_redact::RedactUrls;
use crate::log_writer::LogWriter;
use crate::misconfigured::Misconfigured;

/// The service name traces carry when neither `OTEL_SERVICE_NAME` nor `OTEL_RESOURCE_ATTRIBUTES`
/// names one.
const SERVICE_NAME: &str = "idem";

/// How long `idem` waits, when it stops, for its last spans to be sent (less if its shutdown
/// grace ends sooner).
const LAST_TRACES: Duration = Duration::from_secs(2);

/// What [`init`] started: the trace exporter, if traces are on, and the gateway's batched log
/// writer, both flushed by [`Telemetry::shutdown`].
#[derive(Debug)]
pub(crate) struct Telemetry {
    traces: Option<SdkTracerProvider>,
    logs: Option<LogWriter>,
    /// When the process must have exited (its shutdown grace), once it is stopping.
    stop_by: Mutex<Option<Instant>>,
}

impl Telemetry {
    /// The process is stopping and must have exited by `deadline`: the last spans get what is
    /// left of it.
    pub(crate) fn stop_by(&self, deadline: Instant) {
        *self.stop_by.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(deadline);
    }

    /// Writes the log lines still buffered.
    pub(crate) fn flush_logs(&self) {
        if let Some(logs) = &self.logs {
            logs.flush();
        }
    }

    /// Sends the spans still batched, and stops the exporter: for at most [`LAST_TRACES`], and
    /// within the shutdown grace, so a receiver that hangs does not hold the exit.
    /// Then writes the log lines still buffered.
    pub(crate) fn shutdown(self) {
        if let Some(provider) = &self.traces {
            let stop_by = *self.stop_by.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let left = stop_by.map_or(LAST_TRACES, |deadline| {
                deadline.saturating_duration_since(Instant::now()).min(LAST_TRACES)
            });
            if let Err(err) = provider.shutdown_with_timeout(left) {
                tracing::error!("could not send the last traces within {left:?}: {err}");
            }
        }
        self.flush_logs();
    }
}

/// Installs the global subscriber: logs at `default_filter` unless `IDEM_LOG` says otherwise.
/// For the gateway (`serving`), its log lines are written in batches ([`LogWriter`]) and, if the
/// environment asks for them ([`traces_wanted`]), idem's spans are exported over OTLP.
pub(crate) fn init(default_filter: &str, serving: bool) -> anyhow::Result<Telemetry> {
    // The OpenTelemetry SDK's own events say when an export fails (at `error`); below `warn`
    // they are chatter.
    let default_filter = format!("{default_filter},opentelemetry=warn,opentelemetry_sdk=warn,opentelemetry-otlp=warn");
    let filter = EnvFilter::try_from_env("IDEM_LOG")
        .unwrap_or_else(|_| EnvFilter::new(default_filter))
        // Spans are for traces: a log line does not carry them.
        .add_directive(format!("{TARGET}=off").parse().expect("a valid directive"));
    let json = std::env::var("IDEM_LOG_FORMAT").is_ok_and(|f| f == "json");
    let provider = if serving && traces_wanted()? {
        Some(tracer_provider()?)
    } else {
        None
    };
    let writer = if serving { Some(LogWriter::start()?) } else { None };
    let ansi = std::io::stderr().is_terminal();
    let Some(provider) = provider else {
        // Traces off: the filter is global, so a disabled span is never built.
        let logs = fmt().with_env_filter(filter).with_ansi(ansi && !json);
        match (&writer, json) {
            (Some(writer), true) => logs
                .with_writer(RedactUrls(writer.clone()))
                .event_format(OtelJson)
                .init(),
            (Some(writer), false) => logs.with_writer(RedactUrls(writer.clone())).init(),
            (None, true) => logs
                .with_writer(RedactUrls(std::io::stderr))
                .event_format(OtelJson)
                .init(),
            (None, false) => logs.with_writer(RedactUrls(std::io::stderr)).init(),
        }
        return Ok(Telemetry {
            traces: None,
            logs: writer,
            stop_by: Mutex::default(),
        });
    };
    let writer = writer.expect("traces are exported by the gateway only");
    let logs = fmt::layer().with_writer(RedactUrls(writer.clone()));
    let logs = if json {
        logs.event_format(OtelJson).with_filter(filter).boxed()
    } else {
        logs.with_ansi(ansi).with_filter(filter).boxed()
    };
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("idem"))
        .with_tracked_inactivity(false)
        .with_threads(false)
        .with_location(false)
        .with_target(false)
        .with_filter(Targets::new().with_target(TARGET, tracing::Level::INFO));
    tracing_subscriber::registry().with(logs).with(spans).init();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    // A password in the endpoint's URL is never printed (and every line is masked again on its way out).
    tracing::info!(
        endpoint = %idem_core::redact_url(&traces_endpoint()),
        "exporting traces over OTLP/HTTP"
    );
    Ok(Telemetry {
        traces: Some(provider),
        logs: Some(writer),
        stop_by: Mutex::default(),
    })
}

/// True if the standard variables ask for traces: an OTLP endpoint, a service name or
/// `OTEL_TRACES_EXPORTER=otlp`, unless `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`.
/// A protocol or exporter idem does not speak is refused rather than silently dropped.
fn traces_wanted() -> Result<bool, Misconfigured> {
    if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(false);
    }
    let exporter = set("OTEL_TRACES_EXPORTER");
    match exporter.as_deref().map(str::trim) {
        Some("none") => return Ok(false),
        None | Some("otlp") => {}
        Some(other) => {
            return Err(Misconfigured {
                flag: "OTEL_TRACES_EXPORTER",
                reason: format!("`{other}`: idem exports traces over OTLP only (`otlp`), or not at all (`none`)"),
            });
        }
    }
    let wanted = exporter.is_some()
        || [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_SERVICE_NAME",
        ]
        .into_iter()
        .any(|name| set(name).is_some());
    if !wanted {
        return Ok(false);
    }
    for name in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
        if let Some(protocol) = set(name) {
            if protocol.trim() != "http/protobuf" {
                return Err(Misconfigured {
                    flag: name,
                    reason: format!(
                        "`{protocol}`: idem exports traces over OTLP/HTTP with protobuf only (`http/protobuf`)"
                    ),
                });
            }
            break;
        }
    }
    Ok(true)
}

/// The exporter (endpoint, headers, timeout and compression from the `OTEL_EXPORTER_OTLP_*`
/// variables), batched (`OTEL_BSP_*`), sampled as `OTEL_TRACES_SAMPLER` says (by default, as the
/// caller's trace was, and every new trace).
fn tracer_provider() -> anyhow::Result<SdkTracerProvider> {
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()
        .map_err(|err| {
            let flag = if std::env::var_os("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some() {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
            } else {
                "OTEL_EXPORTER_OTLP_ENDPOINT"
            };
            Misconfigured {
                flag,
                reason: format!("cannot export traces there: {err}"),
            }
        })?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    let named = set("OTEL_SERVICE_NAME").is_some()
        || set("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|attributes| attributes.contains("service.name="));
    if !named {
        resource = resource.with_service_name(SERVICE_NAME);
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

/// Where traces go, for the start-up log line (as the exporter resolves it).
fn traces_endpoint() -> String {
    set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .or_else(|| set("OTEL_EXPORTER_OTLP_ENDPOINT").map(|base| format!("{}/v1/traces", base.trim_end_matches('/'))))
        .unwrap_or_else(|| "http://localhost:4318/v1/traces".to_owned())
}

/// The value of the environment variable `name`, if it is set to something other than blanks
/// (as the OpenTelemetry SDK reads its variables).
fn set(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|value| !value.trim().is_empty())
}

/// Names the current span (the upstream call's) as the parent of the request sent upstream, so
/// that the service's own spans join the trace. With traces off there is no such span, and the
/// caller's `traceparent` and `tracestate` pass unchanged.
pub(crate) fn inject(headers: &mut http::HeaderMap) {
    if !tracing::enabled!(target: TARGET, tracing::Level::INFO) {
        return;
    }
    let span = tracing::Span::current();
    if span.is_disabled() {
        return;
    }
    let context = span.context();
    if !context.span().span_context().is_valid() {
        return;
    }
    // The caller's `tracestate` belongs to the caller's span: the propagator writes the current
    // span's (or none).
    headers.remove("tracestate");
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut HeaderInjector(headers))
    });
}

/// The upstream request's headers, as a propagator writes them.
struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // An empty `tracestate` is not sent (Trace Context: "vendors SHOULD NOT send it empty").
        if value.is_empty() {
            return;
        }
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}
