//! Stored responses: what is kept of a handler's answer (status, an allow-list of headers, the
//! body compressed, or only the head in compact form) and how a replay is rebuilt from it.

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Response, StatusCode};

use crate::codec::{Reader, put_bytes};

/// The header that marks a replayed answer.
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotency-replayed");

/// The headers a stored response keeps. `Set-Cookie` and hop-by-hop headers are never kept, even
/// when configured: a replay must not hand one caller's session to a retry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderAllowList(Vec<HeaderName>);

impl Default for HeaderAllowList {
    fn default() -> Self {
        Self(vec![
            header::CONTENT_TYPE,
            header::LOCATION,
            header::CONTENT_LOCATION,
            header::ETAG,
            header::LINK,
        ])
    }
}

/// The headers that belong to one connection (RFC 9110 §7.6.1): a proxy drops them, and a stored
/// answer never keeps them.
pub const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Never stored, whatever the configuration: one caller's session, the framing of one answer, and
/// the replay marker itself.
fn never_stored(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name) || [header::SET_COOKIE, header::CONTENT_LENGTH, REPLAYED].contains(name)
}

impl HeaderAllowList {
    /// Adds a header to keep; `Set-Cookie`, hop-by-hop headers and `Content-Length` are ignored.
    pub fn with(mut self, name: HeaderName) -> Self {
        if !never_stored(&name) && !self.0.contains(&name) {
            self.0.push(name);
        }
        self
    }

    /// Whether a header is kept.
    pub fn allows(&self, name: &HeaderName) -> bool {
        self.0.contains(name)
    }
}

/// What a replay carries of a handler's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The allowed headers, in their original order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, or `None` in compact form (the body was over `max-stored-body`).
    pub body: Option<Bytes>,
}

