//! The W3C trace context a request arrives with (`traceparent`), read for what a record keeps of
//! it: where the run that answered a key sits in its trace ([`RunTrace`]), so that an operator who
//! finds a key in the store (`idem list`, `idem inspect`) can find the trace of that run, and a
//! replay's span can link to it.
//!
//! Version `00` is read as the Trace Context recommendation (level 1) writes it:
//! `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, lowercase, an all-zero id invalid; a
//! later version by those four fields, ignoring what it adds after them; `ff` never. A
//! header that does not parse is ignored, as the recommendation asks, never refused: tracing must
//! not decide whether a payment runs.

use std::fmt;

use http::HeaderMap;

/// The `traceparent` request header.
pub const TRACEPARENT: &str = "traceparent";

/// A W3C trace id: 16 bytes, never all zero, written as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId([u8; 16]);

/// A W3C span id: 8 bytes, never all zero, written as 16 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpanId([u8; 8]);

/// Where a run sits in its trace: the trace id, and the span that a later replay's span links to
/// — idem's own span of the request when idem exports traces, else the caller's span (the
/// `traceparent`'s parent id).
///
/// Stored as `<trace id>-<span id>`; a record written before records kept the span has the trace
/// id alone, which [`RunTrace::from_stored`] reads too.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct RunTrace {
    /// The trace.
    pub trace_id: TraceId,
    /// The span a replay links to, if known.
    pub span_id: Option<SpanId>,
}

impl RunTrace {
    /// The run trace of `headers`' `traceparent` (its trace id and parent id), if there is exactly
    /// one and it is valid.
    pub fn from_headers(headers: &HeaderMap) -> Option<Self> {
        let mut values = headers.get_all(TRACEPARENT).iter();
        let value = values.next()?;
        if values.next().is_some() {
            return None;
        }
        Self::from_traceparent(value.to_str().ok()?)
    }

    /// The trace id and parent id of a `traceparent` value. Version `00` must be exactly its four
    /// fields; a later version (`01` to `fe`) is read as the recommendation asks, by its first
    /// four fields, whatever follows them after a `-`.
    pub fn from_traceparent(value: &str) -> Option<Self> {
        let version = value.get(..2)?;
        let value = match version {
            "00" => value,
            "ff" => return None,
            _ if is_lower_hex(version) && (value.len() == 55 || value.as_bytes().get(55) == Some(&b'-')) => {
                value.get(..55)?
            }
            _ => return None,
        };
        let mut parts = value.split('-');
        let (_, trace_id, parent_id, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || parent_id.len() != 16 || flags.len() != 2 {
            return None;
        }
        if !is_lower_hex(flags) {
            return None;
        }
        Some(Self {
            trace_id: TraceId::from_hex(trace_id)?,
            span_id: Some(SpanId::from_hex(parent_id)?),
        })
    }

    /// A run trace as a store keeps it: `<trace id>-<span id>`, or the trace id alone.
    pub fn from_stored(stored: &str) -> Option<Self> {
        match stored.split_once('-') {
            None => Some(Self {
                trace_id: TraceId::from_hex(stored)?,
                span_id: None,
            }),
            Some((trace_id, span_id)) => Some(Self {
                trace_id: TraceId::from_hex(trace_id)?,
                span_id: Some(SpanId::from_hex(span_id)?),
            }),
        }
    }
}

impl fmt::Display for RunTrace {
    /// The form a store keeps ([`RunTrace::from_stored`] reads it back).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.span_id {
            Some(span_id) => write!(f, "{}-{span_id}", self.trace_id),
            None => write!(f, "{}", self.trace_id),
        }
    }
}

impl SpanId {
    /// A span id from its 16 lowercase hex digits; `None` for the invalid all-zero id.
    pub fn from_hex(hex: &str) -> Option<Self> {
        let bytes: [u8; 8] = hex_bytes(hex)?;
        (bytes != [0; 8]).then_some(Self(bytes))
    }

    /// A span id from its bytes; `None` for the invalid all-zero id.
    pub fn from_bytes(bytes: [u8; 8]) -> Option<Self> {
        (bytes != [0; 8]).then_some(Self(bytes))
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; 8] {
        &self.0
    }
}

impl TraceId {
    /// A trace id from its 32 lowercase hex digits (as stored, and as `traceparent` writes it).
    pub fn from_hex(hex: &str) -> Option<Self> {
        Self::from_bytes(hex_bytes(hex)?)
    }

    /// A trace id from its bytes; `None` for the invalid all-zero id.
    pub fn from_bytes(bytes: [u8; 16]) -> Option<Self> {
        (bytes != [0; 16]).then_some(Self(bytes))
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

/// `N` bytes from exactly `2 * N` lowercase hex digits.
fn hex_bytes<const N: usize>(hex: &str) -> Option<[u8; N]> {
    if hex.len() != 2 * N || !is_lower_hex(hex) {
        return None;
    }
    let mut bytes = [0; N];
    for (byte, pair) in bytes.iter_mut().zip(hex.as_bytes().chunks(2)) {
        *byte = (digit(pair[0]) << 4) | digit(pair[1]);
    }
    Some(bytes)
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn digit(b: u8) -> u8 {
    match b {
        b'0'..=b'9' => b - b'0',
        _ => b - b'a' + 10,
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Display for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SpanId({self})")
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceId({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn reads_the_trace_and_parent_ids_of_a_version_00_header() {
        let run = RunTrace::from_traceparent(VALID).unwrap();
        assert_eq!(run.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(run.span_id.unwrap().to_string(), "00f067aa0ba902b7");
        assert_eq!(TraceId::from_hex(&run.trace_id.to_string()), Some(run.trace_id));
    }

    #[test]
    fn a_run_trace_is_read_back_as_stored_and_as_stored_before_spans() {
        let run = RunTrace::from_traceparent(VALID).unwrap();
        assert_eq!(run.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7");
        assert_eq!(RunTrace::from_stored(&run.to_string()), Some(run));
        let before = RunTrace::from_stored("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
        assert_eq!((before.trace_id, before.span_id), (run.trace_id, None));
        for bad in [
            "",
            "4bf92f3577b34da6a3ce929d0e0e4736-",
            "4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000",
            "00000000000000000000000000000000-00f067aa0ba902b7",
            "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(RunTrace::from_stored(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ignores_what_the_recommendation_calls_invalid() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(RunTrace::from_traceparent(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_by_its_first_four_fields() {
        for later in [
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-adds",
        ] {
            let run = RunTrace::from_traceparent(later).unwrap_or_else(|| panic!("{later}"));
            assert_eq!(run.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        }
    }

    #[test]
    fn two_traceparent_headers_name_no_trace() {
        let mut headers = HeaderMap::new();
        headers.append(TRACEPARENT, VALID.parse().unwrap());
        assert!(RunTrace::from_headers(&headers).is_some());
        headers.append(TRACEPARENT, VALID.parse().unwrap());
        assert_eq!(RunTrace::from_headers(&headers), None);
    }
}
