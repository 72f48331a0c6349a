//! A path spelt to walk out of its route: dot segments that a server routing on the raw path never
//! resolves (Express, Node's `http`, Starlette), and backslashes that IIS reads as separators. Each
//! upstream here routes `POST /payments/*` its own way and counts its payments handler's runs; a
//! key sent twice must run there at most once unless the second run is flagged recovered.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, Uri};
use idem_test_support::task::AbortOnDrop;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::{Gateway, count, new_key};

const PAY_BODY: &str = r#"{"amount":1000,"currency":"EUR"}"#;
const LIMIT: Duration = Duration::from_secs(60);

/// An upstream that routes `POST /payments/*` to its payments handler, reading the path its own
/// way (`Counters::reading`) as a real server does. It counts the runs of its payments handler, and of those, the ones
/// flagged `Idempotency-Recovered: true`.
struct PrefixUpstream {
    addr: SocketAddr,
    payments: Arc<AtomicUsize>,
    flagged: Arc<AtomicUsize>,
    _task: AbortOnDrop,
}

#[derive(Clone)]
struct Counters {
    /// How this upstream reads a path before routing it.
    reading: fn(&str) -> String,
    payments: Arc<AtomicUsize>,
    flagged: Arc<AtomicUsize>,
}

/// The path as it arrives: Express, Node, uvicorn, gunicorn, `http.server`.
fn as_it_arrives(path: &str) -> String {
    path.to_owned()
}

/// The path as IIS reads it: `\` (or `%5C`) is a `/`, dot segments are resolved, case is
/// ignored.
fn as_iis_reads_it(path: &str) -> String {
    let slashed = path.replace("%5C", "/").replace("%5c", "/").replace('\\', "/");
    let mut segments: Vec<&str> = Vec::new();
    for segment in slashed.split('/').skip(1) {
        match segment {
            "." => {}
            ".." => {
                segments.pop();
            }
            _ => segments.push(segment),
        }
    }
    format!("/{}", segments.join("/")).to_ascii_lowercase()
}

async fn prefix_routed(State(counters): State<Counters>, method: Method, uri: Uri, headers: HeaderMap, _body: Bytes) {
    if method == Method::POST && (counters.reading)(uri.path()).starts_with("/payments/") {
        counters.payments.fetch_add(1, Ordering::SeqCst);
        if headers.get("idempotency-recovered").is_some_and(|v| v == "true") {
            counters.flagged.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl PrefixUpstream {
    async fn start(reading: fn(&str) -> String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the upstream");
        let addr = listener.local_addr().unwrap();
        let counters = Counters {
            reading,
            payments: Arc::new(AtomicUsize::new(0)),
            flagged: Arc::new(AtomicUsize::new(0)),
        };
        let app = Router::new().fallback(prefix_routed).with_state(counters.clone());
        let _task = AbortOnDrop::serve(listener, app);
        Self {
            addr,
            payments: counters.payments,
            flagged: counters.flagged,
            _task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Sends `POST path` byte for byte (an HTTP client would resolve its dot segments first) with
/// `key`, and returns the status code.
async fn raw_post(gateway: SocketAddr, path: &str, key: &str) -> u16 {
    let mut stream = TcpStream::connect(gateway).await.expect("connect to the gateway");
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {gateway}\r\nIdempotency-Key: {key}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{PAY_BODY}",
        PAY_BODY.len()
    );
    stream.write_all(request.as_bytes()).await.expect("send the request");
    let mut answer = Vec::new();
    tokio::time::timeout(LIMIT, stream.read_to_end(&mut answer))
        .await
        .expect("the gateway answers in time")
        .expect("read the answer");
    let text = String::from_utf8_lossy(&answer);
    text.split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"))
}

/// docs/operations.md's route table: `/payments/*` protected (a key required), `/webhooks/*`
/// passed through. `POST /payments/../webhooks/x` is read by both of idem's readings as
/// `/webhooks/x` (dot segments resolved in each), so it passes through; an upstream that routes
/// on the path as it arrives (Express, Node, uvicorn, gunicorn, `http.server`) runs its payments
/// handler for it. The same keyed request twice then charges twice, unflagged. What should hold:
/// the payments handler runs once (a reading with dot segments kept falls under `/payments/*`,
/// so the stricter rule applies), or the spelling is refused with `400 path-ambiguous`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dot_segment_walks_a_payment_out_of_its_route() {
    let upstream = PrefixUpstream::start(as_it_arrives).await;
    let (gw, _dir) = readme_gateway(&upstream, &[]).await;
    twice_each(
        &gw,
        &upstream,
        &["/payments/../webhooks/x", "/payments/%2e%2e/webhooks/x"],
    )
    .await;
}

/// docs/operations.md's route table again, with `--path-readings case-insensitive,strip-params`, the
/// setting offered for ASP.NET/IIS upstreams. IIS reads a backslash (and `%5C`) as a `/`, so
/// `POST /webhooks/..\payments\1` is `/payments/1` to it; idem's readings keep the backslash
/// inside one segment under `/webhooks/*` and pass it through. What should hold: the payments
/// handler runs once, or the spelling is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backslash_walks_a_payment_out_of_its_route_on_iis() {
    let upstream = PrefixUpstream::start(as_iis_reads_it).await;
    let (gw, _dir) = readme_gateway(&upstream, &["--path-readings", "case-insensitive,strip-params"]).await;
    twice_each(
        &gw,
        &upstream,
        &["/webhooks/..\\payments\\1", "/webhooks/..%5Cpayments%5C1"],
    )
    .await;
}

/// A gateway with docs/operations.md's routes: `/payments/*` (a key required) and `/webhooks/*` passed
/// through; `args` added. The directory holds its config file.
async fn readme_gateway(upstream: &PrefixUpstream, args: &[&str]) -> (Gateway, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idem.toml");
    std::fs::write(
        &config,
        "[[route]]\npath = \"/payments/*\"\nmissing-key = \"require\"\n\n\
         [[route]]\npath = \"/webhooks/*\"\nenabled = false\n",
    )
    .unwrap();
    let mut all = vec!["--config", config.to_str().unwrap()];
    all.extend_from_slice(args);
    let gw = Gateway::start(&upstream.url(), &all).await;
    (gw, dir)
}

/// Sends each path twice under one key and asserts that the upstream's payments handler ran at
/// most once per key, unless the second run was flagged recovered.
async fn twice_each(gw: &Gateway, upstream: &PrefixUpstream, paths: &[&str]) {
    for path in paths {
        let before = count(&upstream.payments);
        let key = new_key();
        let first = raw_post(gw.addr(), path, &key).await;
        let second = raw_post(gw.addr(), path, &key).await;
        let runs = count(&upstream.payments) - before;
        let flagged = count(&upstream.flagged);
        assert!(
            runs <= 1 || flagged > 0,
            "POST {path} twice with one key ({first}, then {second}) ran the upstream's payments \
             handler {runs} times, none flagged recovered"
        );
    }
}
