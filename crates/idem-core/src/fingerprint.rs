//! Request fingerprints: a SHA-256 over an unambiguous, length-prefixed encoding of method, path,
//! query and body, with JSON bodies canonicalised first (RFC 8785 with exact numbers; a body that is
//! not I-JSON is hashed as raw bytes).

use std::fmt;

use http::{HeaderMap, Method, header::CONTENT_TYPE};
use sha2::{Digest, Sha256};

use crate::{canonical_json::canonicalise, scope::hex};

/// What identifies "the same request" for one key.
///
/// Besides the overall digest it keeps the method and path in clear text and a digest of each other
/// part, so that a mismatch can say what differs.
#[derive(Clone, PartialEq, Eq)]
pub struct Fingerprint {
    digest: [u8; 32],
    method: String,
    path: String,
    query: [u8; 32],
    body: [u8; 32],
}

/// The parts of two requests under one key that differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Differences {
    /// The methods differ.
    pub method: bool,
    /// The paths differ.
    pub path: bool,
    /// The query strings differ.
    pub query: bool,
    /// The bodies differ.
    pub body: bool,
}

/// A stored fingerprint that could not be decoded.
#[derive(Debug, thiserror::Error)]
#[error("stored fingerprint is corrupt")]
pub struct FingerprintDecodeError;

const VERSION: u8 = 1;

impl Fingerprint {
    /// Fingerprints a request from its head and (whole) body.
    pub fn of(method: &Method, uri: &http::Uri, headers: &HeaderMap, body: &[u8]) -> Self {
        let path = uri.path();
        let query = uri.query().unwrap_or("");
        let canonical = if is_json(headers) { canonicalise(body) } else { None };
        let (body_kind, body_bytes): (&[u8], &[u8]) = match &canonical {
            Some(json) => (b"json", json),
            None => (b"bytes", body),
        };
        let mut all = Sha256::new();
        for part in [
            b"idem-fingerprint-v1".as_slice(),
            method.as_str().as_bytes(),
            path.as_bytes(),
            query.as_bytes(),
            body_kind,
            body_bytes,
        ] {
            all.update((part.len() as u64).to_be_bytes());
            all.update(part);
        }
        let mut body_digest = Sha256::new();
        body_digest.update(body_kind);
        body_digest.update(body_bytes);
        Self {
            digest: all.finalize().into(),
            method: method.as_str().to_owned(),
            path: path.to_owned(),
            query: Sha256::digest(query.as_bytes()).into(),
            body: body_digest.finalize().into(),
        }
    }

    /// The SHA-256 that decides equality; stores compare this.
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// The request method, in clear text.
    pub fn method(&self) -> &str {
        &self.method
    }

    /// The request path, in clear text.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Which parts of `other` differ from this one.
    pub fn differences(&self, other: &Self) -> Differences {
        Differences {
            method: self.method != other.method,
            path: self.path != other.path,
            query: self.query != other.query,
            body: self.body != other.body,
        }
    }

    /// The stored form: version, digests, then method and path, each length-prefixed.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + 96 + 8 + self.method.len() + self.path.len());
        out.push(VERSION);
        out.extend_from_slice(&self.digest);
        out.extend_from_slice(&self.query);
        out.extend_from_slice(&self.body);
        for text in [&self.method, &self.path] {
            out.extend_from_slice(&(text.len() as u32).to_be_bytes());
            out.extend_from_slice(text.as_bytes());
        }
        out
    }

    /// Decodes [`Fingerprint::encode`]'s output.
    pub fn decode(bytes: &[u8]) -> Result<Self, FingerprintDecodeError> {
        let mut reader = crate::length_prefixed::Reader::new(bytes);
        let decoded = (|| {
            if reader.u8()? != VERSION {
                return None;
            }
            let digest = reader.array::<32>()?;
            let query = reader.array::<32>()?;
            let body = reader.array::<32>()?;
            let method = reader.string()?;
            let path = reader.string()?;
            reader.finished().then_some(Self {
                digest,
                method,
                path,
                query,
                body,
            })
        })();
        decoded.ok_or(FingerprintDecodeError)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Fingerprint({} {} {})",
            self.method,
            self.path,
            &hex(&self.digest)[..16]
        )
    }
}

impl Differences {
    /// Whether anything differs.
    pub fn any(&self) -> bool {
        self.method || self.path || self.query || self.body
    }

    /// The names of the differing parts, such as `"query and body"`.
    pub fn describe(&self) -> String {
        let names: Vec<&str> = [
            (self.method, "method"),
            (self.path, "path"),
            (self.query, "query string"),
            (self.body, "body"),
        ]
        .into_iter()
        .filter_map(|(differs, name)| differs.then_some(name))
        .collect();
        match names.as_slice() {
            [] => "nothing".to_owned(),
            [one] => (*one).to_owned(),
            [init @ .., last] => format!("{} and {last}", init.join(", ")),
        }
    }
}

