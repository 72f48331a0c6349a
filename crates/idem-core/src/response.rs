//! Stored responses: what is kept of a handler's answer (status, an allow-list of headers, the
//! body compressed, or only the head in compact form) and how a replay is rebuilt from it.

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Response, StatusCode};

use crate::content_coding::{self, AcceptEncoding, MAX_DECODED};
use crate::headers::{IDEMPOTENCY_REPLAY, IDEMPOTENCY_REPLAYED};
use crate::length_prefixed::{Reader, put_bytes};

/// The headers a stored response keeps. `Set-Cookie` and hop-by-hop headers are never kept, even
/// when configured: a replay must not hand one caller's session to a retry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderAllowList(Vec<HeaderName>);

impl Default for HeaderAllowList {
    /// [`HeaderAllowList::DESCRIBING_THE_BODY`].
    fn default() -> Self {
        Self(Self::DESCRIBING_THE_BODY.to_vec())
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
/// the replay markers themselves.
fn never_stored(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name)
        || [
            header::SET_COOKIE,
            header::CONTENT_LENGTH,
            IDEMPOTENCY_REPLAYED,
            IDEMPOTENCY_REPLAY,
        ]
        .contains(name)
}

impl HeaderAllowList {
    /// What the default list keeps: the headers that describe the body or point at what the
    /// request made, so a replay reads as the first answer did.
    pub const DESCRIBING_THE_BODY: [HeaderName; 7] = [
        header::CONTENT_TYPE,
        header::CONTENT_ENCODING,
        header::VARY,
        header::LOCATION,
        header::CONTENT_LOCATION,
        header::ETAG,
        header::LINK,
    ];

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
/// The stored form counts headers in a `u16`. A `HeaderMap` holds at most 32 768 entries, so
/// this cuts nothing today; it keeps the count exact whatever builds the response.
const MAX_HEADERS: usize = u16::MAX as usize;
/// The largest body kept whole. No store holds a larger value (PostgreSQL's `bytea` and SQLite's
/// blobs stop at 1 GB, Redis strings at 512 MB), and [`StoredResponse::decode`] refuses to inflate
/// a compressed body past it, so a corrupt record cannot take unbounded memory.
const MAX_BODY: usize = 1 << 30;

impl StoredResponse {
    /// Keeps the status, the allowed headers (at most 65 535) and the body; a body over 1 GiB is
    /// kept compact, since no store could hold it.
    pub fn capture(status: StatusCode, headers: &HeaderMap, allow: &HeaderAllowList, body: Option<Bytes>) -> Self {
        let headers = headers
            .iter()
            .filter(|(name, _)| allow.allows(name))
            .take(MAX_HEADERS)
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        let body = body.filter(|body| body.len() <= MAX_BODY);
        Self { status, headers, body }
    }

    /// Whether only the head was kept.
    pub fn is_compact(&self) -> bool {
        self.body.is_none()
    }

    /// Rebuilds the answer for a replay, marked `Idempotency-Replayed: true`, for a client that
    /// accepts `accept`.
    ///
    /// A body stored in a coding the client does not accept is decoded for it (up to 64 MiB):
    /// `Content-Encoding` goes and a strong `ETag` becomes weak, since these are no longer the
    /// stored bytes. A body that cannot be decoded is replayed as stored, still labelled with its
    /// coding, and a warning is logged.
    ///
    /// A compact response has an empty body and carries `Idempotency-Replay: omitted`, without the
    /// headers that describe body bytes (`Content-Type`, `Content-Encoding`); it points at the
    /// resource with `Content-Location` (taken from `Location` when the handler sent none) so that
    /// the client can fetch it.
    pub fn to_replay(&self, accept: &AcceptEncoding) -> Response<Bytes> {
        let mut headers = HeaderMap::with_capacity(self.headers.len() + 2);
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        let body = match &self.body {
            Some(body) => replay_body(body, &mut headers, accept),
            None => {
                headers.remove(header::CONTENT_TYPE);
                headers.remove(header::CONTENT_ENCODING);
                if !headers.contains_key(header::CONTENT_LOCATION)
                    && let Some(location) = headers.get(header::LOCATION).cloned()
                {
                    headers.insert(header::CONTENT_LOCATION, location);
                }
                headers.insert(IDEMPOTENCY_REPLAY, HeaderValue::from_static("omitted"));
                Bytes::new()
            }
        };
        headers.insert(IDEMPOTENCY_REPLAYED, HeaderValue::from_static("true"));
        let mut response = Response::new(body);
        *response.status_mut() = self.status;
        *response.headers_mut() = headers;
        response
    }