/// A stored response that could not be decoded.
#[derive(Debug, thiserror::Error)]
#[error("stored response is corrupt: {0}")]
pub struct ResponseDecodeError(&'static str);

const MAGIC: &[u8; 4] = b"IDR1";
const FLAG_COMPACT: u8 = 1;
const FLAG_ZSTD: u8 = 2;
/// Bodies smaller than this are stored as they are: compressing them saves nothing.
const COMPRESS_FROM: usize = 512;

impl StoredResponse {
    /// Keeps the status, the allowed headers and the body.
    pub fn capture(status: StatusCode, headers: &HeaderMap, allow: &HeaderAllowList, body: Option<Bytes>) -> Self {
        let headers = headers
            .iter()
            .filter(|(name, _)| allow.allows(name))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        Self { status, headers, body }
    }

    /// Whether only the head was kept.
    pub fn is_compact(&self) -> bool {
        self.body.is_none()
    }

    /// Rebuilds the answer for a replay, marked `Idempotency-Replayed: true`.
    ///
    /// A compact response has an empty body; it points at the resource with `Content-Location`
    /// (taken from `Location` when the handler sent none) so that the client can fetch it.
    pub fn to_replay(&self) -> Response<Bytes> {
        let mut response = Response::new(self.body.clone().unwrap_or_default());
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        for (name, value) in &self.headers {
            if self.is_compact() && name == header::CONTENT_TYPE {
                continue;
            }
            headers.append(name.clone(), value.clone());
        }
        if self.is_compact()
            && !headers.contains_key(header::CONTENT_LOCATION)
            && let Some(location) = headers.get(header::LOCATION).cloned()
        {
            headers.insert(header::CONTENT_LOCATION, location);
        }
        headers.insert(REPLAYED, HeaderValue::from_static("true"));
        response
    }

    /// The stored form: magic, flags, status, headers, then the body (zstd-compressed when that helps).
    pub fn encode(&self) -> Vec<u8> {
        let mut flags = 0;
        let mut body: &[u8] = &[];
        let compressed;
        match &self.body {
            None => flags |= FLAG_COMPACT,
            Some(raw) if raw.len() >= COMPRESS_FROM => {
                compressed = zstd::bulk::compress(raw, 3).expect("compressing into a Vec does not fail");
                if compressed.len() < raw.len() {
                    flags |= FLAG_ZSTD;
                    body = &compressed;
                } else {
                    body = raw;
                }
            }
            Some(raw) => body = raw,
        }
        let mut out = Vec::with_capacity(16 + body.len());
        out.extend_from_slice(MAGIC);
        out.push(flags);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        out.extend_from_slice(&(self.headers.len() as u16).to_be_bytes());
        for (name, value) in &self.headers {
            put_bytes(&mut out, name.as_str().as_bytes());
            put_bytes(&mut out, value.as_bytes());
        }
        out.extend_from_slice(body);
        out
    }

    /// Decodes [`StoredResponse::encode`]'s output.
    pub fn decode(bytes: &[u8]) -> Result<Self, ResponseDecodeError> {
        let mut reader = Reader::new(bytes);
        let err = ResponseDecodeError;
        if reader.take(4) != Some(MAGIC.as_slice()) {
            return Err(err("unknown format"));
        }
        let flags = reader.u8().ok_or(err("truncated"))?;
        let status = reader
            .u16()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or(err("bad status"))?;
        let count = reader.u16().ok_or(err("truncated"))?;
        let mut headers = Vec::with_capacity(count.into());
        for _ in 0..count {
            let name = reader
                .bytes()
                .and_then(|n| HeaderName::from_bytes(n).ok())
                .ok_or(err("bad header name"))?;
            let value = reader
                .bytes()
                .and_then(|v| HeaderValue::from_bytes(v).ok())
                .ok_or(err("bad header value"))?;
            headers.push((name, value));
        }
        let rest = reader.rest();
        let body = if flags & FLAG_COMPACT != 0 {
            None
        } else if flags & FLAG_ZSTD != 0 {
            let mut decoder = zstd::stream::Decoder::new(rest).map_err(|_| err("bad compressed body"))?;
            let mut body = Vec::new();
            std::io::Read::read_to_end(&mut decoder, &mut body).map_err(|_| err("bad compressed body"))?;
            Some(Bytes::from(body))
        } else {
            Some(Bytes::copy_from_slice(rest))
        };
        Ok(Self { status, headers, body })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h.insert(header::LOCATION, HeaderValue::from_static("/orders/7"));
        h.insert(header::SET_COOKIE, HeaderValue::from_static("session=secret"));
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        h.insert("x-request-id", HeaderValue::from_static("abc"));
        h
    }

    #[test]
    fn keeps_only_allowed_headers_and_never_cookies() {
        let allow = HeaderAllowList::default()
            .with(header::SET_COOKIE)
            .with(HeaderName::from_static("x-request-id"));
        let stored = StoredResponse::capture(StatusCode::CREATED, &headers(), &allow, Some(Bytes::from_static(b"{}")));
        let names: Vec<_> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "location", "x-request-id"]);
        let replay = stored.to_replay();
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert!(replay.headers().get(header::SET_COOKIE).is_none());
        assert_eq!(replay.headers()[REPLAYED], "true");
        assert_eq!(replay.headers()[header::LOCATION], "/orders/7");
    }

    #[test]
    fn round_trips_small_large_and_compact() {
        let allow = HeaderAllowList::default();
        let large: Bytes = "payment accepted ".repeat(400_000).into();
        for body in [Some(Bytes::from_static(b"ok")), Some(large), Some(Bytes::new()), None] {
            let stored = StoredResponse::capture(StatusCode::OK, &headers(), &allow, body);
            let encoded = stored.encode();
            if stored.body.as_ref().is_some_and(|b| b.len() > 1 << 20) {
                assert!(encoded.len() < 1 << 16, "a repetitive body is compressed");
            }
            assert_eq!(StoredResponse::decode(&encoded).unwrap(), stored);
        }
    }

    #[test]
    fn compact_replays_point_at_the_resource() {
        let stored = StoredResponse::capture(StatusCode::CREATED, &headers(), &HeaderAllowList::default(), None);
        let replay = stored.to_replay();
        assert!(replay.body().is_empty());
        assert_eq!(replay.headers()[header::CONTENT_LOCATION], "/orders/7");
        assert!(replay.headers().get(header::CONTENT_TYPE).is_none());
    }

    #[test]
    fn corrupt_input_is_an_error() {
        assert!(StoredResponse::decode(b"nope").is_err());
        let mut encoded =
            StoredResponse::capture(StatusCode::OK, &headers(), &HeaderAllowList::default(), None).encode();
        encoded.truncate(12);
        assert!(StoredResponse::decode(&encoded).is_err());
    }
}
