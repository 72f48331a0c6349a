//! Properties of stored answers, through the public API: the stored form reads back exactly what was
//! written and never panics on anything else; `Accept-Encoding` never panics; and a replay is the
//! stored bytes for a client that accepts their coding, the decoded bytes for one that does not.

use std::io::Write;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, StatusCode};
use idem_core::{HeaderAllowList, IDEMPOTENCY_REPLAY, IDEMPOTENCY_REPLAYED, StoredResponse, protocol::AcceptEncoding};
use proptest::prelude::*;
use proptest::sample::Index;

fn status() -> impl Strategy<Value = StatusCode> {
    (100u16..=999).prop_map(|code| StatusCode::from_u16(code).expect("100..=999 is a status"))
}

fn header_name() -> impl Strategy<Value = HeaderName> {
    prop_oneof![
        prop::sample::select(HeaderAllowList::DESCRIBING_THE_BODY.to_vec()),
        // Any token, in any case: a `HeaderName` keeps it lowercase.
        "[A-Za-z0-9!#$%&'*+.^_`|~-]{1,40}"
            .prop_map(|name| HeaderName::from_bytes(name.as_bytes()).expect("a token is a header name")),
    ]
}

/// Every byte a `HeaderValue` may hold: visible ASCII, space, tab and obs-text.
fn header_value() -> impl Strategy<Value = HeaderValue> {
    prop::collection::vec(prop_oneof![Just(b'\t'), 0x20u8..0x7f, 0x80u8..=0xff], 0..60)
        .prop_map(|bytes| HeaderValue::from_bytes(&bytes).expect("only allowed bytes"))
}

/// Empty, small, large and random, or large and compressible (stored compressed).
fn body_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        prop::collection::vec(any::<u8>(), 1..600),
        prop::collection::vec(any::<u8>(), 600..40_000),
        (prop::collection::vec(any::<u8>(), 1..40), 20usize..8_000).prop_map(|(unit, n)| unit.repeat(n)),
    ]
}

fn stored_response() -> impl Strategy<Value = StoredResponse> {
    (
        status(),
        prop::collection::vec((header_name(), header_value()), 0..12),
        prop::option::weighted(0.8, body_bytes()),
    )
        .prop_map(|(status, headers, body)| StoredResponse {
            status,
            headers,
            body: body.map(Bytes::from),
        })
}

fn encoded_response() -> impl Strategy<Value = Vec<u8>> {
    stored_response().prop_map(|stored| stored.encode())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn decode_never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..2_000)) {
        let _ = StoredResponse::decode(&bytes);
    }

    #[test]
    fn decode_never_panics_past_the_magic(flags: u8, rest in prop::collection::vec(any::<u8>(), 0..2_000)) {
        let mut bytes = b"IDR1".to_vec();
        bytes.push(flags);
        bytes.extend_from_slice(&rest);
        let _ = StoredResponse::decode(&bytes);
    }

    #[test]
    fn decode_never_panics_on_mutated_records(
        encoded in encoded_response(),
        flips in prop::collection::vec((any::<Index>(), any::<u8>()), 1..8),
        cut: Index,
        junk in prop::collection::vec(any::<u8>(), 1..64),
    ) {
        let mut flipped = encoded.clone();
        for (at, mask) in flips {
            flipped[at.index(encoded.len())] ^= mask;
        }
        let _ = StoredResponse::decode(&flipped);

        let truncated = &encoded[..cut.index(encoded.len())];
        let _ = StoredResponse::decode(truncated);

        let mut appended = encoded.clone();
        appended.extend_from_slice(&junk);
        let _ = StoredResponse::decode(&appended);
    }

    #[test]
    fn encode_then_decode_is_identity(stored in stored_response()) {
        prop_assert_eq!(StoredResponse::decode(&stored.encode()).unwrap(), stored);
    }

    #[test]
    fn capture_then_encode_then_decode_is_identity(
        status in status(),
        headers in prop::collection::vec((header_name(), header_value()), 0..12),
        body in prop::option::of(body_bytes()),
    ) {
        let mut map = HeaderMap::new();
        let mut allow = HeaderAllowList::default();
        for (name, value) in headers {
            allow = allow.with(name.clone());
            map.append(name, value);
        }
        let stored = StoredResponse::capture(status, &map, &allow, body.map(Bytes::from));
        prop_assert_eq!(StoredResponse::decode(&stored.encode()).unwrap(), stored);
    }

    #[test]
    fn accept_encoding_never_panics(
        values in prop::collection::vec(
            prop_oneof![
                prop::collection::vec(prop_oneof![Just(b'\t'), 0x20u8..0x7f, 0x80u8..=0xff], 0..80),
                "((gzip|x-gzip|deflate|br|zstd|identity|\\*|[a-z]{1,5})( ?; ?[qQ] ?= ?[0-9.]{0,6})?[, ]{0,3}){0,6}"
                    .prop_map(String::into_bytes),
            ],
            0..4,
        ),
        coding in "[a-zA-Z*-]{0,10}",
    ) {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(header::ACCEPT_ENCODING, HeaderValue::from_bytes(&value).expect("only allowed bytes"));
        }
        let accept = AcceptEncoding::from_headers(&headers);
        let _ = accept.accepts(&coding);
        prop_assert!(accept.accepts("identity"), "a stored answer can always be decoded");
    }
}

