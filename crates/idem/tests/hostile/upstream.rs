//! The upstream: records what reaches it (each request's case number, key headers and trailers),
//! and plays hostile for replays with answers labelled in a coding their bytes are not in.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use http_body_util::BodyExt;
use idem_test_support::wire::Raw;
use tokio::net::TcpListener;

use super::oracle::{key_is_valid, library_accepts};
use super::running::exchange;
use crate::KEY;

/// One request that reached the upstream.
#[derive(Debug)]
pub(crate) struct Arrival {
    pub(crate) case: Option<u64>,
    pub(crate) method: String,
    pub(crate) target: String,
    pub(crate) keys: Vec<Vec<u8>>,
    pub(crate) trailer_keys: Vec<Vec<u8>>,
    pub(crate) recovered: Vec<Vec<u8>>,
    /// The body broke off on the way (a streamed keyless request whose client's body broke).
    pub(crate) broken_body: bool,
}

#[derive(Debug, Default)]
pub(crate) struct UpstreamLog {
    pub(crate) arrivals: Mutex<Vec<Arrival>>,
    pub(crate) calls: AtomicUsize,
}

/// The case number in a path: the digits after the first `/h/`.
fn case_of(path: &str) -> Option<u64> {
    let at = path.find("/h/")?;
    let digits: String = path[at + 3..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn values(headers: &HeaderMap, name: &str) -> Vec<Vec<u8>> {
    headers.get_all(name).iter().map(|v| v.as_bytes().to_vec()).collect()
}

/// Every method and path: reads the body whole, records the request, answers `201` with a small
/// JSON body and `x-upstream: 1` (so the test can tell the upstream's answers from the gateway's);
/// gzip-encoded (`Content-Encoding: gzip`) on paths that end in `/gz`.
async fn arrive(State(log): State<Arc<UpstreamLog>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let (len, trailer_keys, error) = match body.collect().await {
        Ok(collected) => {
            let trailer_keys = collected.trailers().map(|t| values(t, KEY)).unwrap_or_default();
            (collected.to_bytes().len(), trailer_keys, None)
        }
        Err(err) => (0, Vec::new(), Some(err.to_string())),
    };
    let case = case_of(parts.uri.path());
    let n = log.calls.fetch_add(1, Ordering::SeqCst) + 1;
    log.arrivals.lock().unwrap().push(Arrival {
        case,
        method: parts.method.to_string(),
        target: parts.uri.to_string(),
        keys: values(&parts.headers, KEY),
        trailer_keys,
        recovered: values(&parts.headers, "idempotency-recovered"),
        broken_body: error.is_some(),
    });
    let response = Response::builder().header("x-upstream", "1");
    if let Some(error) = error {
        return response
            .status(StatusCode::BAD_REQUEST)
            .header("content-type", "text/plain")
            .body(Body::from(format!("the body broke off: {error}")))
            .unwrap();
    }
    let case = case.map_or_else(|| "null".to_owned(), |c| c.to_string());
    let json = format!(r#"{{"case":{case},"call":{n},"received":{len}}}"#);
    let response = response
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .header("location", format!("/things/{n}"));
    if parts.uri.path().ends_with("/gz") {
        response
            .header("content-encoding", "gzip")
            .body(Body::from(gzip(json.as_bytes())))
            .unwrap()
    } else if let Some((coding, body)) = broken_coding(parts.uri.path(), &json) {
        response
            .header("content-encoding", coding)
            .body(Body::from(body))
            .unwrap()
    } else {
        response.body(Body::from(json)).unwrap()
    }
}

/// The answers of a hostile upstream, on paths ending in `/bad-NAME`: labelled with a coding their
/// bytes are not in, or a decompression bomb.
pub(crate) const BROKEN_CODINGS: &[&str] = &[
    "gzip",
    "br",
    "zstd",
    "deflate",
    "gzip-gzip",
    "unknown",
    "truncated",
    "bomb",
];

/// 100 MiB of zeros, gzipped into ~100 KB (under `--max-stored-body`): more than anyone should
/// inflate for a replay. Made once, before the traffic starts.
static BOMB: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();

fn bomb() -> &'static [u8] {
    BOMB.get_or_init(|| gzip(&vec![0; 100 << 20]))
}

fn broken_coding(path: &str, json: &str) -> Option<(&'static str, Vec<u8>)> {
    let name = path.rsplit_once("/bad-")?.1;
    let garbage = b"\x1f\x8b this is not what the header says".to_vec();
    Some(match name {
        "gzip" => ("gzip", garbage),
        "br" => ("br", garbage),
        "zstd" => ("zstd", garbage),
        "deflate" => ("deflate", garbage),
        // The outer layer decodes; what it yields does not.
        "gzip-gzip" => ("gzip, gzip", gzip(&garbage)),
        "unknown" => ("x-unknown", json.as_bytes().to_vec()),
        "truncated" => {
            let whole = gzip(json.as_bytes());
            ("gzip", whole[..whole.len() / 2].to_vec())
        }
        "bomb" => ("gzip", bomb().to_vec()),
        _ => return None,
    })
}

/// `data` gzipped.
pub(crate) fn gzip(data: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(data).expect("gzip into memory");
    encoder.finish().expect("gzip into memory")
}

/// `data` gunzipped, if it is gzip.
pub(crate) fn gunzip(data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data).read_to_end(&mut out).ok()?;
    Some(out)
}

/// Starts the recording upstream: its URL, its log and its task.
pub(crate) async fn start_upstream() -> (String, Arc<UpstreamLog>, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the upstream");
    let addr = listener.local_addr().unwrap();
    let log = Arc::new(UpstreamLog::default());
    tokio::task::spawn_blocking(|| bomb().len())
        .await
        .expect("gzip the bomb");
    let app = Router::new().fallback(arrive).with_state(log.clone());
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.expect("the upstream serves");
    });
    (format!("http://{addr}"), log, task)
}

/// The upstream's log sees what the test relies on: every value of a key header and keys in
/// trailers (sent here directly, not through the gateway). Clears the log afterwards.
pub(crate) async fn check_the_upstream_log(url: &str, log: &UpstreamLog) {
    let addr: SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let raw = Raw::new("POST", "/h/0/self-check")
        .json()
        .h("Idempotency-Key", "a b")
        .h("Idempotency-Key", "\"c")
        .h("Transfer-Encoding", "chunked");
    let bytes = raw.then_raw(b"2\r\n{}\r\n0\r\nIdempotency-Key: d e\r\n\r\n");
    let (answers, ending) = exchange(addr, &bytes, false, 1).await;
    assert_eq!(
        answers.first().map(|a| a.status),
        Some(201),
        "the upstream answers: {ending:?}"
    );
    let arrivals = std::mem::take(&mut *log.arrivals.lock().unwrap());
    assert_eq!(arrivals.len(), 1, "{arrivals:?}");
    assert_eq!(arrivals[0].keys, [b"a b".to_vec(), b"\"c".to_vec()], "{arrivals:?}");
    assert_eq!(arrivals[0].trailer_keys, [b"d e".to_vec()], "{arrivals:?}");
    assert!(!library_accepts(&arrivals[0].keys) && !key_is_valid(b"a b") && !key_is_valid(b"\"c"));
}
