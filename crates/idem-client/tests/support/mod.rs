//! Servers that misbehave on purpose, on 127.0.0.1, in the test process: one that answers from a
//! script and records when each request arrived and which key it carried, and one that reads a
//! request and hangs up without answering.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use idem_client::reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use idem_client::{IdempotencyKey, IdempotencyMiddleware, RetryClassifier};
use idem_test_support::servers::free_port;
use idem_test_support::task::AbortOnDrop;
use idem_test_support::wire::read_head;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::time::Instant;

/// One request as the server received it.
#[derive(Debug, Clone)]
pub(crate) struct Hit {
    /// When it arrived (its head and body read).
    pub(crate) at: Instant,
    /// Its `Idempotency-Key` header, raw.
    pub(crate) key: Option<String>,
    /// Its body.
    pub(crate) body: Bytes,
}

impl Hit {
    /// The key the header carries, parsed as idem parses it.
    pub(crate) fn parsed_key(&self) -> Option<IdempotencyKey> {
        let raw = self.key.as_deref()?;
        IdempotencyKey::from_header_value(&raw.parse().unwrap()).ok()
    }
}

type Script = dyn Fn(usize) -> Response + Send + Sync;

struct Shared {
    hits: Mutex<Vec<Hit>>,
    script: Box<Script>,
}

/// A server that answers the `n`th request (1-based) with `script(n)`, whatever its path.
pub(crate) struct Scripted {
    /// Where it listens.
    pub(crate) addr: SocketAddr,
    shared: Arc<Shared>,
    _task: AbortOnDrop,
}

async fn answer(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    let key = parts
        .headers
        .get("idempotency-key")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let n = {
        let mut hits = shared.hits.lock().unwrap();
        hits.push(Hit {
            at: Instant::now(),
            key,
            body,
        });
        hits.len()
    };
    (shared.script)(n)
}

impl Scripted {
    /// Starts on an ephemeral port.
    pub(crate) async fn start(script: impl Fn(usize) -> Response + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::start_on(listener, script)
    }

    /// Starts on a listener bound earlier.
    pub(crate) fn start_on(listener: TcpListener, script: impl Fn(usize) -> Response + Send + Sync + 'static) -> Self {
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            hits: Mutex::new(Vec::new()),
            script: Box::new(script),
        });
        let app = Router::new().fallback(answer).with_state(shared.clone());
        let _task = AbortOnDrop::serve(listener, app);
        Self { addr, shared, _task }
    }

    /// `http://127.0.0.1:PORT/path`.
    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Every request received so far, in order.
    pub(crate) fn hits(&self) -> Vec<Hit> {
        self.shared.hits.lock().unwrap().clone()
    }

    /// How many requests were received.
    pub(crate) fn count(&self) -> usize {
        self.shared.hits.lock().unwrap().len()
    }
}

/// A response with `status`, `headers` and a small text body.
pub(crate) fn reply(status: u16, headers: &[(&str, &str)], body: &str) -> Response {
    let mut builder = Response::builder().status(StatusCode::from_u16(status).unwrap());
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

/// An RFC 9457 problem as idem sends it.
pub(crate) fn problem(status: u16, name: &str, extra: &[(&str, &str)]) -> Response {
    let body = format!(r#"{{"type":"urn:idem:problem:{name}","title":"{name}","status":{status},"detail":"test"}}"#);
    let mut headers = vec![("content-type", "application/problem+json")];
    headers.extend_from_slice(extra);
    reply(status, &headers, &body)
}

/// A server that reads each request's head and then closes the connection without a word, as a
/// server that crashed mid-request would. Counts the requests it swallowed.
pub(crate) struct HangUp {
    /// Where it listens.
    pub(crate) addr: SocketAddr,
    received: Arc<Mutex<usize>>,
    _task: AbortOnDrop,
}

impl HangUp {
    /// Starts on an ephemeral port.
    pub(crate) async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let received = Arc::new(Mutex::new(0));
        let counter = received.clone();
        let _task = AbortOnDrop::spawn(async move {
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                let counter = counter.clone();
                tokio::spawn(async move {
                    if read_head(&mut socket).await.is_none() {
                        return;
                    }
                    *counter.lock().unwrap() += 1;
                    // Close without a word: the client sees the connection end before any answer.
                    let _ = socket.shutdown().await;
                });
            }
        });
        Self { addr, received, _task }
    }

    /// `http://127.0.0.1:PORT/path`.
    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// How many requests it swallowed.
    pub(crate) fn received(&self) -> usize {
        *self.received.lock().unwrap()
    }
}

/// A port on 127.0.0.1 that was free a moment ago and on which nothing listens now.
pub(crate) fn unused_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// A plain reqwest client: no proxy from the environment, a generous per-attempt timeout.
pub(crate) fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// A client with `middleware`.
pub(crate) fn client<C: RetryClassifier>(middleware: IdempotencyMiddleware<C>) -> ClientWithMiddleware {
    ClientBuilder::new(http_client()).with(middleware).build()
}

/// The middleware tests start from: the defaults with short waits, so tests run fast.
pub(crate) fn fast() -> IdempotencyMiddleware {
    IdempotencyMiddleware::new()
        .with_base_delay(Duration::from_millis(10))
        .with_max_delay(Duration::from_millis(50))
}