/// The codings idem decodes, and how a server would produce each.
#[derive(Debug, Clone, Copy)]
enum Coding {
    Gzip,
    /// zlib, as RFC 9110 defines `deflate`.
    Zlib,
    /// Raw deflate, as some servers send under `deflate`.
    RawDeflate,
    Br,
    Zstd,
}

impl Coding {
    const ALL: [Self; 5] = [Self::Gzip, Self::Zlib, Self::RawDeflate, Self::Br, Self::Zstd];

    fn name(self) -> &'static str {
        match self {
            Self::Gzip => "gzip",
            Self::Zlib | Self::RawDeflate => "deflate",
            Self::Br => "br",
            Self::Zstd => "zstd",
        }
    }

    fn encode(self, data: &[u8]) -> Vec<u8> {
        let level = flate2::Compression::fast();
        match self {
            Self::Gzip => finish(flate2::write::GzEncoder::new(Vec::new(), level), data, |e| e.finish()),
            Self::Zlib => finish(flate2::write::ZlibEncoder::new(Vec::new(), level), data, |e| e.finish()),
            Self::RawDeflate => finish(flate2::write::DeflateEncoder::new(Vec::new(), level), data, |e| {
                e.finish()
            }),
            Self::Br => finish(brotli::CompressorWriter::new(Vec::new(), 4096, 3, 22), data, |e| {
                Ok(e.into_inner())
            }),
            Self::Zstd => zstd::bulk::compress(data, 3).expect("zstd compresses"),
        }
    }
}

fn finish<W: Write>(mut writer: W, data: &[u8], done: impl FnOnce(W) -> std::io::Result<Vec<u8>>) -> Vec<u8> {
    writer.write_all(data).expect("encoding into memory");
    done(writer).expect("encoding into memory")
}

fn accept(value: &str) -> AcceptEncoding {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_str(value).expect("a valid value"),
    );
    AcceptEncoding::from_headers(&headers)
}

/// A stored answer as the gateway keeps it: through `capture`, `encode` and `decode`.
fn stored(coding: Coding, encoded: &[u8]) -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static(coding.name()));
    headers.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    let captured = StoredResponse::capture(
        StatusCode::CREATED,
        &headers,
        &HeaderAllowList::default(),
        Some(Bytes::copy_from_slice(encoded)),
    );
    StoredResponse::decode(&captured.encode()).expect("a stored answer reads back")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn a_client_that_does_not_accept_the_coding_gets_the_original_bytes(data in body_bytes()) {
        for coding in Coding::ALL {
            let encoded = coding.encode(&data);
            let stored = stored(coding, &encoded);
            let others = ["gzip", "deflate", "br", "zstd"].iter().filter(|c| **c != coding.name()).copied();
            let refusing = [
                AcceptEncoding::default(),
                accept("identity"),
                accept(&others.collect::<Vec<_>>().join(", ")),
                accept(&format!("*, {};q=0", coding.name())),
            ];
            for client in refusing {
                let replay = stored.to_replay(&client);
                prop_assert_eq!(replay.body().as_ref(), data.as_slice(), "{:?} for {:?}", coding, client);
                prop_assert!(replay.headers().get(header::CONTENT_ENCODING).is_none());
                prop_assert_eq!(&replay.headers()[IDEMPOTENCY_REPLAYED], "true");
                prop_assert!(replay.headers().get(IDEMPOTENCY_REPLAY).is_none());
                prop_assert_eq!(replay.status(), StatusCode::CREATED);
            }
        }
    }

    #[test]
    fn a_client_that_accepts_the_coding_gets_the_stored_bytes(data in body_bytes()) {
        for coding in Coding::ALL {
            let encoded = coding.encode(&data);
            let stored = stored(coding, &encoded);
            for client in [accept(coding.name()), accept("*"), accept(&format!("identity;q=0, {};q=0.5", coding.name()))] {
                let replay = stored.to_replay(&client);
                prop_assert_eq!(replay.body().as_ref(), encoded.as_slice(), "{:?} for {:?}", coding, client);
                prop_assert_eq!(&replay.headers()[header::CONTENT_ENCODING], coding.name());
                prop_assert_eq!(&replay.headers()[IDEMPOTENCY_REPLAYED], "true");
            }
        }
    }
}
