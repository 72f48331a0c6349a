//! What a replay through the gateway (`idem serve`) carries: a body that decodes as its headers
//! say, decoded for a retry whose `Accept-Encoding` refuses the stored coding, and a compact
//! replay that says its body was omitted.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::Response;
use axum::routing::post;
use common::{Gateway, REQUEST_TIMEOUT, Reply, count, new_key, send};
use idem_test_support::task::AbortOnDrop;
use tokio::net::TcpListener;

const REQUEST_BODY: &str = r#"{"amount":1000,"currency":"EUR"}"#;

/// The upstream's JSON answer: long and repetitive enough that every coding shrinks it.
fn answer_json() -> String {
    let items: Vec<String> = (0..40)
        .map(|i| format!(r#"{{"line":{i},"sku":"sku-{i}","status":"accepted"}}"#))
        .collect();
    format!(r#"{{"charge":1,"items":[{}]}}"#, items.join(","))
}

/// The codings the upstream can answer in, named as in its `coding` query parameter.
fn encode(coding: &str, data: &[u8]) -> Vec<u8> {
    fn finish<W: Write>(mut writer: W, data: &[u8], done: impl FnOnce(W) -> std::io::Result<Vec<u8>>) -> Vec<u8> {
        writer.write_all(data).expect("encoding into memory");
        done(writer).expect("encoding into memory")
    }
    let level = flate2::Compression::default();
    match coding {
        "gzip" => finish(flate2::write::GzEncoder::new(Vec::new(), level), data, |e| e.finish()),
        "deflate" => finish(flate2::write::ZlibEncoder::new(Vec::new(), level), data, |e| e.finish()),
        "deflate-raw" => finish(flate2::write::DeflateEncoder::new(Vec::new(), level), data, |e| {
            e.finish()
        }),
        "br" => finish(brotli::CompressorWriter::new(Vec::new(), 4096, 5, 22), data, |e| {
            Ok(e.into_inner())
        }),
        "zstd" => zstd::bulk::compress(data, 3).expect("zstd compresses"),
        other => panic!("no coding {other}"),
    }
}

/// Undoes `encode`, independently of the gateway's decoder.
fn decode(coding: &str, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let result = match coding {
        "gzip" => flate2::read::GzDecoder::new(data).read_to_end(&mut out),
        "deflate" => flate2::read::ZlibDecoder::new(data).read_to_end(&mut out),
        "deflate-raw" => flate2::read::DeflateDecoder::new(data).read_to_end(&mut out),
        "br" => brotli::Decompressor::new(data, 4096).read_to_end(&mut out),
        "zstd" => zstd::stream::read::Decoder::new(data).and_then(|mut d| d.read_to_end(&mut out)),
        other => panic!("no coding {other}"),
    };
    result.unwrap_or_else(|err| panic!("the body is not valid {coding}: {err}"));
    out
}

/// The `Content-Encoding` name of a coding (raw deflate is sent as `deflate`, as servers do).
fn label(coding: &str) -> &str {
    if coding == "deflate-raw" { "deflate" } else { coding }
}

#[derive(Debug, Default)]
struct Calls {
    encoded: AtomicUsize,
    large: AtomicUsize,
}

/// An upstream on 127.0.0.1 that answers:
/// * `POST /encoded?coding=gzip|deflate|deflate-raw|br|zstd`: 201 with [`answer_json`] in that
///   coding, `Content-Encoding`, `Vary: Accept-Encoding` and a strong `ETag`;
/// * `POST /large?size=N[&location=1]`: 201 with an N-byte JSON-ish body, and a `Location` if asked.
///
/// Stops when dropped.
struct Upstream {
    url: String,
    calls: Arc<Calls>,
    _task: AbortOnDrop,
}

type Params = Query<HashMap<String, String>>;

impl Upstream {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the upstream");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let calls = Arc::new(Calls::default());
        let app = Router::new()
            .route("/encoded", post(encoded))
            .route("/large", post(large))
            .with_state(calls.clone());
        let _task = AbortOnDrop::serve(listener, app);
        Self { url, calls, _task }
    }
}

async fn encoded(State(calls): State<Arc<Calls>>, Query(params): Params) -> Response {
    calls.encoded.fetch_add(1, Ordering::SeqCst);
    let coding = params.get("coding").map_or("gzip", String::as_str);
    Response::builder()
        .status(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_ENCODING, label(coding))
        .header(header::VARY, "Accept-Encoding")
        .header(header::ETAG, "\"charge-1\"")
        .body(Body::from(encode(coding, answer_json().as_bytes())))
        .unwrap()
}

async fn large(State(calls): State<Arc<Calls>>, Query(params): Params) -> Response {
    let n = calls.large.fetch_add(1, Ordering::SeqCst) + 1;
    let size: usize = params.get("size").and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let mut response = Response::builder()
        .status(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json");
    if params.contains_key("location") {
        response = response.header(header::LOCATION, format!("/reports/{n}"));
    }
    response.body(Body::from(vec![b'7'; size])).unwrap()
}

/// A client that never decompresses by itself (so the bytes on the wire are what the test sees)
/// and never uses a proxy.
fn raw_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .no_gzip()
        .no_brotli()
        .no_deflate()
        .no_zstd()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .expect("a reqwest client")
}

/// A keyed POST of [`REQUEST_BODY`] to `path`, with `Accept-Encoding: accept` if given.
async fn send_keyed(gw: &Gateway, path: &str, key: &str, accept: Option<&str>) -> Reply {
    let mut request = raw_client()
        .post(gw.url(path))
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(REQUEST_BODY);
    if let Some(accept) = accept {
        request = request.header("accept-encoding", accept);
    }
    send(request).await
}

/// The first client accepts `coding` and gets it; a retry that does not accept it gets the plain
/// JSON; one that does gets the stored bytes, labelled. The upstream runs once.
async fn check_coding(coding: &str) {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url, &[]).await;
    let key = new_key();
    let path = format!("/encoded?coding={coding}");
    let name = label(coding);
    let json = answer_json();

    let first = send_keyed(&gw, &path, &key, Some(name)).await;
    assert_eq!(first.status, 201, "{first}");
    assert!(!first.replayed(), "{first}");
    assert_eq!(first.header("content-encoding").as_deref(), Some(name), "{first}");
    assert_eq!(
        decode(coding, &first.body),
        json.as_bytes(),
        "the live answer is the upstream's"
    );

    let all_but_this = format!("{name};q=0, *");
    for refusing in [None, Some("identity"), Some("*;q=0"), Some(all_but_this.as_str())] {
        let retry = send_keyed(&gw, &path, &key, refusing).await;
        assert_eq!(retry.status, 201, "{retry}");
        assert!(retry.replayed(), "{retry}");
        assert_eq!(
            retry.text(),
            json,
            "a retry with Accept-Encoding {refusing:?} gets the decoded JSON, not {name} bytes: {retry}"
        );
        assert_eq!(retry.header("content-encoding"), None, "{retry}");
        assert_eq!(
            retry.header("content-type").as_deref(),
            Some("application/json"),
            "{retry}"
        );
        assert_eq!(
            retry.header("etag").as_deref(),
            Some("W/\"charge-1\""),
            "decoded bytes are another representation: {retry}"
        );
    }

    // The last, a browser's: every coding at once.
    let accepting = [
        name.to_owned(),
        format!("{name};q=0.5, identity"),
        "*".to_owned(),
        "gzip, deflate, br, zstd".to_owned(),
    ];
    for accepting in accepting {
        let retry = send_keyed(&gw, &path, &key, Some(&accepting)).await;
        assert_eq!(retry.status, 201, "{retry}");
        assert!(retry.replayed(), "{retry}");
        assert_eq!(
            retry.header("content-encoding").as_deref(),
            Some(name),
            "a retry that accepts {name} ({accepting:?}) gets it labelled: {retry}"
        );
        assert_eq!(retry.body, first.body, "the stored bytes, as the upstream sent them");
        assert_eq!(decode(coding, &retry.body), json.as_bytes());
        assert_eq!(retry.header("etag").as_deref(), Some("\"charge-1\""), "{retry}");
        assert_eq!(retry.header("vary").as_deref(), Some("Accept-Encoding"), "{retry}");
    }
    assert_eq!(count(&upstream.calls.encoded), 1, "the upstream ran once");
}

/// Each coding the upstream may answer in ([`check_coding`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_in_every_coding_replay_right_for_every_accept_encoding() {
    for coding in ["gzip", "br", "deflate", "deflate-raw", "zstd"] {
        println!("case: {coding}");
        check_coding(coding).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compact_replay_says_its_body_was_omitted() {
    let upstream = Upstream::start().await;
    let gw = Gateway::start(&upstream.url, &["--max-stored-body", "1KiB"]).await;

    for (path, location) in [
        ("/large?size=100000", None),
        ("/large?size=100000&location=1", Some("/reports/2")),
    ] {
        let key = new_key();
        let first = send_keyed(&gw, path, &key, None).await;
        assert_eq!(first.status, 201, "{first}");
        assert_eq!(first.body.len(), 100_000, "the live answer is whole");
        assert_eq!(first.header("idempotency-replay"), None, "{first}");

        let retry = send_keyed(&gw, path, &key, None).await;
        assert_eq!(retry.status, 201, "the stored status: {retry}");
        assert!(retry.replayed(), "{retry}");
        assert_eq!(
            retry.header("idempotency-replay").as_deref(),
            Some("omitted"),
            "an empty replay of a large answer says so: {retry}"
        );
        assert!(retry.body.is_empty(), "{retry}");
        assert_eq!(retry.header("content-type"), None, "no body, no type: {retry}");
        assert_eq!(retry.header("location").as_deref(), location, "{retry}");
        assert_eq!(
            retry.header("content-location").as_deref(),
            location,
            "a Location points at the resource: {retry}"
        );
    }
    assert_eq!(count(&upstream.calls.large), 2, "each key ran once");
}
