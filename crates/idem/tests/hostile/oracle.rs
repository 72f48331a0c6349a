//! The independent key oracle: what docs/design.md says about key header values, written here
//! again without idem-core, so that a fault in idem-core's parser cannot hide itself.

use axum::http::{HeaderMap, HeaderValue};
use idem_core::IdempotencyKey;

use crate::KEY;

/// Whether hyper (httparse) takes these bytes as a header value: HTAB, SP, VCHAR and obs-text.
pub(crate) fn http_value_ok(value: &[u8]) -> bool {
    value
        .iter()
        .all(|&b| b == b'\t' || (0x20..=0x7e).contains(&b) || b >= 0x80)
}

/// Whether one received key header value is a valid key (docs/design.md, "What is protected"): after the
/// optional whitespace around a field value, either one whole RFC 8941 sf-string with no
/// parameters, or a bare key without `"`, `,` and `\`; the key itself 1 to 255 visible ASCII
/// characters.
pub(crate) fn key_is_valid(raw: &[u8]) -> bool {
    let start = raw.iter().position(|&b| b != b' ' && b != b'\t').unwrap_or(raw.len());
    let end = raw
        .iter()
        .rposition(|&b| b != b' ' && b != b'\t')
        .map_or(start, |i| i + 1);
    let value = &raw[start..end];
    if !value.iter().all(|b| (0x20..=0x7e).contains(b)) {
        return false;
    }
    let key: Vec<u8> = if value.first() == Some(&b'"') {
        let mut key = Vec::new();
        let mut i = 1;
        loop {
            match value.get(i) {
                None => return false,
                Some(b'"') if i + 1 == value.len() => break,
                Some(b'"') => return false,
                Some(b'\\') => match value.get(i + 1) {
                    Some(&c @ (b'"' | b'\\')) => {
                        key.push(c);
                        i += 2;
                    }
                    _ => return false,
                },
                Some(&c) => {
                    key.push(c);
                    i += 1;
                }
            }
        }
        key
    } else {
        if value.iter().any(|b| matches!(b, b'"' | b',' | b'\\')) {
            return false;
        }
        value.to_vec()
    };
    !key.is_empty() && key.len() <= 255 && key.iter().all(u8::is_ascii_graphic)
}

/// Whether idem-core's public parser accepts these values of the key header.
pub(crate) fn library_accepts(values: &[Vec<u8>]) -> bool {
    let mut headers = HeaderMap::new();
    for value in values {
        let Ok(value) = HeaderValue::from_bytes(value) else {
            return false;
        };
        headers.append(KEY, value);
    }
    matches!(IdempotencyKey::from_headers(headers.get_all(KEY)), Ok(Some(_)))
}