    /// The stored form: magic, flags, status, headers, then the body (zstd-compressed when that helps).
    ///
    /// Only the first 65 535 headers are written, as [`StoredResponse::capture`] keeps.
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
        let headers = &self.headers[..self.headers.len().min(MAX_HEADERS)];
        let count = u16::try_from(headers.len()).expect("at most MAX_HEADERS headers");
        out.extend_from_slice(&count.to_be_bytes());
        for (name, value) in headers {
            put_bytes(&mut out, name.as_str().as_bytes());
            put_bytes(&mut out, value.as_bytes());
        }
        out.extend_from_slice(body);
        out
    }

    /// Decodes [`StoredResponse::encode`]'s output; any other input is an error, never a panic.
    ///
    /// `decode(encode(r)) == r` for every `r` that [`StoredResponse::capture`] returns.
    pub fn decode(bytes: &[u8]) -> Result<Self, ResponseDecodeError> {
        Self::decode_with_limit(bytes, MAX_BODY)
    }

    fn decode_with_limit(bytes: &[u8], max_body: usize) -> Result<Self, ResponseDecodeError> {
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
        // Each header takes at least 8 bytes (two lengths): a corrupt count cannot reserve more.
        let mut headers = Vec::with_capacity(usize::from(count).min(bytes.len() / 8));
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
            let decoder = zstd::stream::Decoder::with_buffer(rest).map_err(|_| err("bad compressed body"))?;
            let mut body = Vec::new();
            // One byte past the limit tells "exactly the limit" from "more".
            std::io::Read::read_to_end(&mut std::io::Read::take(decoder, max_body as u64 + 1), &mut body)
                .map_err(|_| err("bad compressed body"))?;
            if body.len() > max_body {
                return Err(err("compressed body too large"));
            }
            Some(Bytes::from(body))
        } else {
            Some(Bytes::copy_from_slice(rest))
        };
        Ok(Self { status, headers, body })
    }
}

/// The body of a full replay, decoded when the client does not accept its codings (adjusting
/// `headers` to match).
fn replay_body(body: &Bytes, headers: &mut HeaderMap, accept: &AcceptEncoding) -> Bytes {
    let codings = content_coding::content_codings(headers);
    if accept.accepts_all(&codings) {
        return body.clone();
    }
    match content_coding::decode(&codings, body, MAX_DECODED) {
        Ok(decoded) => {
            headers.remove(header::CONTENT_ENCODING);
            weaken_etags(headers);
            Bytes::from(decoded)
        }
        Err(error) => {
            // Still truthful: the bytes are labelled with their coding, which the client may refuse.
            tracing::warn!(%error, ?codings, "a stored answer cannot be decoded for a client that does not accept its coding; replaying it as stored");
            body.clone()
        }
    }
}

