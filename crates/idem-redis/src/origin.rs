//! The `origin` field of a record hash: the record's scope and key (its keys' names are a hash of
//! them, so `list` could not name the record otherwise) and the method and path of the request
//! that made it, in one value, so that a new claim writes one field more, not four.
//!
//! Each part is its length in bytes, in decimal, a `:`, then its bytes (`5:app:a2:k14:POST9:/payments`):
//! any byte may appear in a part, and the value still reads in `redis-cli`.

use std::io::Write as _;

use idem_core::store::{Origin, RecordId};

/// The four parts of a stored `origin`, borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StoredOrigin<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) method: &'a str,
    pub(crate) path: &'a str,
}

/// The `origin` a new claim on `id` by a request with `origin` writes.
pub(crate) fn encode(id: &RecordId, origin: &Origin) -> Vec<u8> {
    let parts = [id.scope.as_str(), id.key.as_str(), &origin.method, &origin.path];
    // Up to 20 digits and a colon per part.
    let mut out = Vec::with_capacity(parts.iter().map(|part| part.len() + 21).sum());
    for part in parts {
        // Into the same buffer: `begin` writes an origin on every call.
        write!(out, "{}:", part.len()).expect("writing to a Vec cannot fail");
        out.extend_from_slice(part.as_bytes());
    }
    out
}

/// Reads an `origin` written by [`encode`]; `None` if it is not one.
pub(crate) fn decode(mut bytes: &[u8]) -> Option<StoredOrigin<'_>> {
    let (scope, key) = (part(&mut bytes)?, part(&mut bytes)?);
    let (method, path) = (part(&mut bytes)?, part(&mut bytes)?);
    bytes.is_empty().then_some(StoredOrigin {
        scope,
        key,
        method,
        path,
    })
}

/// The part at the start of `bytes`, which then start after it.
fn part<'a>(bytes: &mut &'a [u8]) -> Option<&'a str> {
    let all: &'a [u8] = bytes;
    // At most 20 digits (a `usize`), then the colon.
    let colon = all.iter().take(21).position(|&b| b == b':')?;
    let digits = &all[..colon];
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let len: usize = std::str::from_utf8(digits).ok()?.parse().ok()?;
    let rest = &all[colon + 1..];
    let text = std::str::from_utf8(rest.get(..len)?).ok()?;
    *bytes = &rest[len..];
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::test_id as id;

    #[test]
    fn an_origin_reads_back_whatever_its_parts_hold() {
        let id = id("app:alice 3:x", "k:1");
        // Built by hand: `Origin::new` would read the path (its control character made U+FFFD).
        let origin = Origin {
            method: "POST".to_owned(),
            path: "/pay/3:é/4:\u{0}".to_owned(),
            trace: None,
        };
        let stored = encode(&id, &origin);
        assert_eq!(
            decode(&stored),
            Some(StoredOrigin {
                scope: "app:alice 3:x",
                key: "k:1",
                method: "POST",
                path: "/pay/3:é/4:\u{0}",
            })
        );
        let empty = encode(&id, &Origin::default());
        assert_eq!(decode(&empty).map(|o| (o.method, o.path)), Some(("", "")));
    }

    #[test]
    fn the_parts_are_readable_in_redis_cli() {
        let stored = encode(&id("app:a", "k1"), &Origin::new("POST", "/payments", None));
        assert_eq!(stored, b"5:app:a2:k14:POST9:/payments");
    }

    #[test]
    fn what_is_not_an_origin_does_not_read() {
        for bad in [
            &b""[..],
            b"5:app:a2:k14:POST",
            b"5:app:a2:k14:POST9:/payments!",
            b"5:app:a2:k14:POST99:/payments",
            b"x:app:a2:k14:POST9:/payments",
            b":app:a2:k14:POST9:/payments",
            b"+5:app:a2:k14:POST9:/payments",
            b"2:\xff\xfe2:k14:POST9:/payments",
            b"99999999999999999999999:",
        ] {
            assert_eq!(decode(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
