//! `IDEM_LOG_FORMAT=json`: one JSON object per line, its fields named as the OpenTelemetry log
//! data model names a log record's: `Timestamp` (nanoseconds since the Unix epoch, as a string:
//! a JSON number would lose digits), `SeverityText`, `SeverityNumber`, `Body` (the message),
//! `TraceId` and `SpanId` (from the event's `trace_id` and `span_id` fields: a keyed request's
//! line has them when its trace is known), `Attributes` (every other field) and
//! `InstrumentationScope` (`Name`: the module that logged).

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The JSON line format ([module docs](self)).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct OtelJson;

impl<S, N> FormatEvent<S, N> for OtelJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, _ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let metadata = event.metadata();
        let mut fields = Fields::default();
        event.record(&mut fields);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos());
        let (text, number) = severity(*metadata.level());
        let mut record = Map::new();
        record.insert("Timestamp".into(), Value::String(nanos.to_string()));
        record.insert("SeverityText".into(), text.into());
        record.insert("SeverityNumber".into(), number.into());
        record.insert("Body".into(), fields.body.unwrap_or_default().into());
        if let Some(trace_id) = fields.trace_id {
            record.insert("TraceId".into(), trace_id.into());
        }
        if let Some(span_id) = fields.span_id {
            record.insert("SpanId".into(), span_id.into());
        }
        record.insert("Attributes".into(), Value::Object(fields.attributes));
        record.insert("InstrumentationScope".into(), json!({ "Name": metadata.target() }));
        writeln!(writer, "{}", Value::Object(record))
    }
}

/// The data model's severity text and number of a level (the first number of each range).
fn severity(level: Level) -> (&'static str, u8) {
    match level {
        Level::TRACE => ("TRACE", 1),
        Level::DEBUG => ("DEBUG", 5),
        Level::INFO => ("INFO", 9),
        Level::WARN => ("WARN", 13),
        Level::ERROR => ("ERROR", 17),
    }
}

/// An event's fields, sorted into the record's parts.
#[derive(Default)]
struct Fields {
    body: Option<String>,
    trace_id: Option<String>,
    span_id: Option<String>,
    attributes: Map<String, Value>,
}

impl Fields {
    fn put(&mut self, field: &Field, value: Value) {
        let text = || match &value {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        };
        match field.name() {
            "message" => self.body = Some(text()),
            "trace_id" => self.trace_id = Some(text()),
            "span_id" => self.span_id = Some(text()),
            name => {
                self.attributes.insert(name.to_owned(), value);
            }
        }
    }
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, format!("{value:?}").into());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Lines written by a subscriber that formats with [`OtelJson`].
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn logged(log: impl FnOnce()) -> Value {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .event_format(OtelJson)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, log);
        let bytes = lines.0.lock().unwrap().clone();
        let text = String::from_utf8(bytes).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn a_keyed_requests_line_is_named_as_the_log_data_model_names_it() {
        let line = logged(|| {
            tracing::info!(
                scope = "app",
                key = "k1",
                outcome = %"replayed",
                status = 201_u16,
                trace_id = %"4bf92f3577b34da6a3ce929d0e0e4736",
                span_id = %"00f067aa0ba902b7",
                "idempotency"
            )
        });
        assert_eq!(line["SeverityText"], "INFO");
        assert_eq!(line["SeverityNumber"], 9);
        assert_eq!(line["Body"], "idempotency");
        assert_eq!(line["TraceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(line["SpanId"], "00f067aa0ba902b7");
        assert_eq!(
            line["Attributes"],
            json!({"scope": "app", "key": "k1", "outcome": "replayed", "status": 201})
        );
        assert_eq!(line["InstrumentationScope"]["Name"], module_path!());
        let nanos: u128 = line["Timestamp"].as_str().unwrap().parse().unwrap();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
        assert!(now - nanos < 60_000_000_000, "{nanos} is not now ({now})");
    }

    #[test]
    fn a_line_without_a_trace_has_no_trace_fields() {
        let line = logged(|| tracing::warn!(error = %"refused", "could not release the record"));
        assert_eq!(
            (line["SeverityText"].as_str(), line["SeverityNumber"].as_u64()),
            (Some("WARN"), Some(13))
        );
        assert!(line.get("TraceId").is_none() && line.get("SpanId").is_none(), "{line}");
        assert_eq!(line["Attributes"], json!({"error": "refused"}));
    }
}