/// Whether the body is JSON by its one `Content-Type`. A repeated `Content-Type` names no type:
/// which copy a server believes is its own choice (the first, the last, or a refusal), so the body
/// is compared byte for byte, as any body that is not JSON is.
fn is_json(headers: &HeaderMap) -> bool {
    let mut types = headers.get_all(CONTENT_TYPE).iter();
    let (Some(value), None) = (types.next().and_then(|v| v.to_str().ok()), types.next()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(method: &str, uri: &str, content_type: Option<&str>, body: &str) -> Fingerprint {
        let mut headers = HeaderMap::new();
        if let Some(ct) = content_type {
            headers.insert(CONTENT_TYPE, ct.parse().unwrap());
        }
        Fingerprint::of(
            &method.parse().unwrap(),
            &uri.parse().unwrap(),
            &headers,
            body.as_bytes(),
        )
    }

    #[test]
    fn json_key_order_and_whitespace_do_not_count() {
        let a = fp(
            "POST",
            "/pay",
            Some("application/json"),
            r#"{"amount": 10, "currency":"EUR"}"#,
        );
        let b = fp(
            "POST",
            "/pay",
            Some("application/json; charset=utf-8"),
            "{\"currency\":\"EUR\",\n \"amount\":10}",
        );
        assert_eq!(a, b);
        let c = fp(
            "POST",
            "/pay",
            Some("application/vnd.api+json"),
            r#"{"currency":"EUR","amount":10}"#,
        );
        assert_eq!(a.digest(), c.digest());
    }

    #[test]
    fn a_repeated_content_type_compares_the_body_byte_for_byte() {
        let twice = |first: &str, second: &str, body: &str| {
            let mut headers = HeaderMap::new();
            headers.append(CONTENT_TYPE, first.parse().unwrap());
            headers.append(CONTENT_TYPE, second.parse().unwrap());
            Fingerprint::of(&http::Method::POST, &"/pay".parse().unwrap(), &headers, body.as_bytes())
        };
        // A server that believes the last copy reads these as two different texts.
        let a = twice("application/json", "text/plain", r#"{"a":1}"#);
        let b = twice("application/json", "text/plain", r#"{"a": 1}"#);
        assert_ne!(a.digest(), b.digest());
        assert_eq!(a.differences(&b).describe(), "body");
        assert_eq!(
            a,
            twice("application/json", "text/plain", r#"{"a":1}"#),
            "the same bytes are the same request"
        );
        assert_eq!(
            twice("text/plain", "application/json", r#"{"a":1}"#).digest(),
            a.digest(),
            "in either order"
        );
    }

    #[test]
    fn each_part_counts_and_is_named() {
        let base = fp("POST", "/pay?x=1", Some("application/json"), r#"{"amount":10}"#);
        let body = fp("POST", "/pay?x=1", Some("application/json"), r#"{"amount":11}"#);
        let query = fp("POST", "/pay?x=2", Some("application/json"), r#"{"amount":10}"#);
        let path = fp("POST", "/refund?x=1", Some("application/json"), r#"{"amount":10}"#);
        let method = fp("PATCH", "/pay?x=1", Some("application/json"), r#"{"amount":10}"#);
        for (other, name) in [
            (&body, "body"),
            (&query, "query string"),
            (&path, "path"),
            (&method, "method"),
        ] {
            assert_ne!(base.digest(), other.digest());
            assert_eq!(base.differences(other).describe(), name);
        }
        assert_eq!(
            base.differences(&fp("PUT", "/x", None, "")).describe(),
            "method, path, query string and body"
        );
    }

    #[test]
    fn the_encoding_is_unambiguous() {
        // Without length prefixes these two would hash the same bytes.
        assert_ne!(
            fp("POST", "/ab", None, "c").digest(),
            fp("POST", "/a", None, "bc").digest()
        );
        assert_ne!(
            fp("POST", "/a?b", None, "").digest(),
            fp("POST", "/a", None, "b").digest()
        );
    }

    #[test]
    fn invalid_json_is_hashed_as_bytes() {
        let a = fp("POST", "/pay", Some("application/json"), "{not json");
        let b = fp("POST", "/pay", Some("application/json"), "{not  json");
        assert_ne!(a.digest(), b.digest());
        assert_eq!(a, fp("POST", "/pay", Some("application/json"), "{not json"));
    }

    #[test]
    fn non_json_bodies_are_exact() {
        let a = fp("POST", "/pay", Some("text/plain"), r#"{"a":1,"b":2}"#);
        let b = fp("POST", "/pay", Some("text/plain"), r#"{"b":2,"a":1}"#);
        assert_ne!(a.digest(), b.digest());
    }

    #[test]
    fn encoding_round_trips() {
        let a = fp("POST", "/pay?x=1", Some("application/json"), r#"{"amount":10}"#);
        assert_eq!(Fingerprint::decode(&a.encode()).unwrap(), a);
        assert!(Fingerprint::decode(&a.encode()[..40]).is_err());
    }
}
