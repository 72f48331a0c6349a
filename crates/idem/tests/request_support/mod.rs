//! What the `idem request` tests run against: an upstream that is flaky on purpose, a running
//! `idem serve` in front of it, and a link that loses the first answer on its way back.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use axum::routing::post;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

/// The binary under test.
pub(crate) const IDEM: &str = env!("CARGO_BIN_EXE_idem");

/// Counters of the upstream's routes.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    /// `POST /pay`.
    pub(crate) pay: AtomicUsize,
    /// `POST /slow-once`.
    pub(crate) slow_once: AtomicUsize,
    /// `POST /flaky`.
    pub(crate) flaky: AtomicUsize,
    /// `POST /status/{code}`.
    pub(crate) status: AtomicUsize,
}

/// An upstream on 127.0.0.1 in the test process. Stops when dropped.
pub(crate) struct Upstream {
    /// Where it listens.
    pub(crate) addr: SocketAddr,
    /// Its counters.
    pub(crate) counts: Arc<Counts>,
    task: JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Shared = State<Arc<Counts>>;

fn created(route: &str, n: usize, headers: &HeaderMap) -> Response {
    let key = headers
        .get("idempotency-key")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    Response::builder()
        .status(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::LOCATION, format!("/{route}/{n}"))
        .body(Body::from(format!(
            r#"{{"{route}":{n},"key":{}}}"#,
            serde_json::Value::String(key)
        )))
        .unwrap()
}

/// `POST /pay`: 201 `{"pay":N,"key":"<the key header>"}`.
async fn pay(State(counts): Shared, headers: HeaderMap) -> Response {
    let n = counts.pay.fetch_add(1, Ordering::SeqCst) + 1;
    created("pay", n, &headers)
}

/// `POST /slow-once`: the first call takes 1.5 s, then all answer 201 at once.
async fn slow_once(State(counts): Shared, headers: HeaderMap) -> Response {
    let n = counts.slow_once.fetch_add(1, Ordering::SeqCst) + 1;
    if n == 1 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    created("slow-once", n, &headers)
}

/// `POST /flaky`: 503 the first time, 201 afterwards.
async fn flaky(State(counts): Shared, headers: HeaderMap) -> Response {
    let n = counts.flaky.fetch_add(1, Ordering::SeqCst) + 1;
    if n == 1 {
        return Response::builder()
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .body(Body::from("warming up"))
            .unwrap();
    }
    created("flaky", n, &headers)
}

/// `POST /status/{code}[?retry-after=S]`: answers with that status.
async fn status(
    State(counts): Shared,
    Path(code): Path<u16>,
    axum::extract::Query(query): axum::extract::Query<HashMap<String, String>>,
) -> Response {
    counts.status.fetch_add(1, Ordering::SeqCst);
    let mut response = Response::builder().status(StatusCode::from_u16(code).unwrap());
    if let Some(after) = query.get("retry-after") {
        response = response.header(header::RETRY_AFTER, after.as_str());
    }
    response.body(Body::from(format!("status {code}"))).unwrap()
}

impl Upstream {
    /// Starts on an ephemeral port.
    pub(crate) async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Counts::default());
        let app = Router::new()
            .route("/pay", post(pay))
            .route("/slow-once", post(slow_once))
            .route("/flaky", post(flaky))
            .route("/status/{code}", post(status).get(status))
            .with_state(counts.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { addr, counts, task }
    }

    /// `http://127.0.0.1:PORT`.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// A running `idem serve` on a fresh SQLite store. Killed when dropped; its stderr is printed if the
/// test is failing.
pub(crate) struct Gateway {
    /// `http://127.0.0.1:PORT`.
    pub(crate) base: String,
    /// The proxy listener's address.
    pub(crate) addr: SocketAddr,
    child: Child,
    stderr: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.stderr).unwrap_or_default();
            eprintln!("---- idem serve stderr ----\n{log}\n---- end ----");
        }
    }
}

impl Gateway {
    /// Starts `idem serve --upstream UPSTREAM ARGS...`.
    pub(crate) async fn start(upstream: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = format!("sqlite://{}", dir.path().join("idem.db").display());
        let stderr = dir.path().join("stderr.log");
        let mut child = Command::new(IDEM)
            .arg("serve")
            .args(["--upstream", upstream])
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--store", &store])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(std::fs::File::create(&stderr).unwrap()))
            .kill_on_drop(true)
            .spawn()
            .expect("spawn idem serve");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let base = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(rest) = line.trim().strip_prefix("idem listening on ") {
                    return rest
                        .split_whitespace()
                        .next()
                        .map(|u| u.trim_end_matches('/').to_owned());
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| {
            panic!(
                "idem serve did not print its listening line; stderr:\n{}",
                std::fs::read_to_string(&stderr).unwrap_or_default()
            )
        });
        // Keep draining stdout so that the gateway never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let addr = base.trim_start_matches("http://").parse().expect("host:port");
        Self {
            base,
            addr,
            child,
            stderr,
            _dir: dir,
        }
    }

    /// The URL of `path` on the gateway.
    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

/// A TCP link in front of `target` that loses the first answer: on its first connection it
/// forwards the request, waits until the answer starts to come back (so the request was
/// processed), and then closes the connection without passing the answer on. Later connections
/// pass through untouched.
pub(crate) struct LossyLink {
    /// Where it listens.
    pub(crate) addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for LossyLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl LossyLink {
    /// Starts on an ephemeral port.
    pub(crate) async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let mut first = true;
            while let Ok((client, _)) = listener.accept().await {
                let lose = std::mem::replace(&mut first, false);
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    if lose {
                        lose_the_answer(client, server).await;
                    } else {
                        let (mut client, mut server) = (client, server);
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Self { addr, task }
    }

    /// The URL of `path` through the link.
    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

async fn lose_the_answer(client: TcpStream, server: TcpStream) {
    let (mut from_client, _to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let forward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
    });
    let mut byte = [0u8; 1];
    let _ = from_server.read(&mut byte).await;
    forward.abort();
    // Dropping both halves closes the client's connection with no answer on it.
}

/// Runs `idem ARGS` to completion (at most a minute).
pub(crate) async fn idem(args: &[&str]) -> Output {
    let child = Command::new(IDEM)
        .args(args)
        .env_remove("IDEM_RETRIES")
        .env_remove("IDEM_TIMEOUT")
        .env_remove("IDEM_DEADLINE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn idem");
    tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("`idem {}` did not finish within a minute", args.join(" ")))
        .expect("wait for idem")
}

/// An output for an assertion message.
pub(crate) fn describe(output: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The summary line `idem request` printed (the last line of stderr), as `name=value` pairs.
pub(crate) fn summary(output: &Output) -> HashMap<String, String> {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("idem: status="))
        .unwrap_or_else(|| panic!("no summary line:\n{}", describe(output)));
    line.trim_start_matches("idem: ")
        .split_whitespace()
        .filter_map(|word| word.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// A reqwest client that never uses a proxy.
pub(crate) fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}