/// A strong validator promises these exact bytes (RFC 9110 §8.8.1); a decoded body is another
/// representation, only semantically equivalent, which is what a weak one says.
fn weaken_etags(headers: &mut HeaderMap) {
    let tags: Vec<HeaderValue> = headers
        .get_all(header::ETAG)
        .iter()
        .map(|tag| {
            if tag.as_bytes().starts_with(b"W/") {
                tag.clone()
            } else {
                HeaderValue::from_bytes(&[b"W/", tag.as_bytes()].concat()).expect("W/ and a valid value is valid")
            }
        })
        .collect();
    headers.remove(header::ETAG);
    for tag in tags {
        headers.append(header::ETAG, tag);
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

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

    fn identity_only() -> AcceptEncoding {
        AcceptEncoding::default()
    }

    fn accepting(value: &'static str) -> AcceptEncoding {
        let mut h = HeaderMap::new();
        h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static(value));
        AcceptEncoding::from_headers(&h)
    }

    fn gzip(data: &[u8]) -> Bytes {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap().into()
    }

    /// A stored answer whose body is `body`, labelled `Content-Encoding: coding`, with a strong ETag.
    fn encoded(coding: &'static str, body: Bytes) -> StoredResponse {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static(coding));
        h.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
        h.insert(header::ETAG, HeaderValue::from_static("\"v1\""));
        StoredResponse::capture(StatusCode::OK, &h, &HeaderAllowList::default(), Some(body))
    }

    #[test]
    fn keeps_only_allowed_headers_and_never_cookies() {
        let allow = HeaderAllowList::default()
            .with(header::SET_COOKIE)
            .with(IDEMPOTENCY_REPLAY)
            .with(HeaderName::from_static("x-request-id"));
        let stored = StoredResponse::capture(StatusCode::CREATED, &headers(), &allow, Some(Bytes::from_static(b"{}")));
        let names: Vec<_> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "location", "x-request-id"]);
        let replay = stored.to_replay(&identity_only());
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert!(replay.headers().get(header::SET_COOKIE).is_none());
        assert_eq!(replay.headers()[IDEMPOTENCY_REPLAYED], "true");
        assert!(
            replay.headers().get(IDEMPOTENCY_REPLAY).is_none(),
            "a whole answer is not marked omitted"
        );
        assert_eq!(replay.headers()[header::LOCATION], "/orders/7");
    }

    #[test]
    fn the_default_allow_list_keeps_what_describes_the_body() {
        let allow = HeaderAllowList::default();
        for name in HeaderAllowList::DESCRIBING_THE_BODY {
            assert!(allow.allows(&name), "{name}");
        }
        for name in [header::DATE, header::SERVER, header::SET_COOKIE, header::CONTENT_LENGTH] {
            assert!(!allow.allows(&name), "{name} describes one answer, not the body");
        }
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
    fn compact_replays_say_the_body_was_omitted_and_point_at_the_resource() {
        let mut h = headers();
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        h.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
        h.insert(header::ETAG, HeaderValue::from_static("\"v1\""));
        let stored = StoredResponse::capture(StatusCode::CREATED, &h, &HeaderAllowList::default(), None);
        let replay = stored.to_replay(&accepting("gzip"));
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert!(replay.body().is_empty());
        assert_eq!(replay.headers()[IDEMPOTENCY_REPLAY], "omitted");
        assert_eq!(replay.headers()[IDEMPOTENCY_REPLAYED], "true");
        assert_eq!(replay.headers()[header::CONTENT_LOCATION], "/orders/7");
        assert_eq!(replay.headers()[header::LOCATION], "/orders/7");
        assert_eq!(replay.headers()[header::VARY], "Accept-Encoding");
        assert_eq!(replay.headers()[header::ETAG], "\"v1\"");
        assert!(replay.headers().get(header::CONTENT_TYPE).is_none());
        assert!(replay.headers().get(header::CONTENT_ENCODING).is_none());
    }

    #[test]
    fn compact_replays_without_a_location_are_still_marked() {
        let stored = StoredResponse::capture(StatusCode::OK, &HeaderMap::new(), &HeaderAllowList::default(), None);
        let replay = stored.to_replay(&identity_only());
        assert_eq!(replay.headers()[IDEMPOTENCY_REPLAY], "omitted");
        assert!(replay.headers().get(header::CONTENT_LOCATION).is_none());
    }

    #[test]
    fn an_encoded_answer_is_decoded_for_a_client_that_does_not_accept_it() {
        let json = br#"{"charge":1}"#.repeat(100);
        let stored = encoded("gzip", gzip(&json));
        for accept in [identity_only(), accepting("br, zstd"), accepting("gzip;q=0, *")] {
            let replay = stored.to_replay(&accept);
            assert_eq!(replay.body().as_ref(), json.as_slice(), "{accept:?}");
            assert!(replay.headers().get(header::CONTENT_ENCODING).is_none());
            assert_eq!(
                replay.headers()[header::ETAG],
                "W/\"v1\"",
                "the decoded body is another representation"
            );
            assert_eq!(replay.headers()[header::CONTENT_TYPE], "application/json");
            assert_eq!(replay.headers()[header::VARY], "Accept-Encoding");
        }
    }

    #[test]
    fn an_encoded_answer_is_replayed_as_stored_to_a_client_that_accepts_it() {
        let body = gzip(b"{}");
        let stored = encoded("gzip", body.clone());
        for accept in [accepting("gzip"), accepting("x-gzip;q=0.1"), accepting("*")] {
            let replay = stored.to_replay(&accept);
            assert_eq!(replay.body(), &body);
            assert_eq!(replay.headers()[header::CONTENT_ENCODING], "gzip");
            assert_eq!(replay.headers()[header::ETAG], "\"v1\"");
        }
    }

    #[test]
    fn several_codings_are_all_undone_unless_all_are_accepted() {
        let mut br = Vec::new();
        let mut encoder = brotli::CompressorWriter::new(&mut br, 4096, 5, 22);
        encoder.write_all(&gzip(b"layers")).unwrap();
        drop(encoder);
        let stored = encoded("gzip, br", br.clone().into());
        let replay = stored.to_replay(&accepting("gzip"));
        assert_eq!(replay.body().as_ref(), b"layers");
        assert!(replay.headers().get(header::CONTENT_ENCODING).is_none());
        let replay = stored.to_replay(&accepting("br, gzip"));
        assert_eq!(replay.body().as_ref(), br.as_slice());
        assert_eq!(replay.headers()[header::CONTENT_ENCODING], "gzip, br");
    }

    #[test]
    fn an_undecodable_answer_is_replayed_as_stored_and_labelled() {
        let mut corrupt = gzip(&[7; 5000]).to_vec();
        corrupt.truncate(corrupt.len() / 2);
        for (coding, body) in [
            ("compress", Bytes::from_static(b"\x1f\x9d...")),
            ("gzip", corrupt.into()),
        ] {
            let replay = encoded(coding, body.clone()).to_replay(&identity_only());
            assert_eq!(replay.body(), &body, "{coding}");
            assert_eq!(replay.headers()[header::CONTENT_ENCODING], coding);
            assert_eq!(replay.headers()[header::ETAG], "\"v1\"");
        }
    }

    #[test]
    fn a_decompression_bomb_is_replayed_as_stored() {
        let bomb = gzip(&vec![0; MAX_DECODED + 1]);
        let replay = encoded("gzip", bomb.clone()).to_replay(&identity_only());
        assert_eq!(replay.body(), &bomb);
        assert_eq!(replay.headers()[header::CONTENT_ENCODING], "gzip");
    }

    #[test]
    fn corrupt_input_is_an_error() {
        assert!(StoredResponse::decode(b"nope").is_err());
        let mut encoded =
            StoredResponse::capture(StatusCode::OK, &headers(), &HeaderAllowList::default(), None).encode();
        encoded.truncate(12);
        assert!(StoredResponse::decode(&encoded).is_err());
    }

    #[test]
    fn a_compressed_body_is_inflated_only_up_to_the_limit() {
        let stored = StoredResponse {
            status: StatusCode::OK,
            headers: Vec::new(),
            body: Some(vec![b'a'; 10_000].into()),
        };
        let encoded = stored.encode();
        assert_eq!(StoredResponse::decode_with_limit(&encoded, 10_000).unwrap(), stored);
        assert!(StoredResponse::decode_with_limit(&encoded, 9_999).is_err());
    }

    #[test]
    fn the_header_count_never_wraps() {
        let name = HeaderName::from_static("x-many");
        let stored = StoredResponse {
            status: StatusCode::OK,
            headers: vec![(name.clone(), HeaderValue::from_static("1")); MAX_HEADERS + 5],
            body: Some(Bytes::from_static(b"body")),
        };
        let decoded = StoredResponse::decode(&stored.encode()).unwrap();
        assert_eq!(decoded.headers.len(), MAX_HEADERS);
        assert_eq!(decoded.body, stored.body, "the body is not read as headers");
    }
}
