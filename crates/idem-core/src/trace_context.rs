//! The W3C trace context a request arrives with (`traceparent`), read for the one thing a record
//! keeps of it: the trace id, so that an operator who finds a key in the store (`idem list`,
//! `idem inspect`) can find the trace of the run that answered it.
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

impl TraceId {
    /// The trace id of `headers`' `traceparent`, if there is exactly one and it is valid.
    pub fn from_headers(headers: &HeaderMap) -> Option<Self> {
        let mut values = headers.get_all(TRACEPARENT).iter();
        let value = values.next()?;
        if values.next().is_some() {
            return None;
        }
        Self::from_traceparent(value.to_str().ok()?)
    }

    /// The trace id of a `traceparent` value. Version `00` must be exactly its four fields; a
    /// later version (`01` to `fe`) is read as the recommendation asks, by its first four fields,
    /// whatever follows them after a `-`.
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
        if !is_lower_hex(parent_id) || !is_lower_hex(flags) || parent_id.bytes().all(|b| b == b'0') {
            return None;
        }
        Self::from_hex(trace_id)
    }

    /// A trace id from its 32 lowercase hex digits (as stored, and as `traceparent` writes it).
    pub fn from_hex(hex: &str) -> Option<Self> {
        if hex.len() != 32 || !is_lower_hex(hex) {
            return None;
        }
        let mut bytes = [0; 16];
        for (byte, pair) in bytes.iter_mut().zip(hex.as_bytes().chunks(2)) {
            *byte = (digit(pair[0]) << 4) | digit(pair[1]);
        }
        Self::from_bytes(bytes)
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
    fn reads_the_trace_id_of_a_version_00_header() {
        let id = TraceId::from_traceparent(VALID).unwrap();
        assert_eq!(id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(TraceId::from_hex(&id.to_string()), Some(id));
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
            assert_eq!(TraceId::from_traceparent(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_by_its_first_four_fields() {
        for later in [
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-adds",
        ] {
            let id = TraceId::from_traceparent(later).unwrap_or_else(|| panic!("{later}"));
            assert_eq!(id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        }
    }

    #[test]
    fn two_traceparent_headers_name_no_trace() {
        let mut headers = HeaderMap::new();
        headers.append(TRACEPARENT, VALID.parse().unwrap());
        assert!(TraceId::from_headers(&headers).is_some());
        headers.append(TRACEPARENT, VALID.parse().unwrap());
        assert_eq!(TraceId::from_headers(&headers), None);
    }
}
