//! Shared test infrastructure: an upstream HTTP service that counts what reaches it, a running
//! `idem serve` gateway in front of it, and small helpers to send requests and read answers.
//!
//! Every test starts its own upstream, its own gateway and its own temporary SQLite file, so the tests
//! are independent and can run in parallel.
//!
//! Each of the gateway's ~30 test binaries uses another part of it, hence the one `dead_code`
//! allowance among idem's test modules.

#![allow(dead_code)]

pub(crate) mod ledger;

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use axum::routing::post;
use idem_test_support::task::AbortOnDrop;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::{Child, Command};

/// The path of the binary under test.
pub(crate) const IDEM: &str = env!("CARGO_BIN_EXE_idem");

/// How long a gateway may take to print its listening line.
const STARTUP: Duration = Duration::from_secs(30);

/// The default time limit of one request sent by a test.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// The upstream
// ---------------------------------------------------------------------------------------------

/// What one request to the upstream carried.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    /// Which route (`pay`, `flaky`, …).
    pub(crate) route: &'static str,
    /// The `Idempotency-Key` header, as received.
    pub(crate) key: Option<String>,
    /// The `Idempotency-Recovered` header, as received.
    pub(crate) recovered: Option<String>,
}

/// The upstream's counters and what it saw.
#[derive(Debug, Default)]
pub(crate) struct UpstreamState {
    /// Calls of `POST /pay`.
    pub(crate) pay: Arc<AtomicUsize>,
    /// Calls of `GET /pay`.
    pub(crate) pay_get: Arc<AtomicUsize>,
    /// Calls of `POST /flaky`.
    pub(crate) flaky: Arc<AtomicUsize>,
    /// Calls of `POST|GET /status/{code}`.
    pub(crate) status: Arc<AtomicUsize>,
    /// Calls of `POST /big`.
    pub(crate) big: Arc<AtomicUsize>,
    /// Calls of `POST /break-once`.
    pub(crate) break_once: Arc<AtomicUsize>,
    /// Calls of `POST /chunked`.
    pub(crate) chunked: Arc<AtomicUsize>,
    /// Calls of `/orders/...`, per path.
    orders: Mutex<HashMap<String, usize>>,
    charges: AtomicUsize,
    last_headers: Mutex<HashMap<&'static str, HeaderMap>>,
    seen: Mutex<Vec<Seen>>,
}

impl UpstreamState {
    fn record(&self, route: &'static str, headers: &HeaderMap) {
        self.seen.lock().unwrap().push(Seen {
            route,
            key: header_text(headers, "idempotency-key"),
            recovered: header_text(headers, "idempotency-recovered"),
        });
        self.last_headers.lock().unwrap().insert(route, headers.clone());
    }

    /// Records a call on `route` with `headers` and counts it in `counter`: the call's number.
    fn call(&self, route: &'static str, counter: &AtomicUsize, headers: &HeaderMap) -> usize {
        self.record(route, headers);
        counter.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The headers of the last request on `route`.
    pub(crate) fn last_headers(&self, route: &str) -> Option<HeaderMap> {
        self.last_headers.lock().unwrap().get(route).cloned()
    }

    /// The `Idempotency-Recovered` header of each request on `route`, in order of arrival.
    pub(crate) fn recovered(&self, route: &str) -> Vec<Option<String>> {
        self.seen(route).into_iter().map(|seen| seen.recovered).collect()
    }

    /// Every request on `route`, in order of arrival.
    pub(crate) fn seen(&self, route: &str) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.route == route)
            .cloned()
            .collect()
    }
}

/// An app on `127.0.0.1`, in the test process, and the state its handlers share. Stops when
/// dropped.
#[derive(Debug)]
pub(crate) struct Served<S> {
    /// What the handlers share.
    pub(crate) state: S,
    addr: SocketAddr,
    _task: AbortOnDrop,
}

impl<S: Clone + Send + Sync + 'static> Served<S> {
    /// Serves `routes` with `state` on `listener`.
    pub(crate) fn on(listener: TcpListener, state: S, routes: Router<S>) -> Self {
        let addr = listener.local_addr().expect("the listener's address");
        let app = routes.with_state(state.clone());
        Self {
            state,
            addr,
            _task: AbortOnDrop::serve(listener, app),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// An upstream service on `127.0.0.1`, in the test process; its state is its counters. Stops when
/// dropped.
pub(crate) type Upstream = Served<Arc<UpstreamState>>;

impl Upstream {
    /// Starts on an ephemeral port.
    pub(crate) async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the upstream");
        Self::serve(listener)
    }

    /// Starts on a given address (for a port reserved earlier).
    pub(crate) async fn start_on(addr: SocketAddr) -> Self {
        let listener = TcpListener::bind(addr)
            .await
            .expect("bind the upstream on its reserved port");
        Self::serve(listener)
    }

    fn serve(listener: TcpListener) -> Self {
        let routes = Router::new()
            .route("/pay", post(pay).get(pay_get).patch(pay))
            .route("/flaky", post(flaky))
            .route("/status/{code}", post(status).get(status))
            .route("/big", post(big))
            .route("/break-once", post(break_once))
            .route("/chunked", post(chunked))
            .route("/orders/{*rest}", post(order));
        Self::on(listener, Arc::default(), routes)
    }
}

/// One test per row, each running `$scenario`, an async fn of a store URL, on the store its row
/// names: `common::store_tests!(scenario { test_on_postgres: postgres_store::store_url(), … });`.
#[allow(
    unused_macros,
    reason = "some test binaries have no scenario to run on several stores"
)]
macro_rules! store_tests {
    ($scenario:ident { $($test:ident: $store:expr,)* }) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            $scenario(&$store).await;
        }
    )*};
}
#[allow(
    unused_imports,
    reason = "some test binaries have no scenario to run on several stores"
)]
pub(crate) use store_tests;

/// An upstream, a gateway in front of it with `flags` (on a fresh SQLite store), and a fresh key:
/// where most tests start.
pub(crate) async fn start(flags: &[&str]) -> (Upstream, Gateway, String) {
    let upstream = Upstream::start().await;
    let gateway = Gateway::start(&upstream.url(), flags).await;
    (upstream, gateway, new_key())
}

/// A port on 127.0.0.1 that was free a moment ago and on which nothing listens now.
pub(crate) fn reserve_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], idem_test_support::servers::free_port()))
}

type Shared = State<Arc<UpstreamState>>;

/// The start of an answer with `status` and `Content-Type: application/json`.
fn json_answer(status: StatusCode) -> axum::http::response::Builder {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
}

fn header_text(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

/// `POST|PATCH /pay[?delay=MS]`: a payment (both count in `pay`). 201, `{"charge":N,"received":"<body>"}`, `Location`,
/// `Set-Cookie`, and the key headers it saw echoed as `x-seen-key` / `x-seen-recovered`.
async fn pay(
    State(state): Shared,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    state.record("pay", &headers);
    state.pay.fetch_add(1, Ordering::SeqCst);
    if let Some(ms) = query.get("delay").and_then(|d| d.parse::<u64>().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let n = state.charges.fetch_add(1, Ordering::SeqCst) + 1;
    let json = serde_json::json!({"charge": n, "received": String::from_utf8_lossy(&body)}).to_string();
    let mut response = json_answer(StatusCode::CREATED)
        .header(header::LOCATION, format!("/charges/{n}"))
        .header(header::SET_COOKIE, "session=secret");
    if let Some(key) = headers.get("idempotency-key") {
        response = response.header("x-seen-key", key);
    }
    if let Some(recovered) = headers.get("idempotency-recovered") {
        response = response.header("x-seen-recovered", recovered);
    }
    response.body(Body::from(json)).unwrap()
}

/// `GET /pay`: a read. 200 with the number of reads so far.
async fn pay_get(State(state): Shared, headers: HeaderMap) -> Response {
    let n = state.call("pay_get", &state.pay_get, &headers);
    let mut response = json_answer(StatusCode::OK);
    if let Some(key) = headers.get("idempotency-key") {
        response = response.header("x-seen-key", key);
    }
    response.body(Body::from(format!(r#"{{"read":{n}}}"#))).unwrap()
}

/// `POST /flaky`: 500 the first time, 201 afterwards.
async fn flaky(State(state): Shared, headers: HeaderMap) -> Response {
    let n = state.call("flaky", &state.flaky, &headers);
    let (status, body) = if n == 1 {
        (StatusCode::INTERNAL_SERVER_ERROR, r#"{"error":"try again"}"#.to_owned())
    } else {
        (StatusCode::CREATED, format!(r#"{{"attempt":{n}}}"#))
    };
    json_answer(status).body(Body::from(body)).unwrap()
}

/// `POST|GET /status/{code}[?retry-after=S]`: answers with that status (and that `Retry-After`).
async fn status(
    State(state): Shared,
    UrlPath(code): UrlPath<u16>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let n = state.call("status", &state.status, &headers);
    let mut response = json_answer(StatusCode::from_u16(code).expect("a valid status"));
    if let Some(after) = query.get("retry-after") {
        response = response.header(header::RETRY_AFTER, after.as_str());
    }
    response
        .body(Body::from(format!(r#"{{"status":{code},"call":{n}}}"#)))
        .unwrap()
}

/// `POST /big?size=N`: 201 with an N-byte body and a `Location`.
async fn big(State(state): Shared, Query(query): Query<HashMap<String, String>>, headers: HeaderMap) -> Response {
    let n = state.call("big", &state.big, &headers);
    let size: usize = query.get("size").and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let body: Vec<u8> = (0..size).map(|i| b'a' + (i % 26) as u8).collect();
    Response::builder()
        .status(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::LOCATION, format!("/big/{n}"))
        .body(Body::from(body))
        .unwrap()
}

/// `POST /orders/ANY[?then=break|break-once|hang]`: an order at a path of the test's own (so that
/// `idem list --route` finds its records only). 201 with the call's number by default; `break`
/// sends a 200 head and part of a body and breaks the connection on every call (`break-once` on
/// the path's first only: the gateway leaves the key unknown, and the retry runs recovered);
/// `hang` answers after two minutes (the key stays in flight).
async fn order(
    State(state): Shared,
    UrlPath(rest): UrlPath<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let n = {
        let mut orders = state.orders.lock().unwrap();
        let calls = orders.entry(rest).or_default();
        *calls += 1;
        *calls
    };
    let then = query.get("then").map(String::as_str);
    if then == Some("hang") {
        tokio::time::sleep(Duration::from_secs(120)).await;
    }
    if then == Some("break") || (then == Some("break-once") && n == 1) {
        return broken_answer();
    }
    json_answer(StatusCode::CREATED)
        .body(Body::from(serde_json::json!({"call": n}).to_string()))
        .unwrap()
}

/// A 200 head and part of a JSON body, then a broken connection.
fn broken_answer() -> Response {
    let stream = futures_util::stream::unfold(0u8, |step| async move {
        match step {
            0 => Some((Ok::<Bytes, std::io::Error>(Bytes::from_static(b"{\"partial\":")), 1)),
            1 => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Some((Err(std::io::Error::other("the upstream broke mid-body")), 2))
            }
            _ => None,
        }
    });
    json_answer(StatusCode::OK).body(Body::from_stream(stream)).unwrap()
}

/// `POST /break-once`: the first call sends a 200 head and part of a body, then breaks the
/// connection; later calls answer 201 normally.
async fn break_once(State(state): Shared, headers: HeaderMap) -> Response {
    let n = state.call("break_once", &state.break_once, &headers);
    if n == 1 {
        return broken_answer();
    }
    let recovered = header_text(&headers, "idempotency-recovered");
    let mut response = json_answer(StatusCode::CREATED).header(header::LOCATION, format!("/break-once/{n}"));
    if let Some(r) = &recovered {
        response = response.header("x-seen-recovered", r.as_str());
    }
    response
        .body(Body::from(
            serde_json::json!({"call": n, "recovered": recovered.as_deref().unwrap_or("")}).to_string(),
        ))
        .unwrap()
}

/// `POST /chunked`: 201 with a small JSON body streamed in chunks, with no `Content-Length` (as
/// many frameworks answer).
async fn chunked(State(state): Shared, headers: HeaderMap) -> Response {
    let n = state.call("chunked", &state.chunked, &headers);
    let parts = vec![
        Ok::<Bytes, std::io::Error>(Bytes::from(format!(r#"{{"order":{n},"#))),
        Ok(Bytes::from_static(br#""items":["a","b","c"]}"#)),
    ];
    json_answer(StatusCode::CREATED)
        .header(header::LOCATION, format!("/orders/{n}"))
        .body(Body::from_stream(futures_util::stream::iter(parts)))
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// The gateway
// ---------------------------------------------------------------------------------------------

/// A running `idem serve`. Killed when dropped; its stderr is printed if the test is failing.
#[derive(Debug)]
pub(crate) struct Gateway {
    /// `http://127.0.0.1:PORT` of the proxy listener.
    pub(crate) base: String,
    /// `http://127.0.0.1:PORT` of the admin listener.
    pub(crate) admin: String,
    /// The store URL it uses.
    pub(crate) store: String,
    /// A client for it.
    pub(crate) client: reqwest::Client,
    child: Child,
    stderr_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        if std::thread::panicking() {
            self.dump_stderr();
        }
    }
}

/// A fresh store URL in `dir`.
pub(crate) fn store_url_in(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("idem.db").display())
}

/// The value of option `name` in a store URL.
fn store_option(url: &str, name: &str) -> String {
    let (_, query) = url.split_once('?').expect("options");
    query
        .split('&')
        .find_map(|pair| pair.strip_prefix(&format!("{name}=")))
        .expect("the option")
        .to_owned()
}

/// Every byte the store at `url` holds for its records, as a copy of it would show them: the
/// SQLite file, the PostgreSQL schema's rows (`schema=`), the values under the Redis prefix
/// (`prefix=`) on every node.
pub(crate) fn store_bytes(url: &str) -> Vec<u8> {
    use idem_test_support::raw;
    if let Some(path) = url.strip_prefix("sqlite://") {
        raw::sqlite_bytes(Path::new(path))
    } else if url.starts_with("postgres") {
        raw::postgres_bytes(url, &store_option(url, "schema"))
    } else {
        let nodes = idem_test_support::servers::redis_nodes(url);
        raw::redis_bytes(&nodes, &store_option(url, "prefix"))
    }
}

/// A config file in a directory of its own (kept as long as the returned guard).
pub(crate) fn config_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("idem.toml");
    std::fs::write(&path, text).expect("write the config file");
    (dir, path)
}

/// Runs `redis-cli -u SERVER ARGS` and returns what it printed (it must succeed).
pub(crate) fn redis_cli(server: &str, args: &[&str]) -> String {
    let output = std::process::Command::new("redis-cli")
        .args(["-u", server])
        .args(args)
        .output()
        .expect("redis-cli on PATH (apt-get install redis-tools)");
    assert!(output.status.success(), "redis-cli {args:?}: {output:?}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Makes the store at `url` lose every record and its salt under the gateways running on it, as
/// a restart without persistence, a `FLUSHALL` or a failover to an empty node does (SQLite: the
/// rows deleted; PostgreSQL: the schema dropped and migrated anew by `idem migrate`; Redis: every
/// key under the prefix deleted, on every node).
pub(crate) async fn lose_store_data(url: &str) {
    if let Some(path) = url.strip_prefix("sqlite://") {
        let conn = rusqlite::Connection::open(path).expect("open the SQLite file");
        conn.busy_timeout(Duration::from_secs(5)).expect("busy timeout");
        conn.execute_batch("DELETE FROM idem_records; DELETE FROM idem_scope_salt;")
            .expect("delete the records and the salt");
    } else if url.starts_with("postgres") {
        let (owned, schema) = (url.to_owned(), store_option(url, "schema"));
        tokio::task::spawn_blocking(move || idem_test_support::servers::drop_postgres_schema(&owned, &schema))
            .await
            .expect("drop the schema");
        let migrated = run_idem(&["migrate", "--store", url], Duration::from_secs(60)).await;
        assert!(migrated.status.success(), "idem migrate: {}", describe(&migrated));
    } else {
        let (url, prefix) = (url.to_owned(), store_option(url, "prefix"));
        tokio::task::spawn_blocking(move || idem_test_support::servers::delete_redis_keys(&url, &prefix))
            .await
            .expect("delete the prefix's keys");
    }
}

impl Gateway {
    /// Starts `idem serve --upstream UPSTREAM` with a fresh temporary store and `args` added.
    pub(crate) async fn start(upstream: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let store = store_url_in(dir.path());
        Self::spawn(upstream, store, dir, args).await
    }

    /// Starts `idem serve` with a fresh temporary store, `args` added and `env` set.
    pub(crate) async fn start_with_env(upstream: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let store = store_url_in(dir.path());
        let mut command = Command::new(IDEM);
        command.envs(env.iter().copied());
        Self::spawn_command(command, upstream, store, dir, args).await
    }

    /// Starts `idem serve` on an existing store URL with `env` set.
    pub(crate) async fn start_on_store_with_env(
        upstream: &str,
        store: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let mut command = Command::new(IDEM);
        command.envs(env.iter().copied());
        Self::spawn_command(command, upstream, store.to_owned(), dir, args).await
    }

    /// Starts `idem serve` on an existing store URL (to share a store between instances).
    pub(crate) async fn start_on_store(upstream: &str, store: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        Self::spawn(upstream, store.to_owned(), dir, args).await
    }

    /// Starts `idem serve` on an existing store URL with its wall clock skewed by `offset`
    /// ([`skewed_clock`]).
    pub(crate) async fn start_skewed(upstream: &str, store: &str, offset: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        let mut command = Command::new(IDEM);
        command.envs(skewed_clock(offset));
        Self::spawn_command(command, upstream, store.to_owned(), dir, args).await
    }

    /// Starts `idem serve` by `command` (the binary under test, with its environment set) on an
    /// existing store URL.
    pub(crate) async fn start_command_on_store(command: Command, upstream: &str, store: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir");
        Self::spawn_command(command, upstream, store.to_owned(), dir, args).await
    }

    async fn spawn(upstream: &str, store: String, dir: tempfile::TempDir, args: &[&str]) -> Self {
        Self::spawn_command(Command::new(IDEM), upstream, store, dir, args).await
    }

    async fn spawn_command(
        mut command: Command,
        upstream: &str,
        store: String,
        dir: tempfile::TempDir,
        args: &[&str],
    ) -> Self {
        let stderr_path = dir.path().join("stderr.log");
        let stderr = std::fs::File::create(&stderr_path).expect("create the stderr log");
        command
            .arg("serve")
            .args(["--upstream", upstream])
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--store", &store])
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true);
        let mut child = command.spawn().expect("spawn idem serve");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let found = tokio::time::timeout(STARTUP, async {
            while let Some(line) = lines.next_line().await.ok().flatten() {
                if let Some(addrs) = parse_listening_line(&line) {
                    return Some(addrs);
                }
            }
            None
        })
        .await;
        let (base, admin) = match found {
            Ok(Some(addrs)) => addrs,
            outcome => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
                panic!(
                    "idem serve did not print its listening line ({}) with args {args:?}; stderr:\n{stderr}",
                    if outcome.is_err() { "timed out" } else { "stdout closed" }
                );
            }
        };
        // Keep draining stdout so that the gateway never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Self {
            base,
            admin,
            store,
            client: client(),
            child,
            stderr_path,
            _dir: dir,
        }
    }

    /// The proxy listener's address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.base
            .trim_start_matches("http://")
            .parse()
            .expect("the proxy listens on host:port")
    }

    /// The proxy URL of `path`.
    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// A `POST` to `path` with `body`; add headers before sending.
    pub(crate) fn post(&self, path: &str, body: impl Into<reqwest::Body>) -> reqwest::RequestBuilder {
        self.client.post(self.url(path)).body(body)
    }

    /// A JSON `POST` of `body` to `path` with `Idempotency-Key: key`, to send (more headers may
    /// follow).
    pub(crate) fn keyed(&self, path: &str, key: &str, body: impl Into<reqwest::Body>) -> reqwest::RequestBuilder {
        self.post(path, body)
            .header("content-type", "application/json")
            .header("idempotency-key", key)
    }

    /// A JSON `POST` to `path`, keyed if `key` is given, sent.
    pub(crate) async fn post_json(&self, path: &str, key: Option<&str>, body: &str) -> Reply {
        let request = match key {
            Some(key) => self.keyed(path, key, body.to_owned()),
            None => self
                .post(path, body.to_owned())
                .header("content-type", "application/json"),
        };
        send(request).await
    }

    /// The gateway's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id().expect("the gateway is running")
    }

    /// Kills the process at once (SIGKILL), as a crash would, and reaps it.
    pub(crate) async fn kill(&mut self) {
        self.child.kill().await.expect("kill idem serve");
    }

    /// Sends SIGTERM.
    pub(crate) fn terminate(&self) {
        let status = std::process::Command::new("sh")
            .args(["-c", &format!("kill -TERM {}", self.pid())])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Waits for the process to exit.
    pub(crate) async fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => status.expect("wait for idem serve"),
            Err(_) => panic!("idem serve did not exit within {limit:?}"),
        }
    }

    /// What the gateway wrote to stderr so far. Its `info` lines reach stderr in batches, up to
    /// 20 ms after they were logged: to read a line logged by a request just answered, use
    /// [`Gateway::stderr_once`].
    pub(crate) fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// The gateway's stderr once `done` holds for it (a line that a request just answered
    /// logged has been written); panics, showing it, if that takes more than 5 s.
    pub(crate) async fn stderr_once(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        read_until(
            Duration::from_secs(5),
            Duration::from_millis(10),
            async || self.stderr(),
            |stderr| done(stderr),
            |stderr| format!("idem serve's stderr did not show {what} within 5 s:\n{stderr}"),
        )
        .await
    }

    fn dump_stderr(&self) {
        eprintln!(
            "---- idem serve stderr ({}) ----\n{}\n---- end ----",
            self.base,
            self.stderr()
        );
    }
}

/// Parses `idem listening on http://HOST:PORT admin http://HOST:PORT2`.
fn parse_listening_line(line: &str) -> Option<(String, String)> {
    let rest = line.trim().strip_prefix("idem listening on ")?;
    let mut words = rest.split_whitespace();
    let base = words.next()?;
    if words.next()? != "admin" {
        return None;
    }
    let admin = words.next()?;
    Some((
        base.trim_end_matches('/').to_owned(),
        admin.trim_end_matches('/').to_owned(),
    ))
}

/// The environment that runs idem with its wall clock skewed by `offset` (libfaketime's syntax:
/// `+45s`, `-2m`, `+2d`); its monotonic clock, which timers use, is left alone. The library is
/// preloaded into idem itself, not through the `faketime` wrapper, which would run idem as a
/// child of its own that outlives the wrapper when the test kills it.
pub(crate) fn skewed_clock(offset: &str) -> [(&'static str, String); 3] {
    let library = faketime_library();
    [
        ("LD_PRELOAD", library.display().to_string()),
        ("FAKETIME", offset.to_owned()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
    ]
}

/// The libfaketime library, to preload into idem itself (not through the `faketime` wrapper, whose
/// child would outlive a kill -9 of the wrapper).
pub(crate) fn faketime_library() -> PathBuf {
    [
        "/usr/lib/x86_64-linux-gnu/faketime",
        "/usr/lib/aarch64-linux-gnu/faketime",
        "/usr/lib/faketime",
    ]
    .iter()
    .map(|dir| Path::new(dir).join("libfaketimeMT.so.1"))
    .find(|path| path.exists())
    .unwrap_or_else(|| {
        panic!(
            "this test runs idem on a skewed clock with libfaketime, which is not installed: \
             run `bash .ci/services` (or `apt-get install faketime`)"
        )
    })
}

/// Runs `idem ARGS` to completion (at most `limit`) with its wall clock skewed by `offset`
/// ([`skewed_clock`]).
pub(crate) async fn run_idem_skewed(args: &[&str], offset: &str, limit: Duration) -> Output {
    let env = skewed_clock(offset);
    let env: Vec<(&str, &str)> = env.iter().map(|(name, value)| (*name, value.as_str())).collect();
    run_idem_with_env(args, &env, limit).await
}

/// Runs `idem ARGS` to completion (at most `limit`).
pub(crate) async fn run_idem(args: &[&str], limit: Duration) -> Output {
    run_idem_with_env(args, &[], limit).await
}

/// [`run_idem`] with `env` set.
pub(crate) async fn run_idem_with_env(args: &[&str], env: &[(&str, &str)], limit: Duration) -> Output {
    let mut command = Command::new(IDEM);
    command.envs(env.iter().copied());
    run_to_end(&mut command, args, limit).await
}

/// Runs `command` (idem, its environment set) with `args` to completion (at most `limit`), its
/// output captured.
pub(crate) async fn run_to_end(command: &mut Command, args: &[&str], limit: Duration) -> Output {
    let child = command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn idem");
    match tokio::time::timeout(limit, child.wait_with_output()).await {
        Ok(output) => output.expect("wait for idem"),
        Err(_) => panic!("`idem {}` did not finish within {limit:?}", args.join(" ")),
    }
}

/// Runs `command` to its end with no input; it must succeed (`what` names it in a failure, shown
/// with its status, stdout and stderr): its output.
pub(crate) async fn succeeds(command: &mut Command, what: &str) -> Output {
    let output = command
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap_or_else(|err| panic!("run {what}: {err}"));
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// `idem inspect --json` of `key` in `store` (found by the caller's `Bearer` token, if any, and
/// with `env` set): the one JSON object it prints.
pub(crate) async fn inspect_json(
    store: &str,
    key: &str,
    bearer: Option<&str>,
    env: &[(&str, &str)],
) -> serde_json::Value {
    let mut args = vec!["inspect", "--json", "--store", store];
    let authorization = bearer.map(|token| format!("Bearer {token}"));
    if let Some(authorization) = &authorization {
        args.extend(["--authorization", authorization]);
    }
    args.push(key);
    let output = run_idem_with_env(&args, env, Duration::from_secs(60)).await;
    assert!(output.status.success(), "inspect --json:\n{}", describe(&output));
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(text.lines().count(), 1, "one line:\n{text}");
    serde_json::from_str(&text).unwrap_or_else(|err| panic!("inspect --json prints JSON ({err}):\n{text}"))
}

/// Runs `idem serve` on ephemeral ports before `upstream`, on `store`, to completion (at most
/// `limit`): a `serve` that is expected to stop rather than serve.
pub(crate) async fn serve_to_end(upstream: &str, store: &str, limit: Duration) -> Output {
    let ports = ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"];
    let args = [&["serve", "--upstream", upstream][..], &ports, &["--store", store]].concat();
    run_idem(&args, limit).await
}

/// Runs `idem serve` (ephemeral ports, a fresh SQLite store, then `args`, with `env` set) and
/// asserts that it refuses to start as for a usage error: exit 2, the store not even created.
/// Returns what it printed.
pub(crate) async fn serve_refusing(args: &[&str], env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = store_url_in(dir.path());
    let mut command = Command::new(IDEM);
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--store", &store])
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = command.spawn().expect("spawn idem serve");
    let output = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("idem serve {args:?} {env:?} did not refuse to start"))
        .expect("wait for idem serve");
    assert_eq!(output.status.code(), Some(2), "{args:?} {env:?}: {}", describe(&output));
    assert!(
        !dir.path().join("idem.db").exists(),
        "{args:?} {env:?}: refused before the store is touched"
    );
    output
}

/// [`serve_refusing`] with a plain upstream and `args`; asserts that stderr names `flag`.
pub(crate) async fn assert_serve_refuses(args: &[&str], flag: &str) {
    let args = [&["--upstream", "http://127.0.0.1:9"][..], args].concat();
    let output = serve_refusing(&args, &[]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(flag), "{args:?}: stderr names {flag}: {stderr}");
}

/// Formats an output for an assertion message.
pub(crate) fn describe(output: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

// ---------------------------------------------------------------------------------------------
// Requests and answers
// ---------------------------------------------------------------------------------------------

/// A client that never uses a proxy, with a generous timeout.
pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .expect("a reqwest client")
}

/// One answer, read whole.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    /// The status code.
    pub(crate) status: u16,
    /// The headers.
    pub(crate) headers: reqwest::header::HeaderMap,
    /// The body.
    pub(crate) body: Bytes,
}

/// Sends a request and reads its answer whole; panics if there is none.
pub(crate) async fn send(request: reqwest::RequestBuilder) -> Reply {
    try_send(request).await.unwrap_or_else(|err| panic!("{err}"))
}

/// Sends a request and reads its answer whole; says what went wrong if that fails.
pub(crate) async fn try_send(request: reqwest::RequestBuilder) -> Result<Reply, String> {
    let response = request
        .send()
        .await
        .map_err(|err| format!("the gateway did not answer: {err:?}"))?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response
        .bytes()
        .await
        .map_err(|err| format!("the answer's head came ({status} {headers:?}) but its body broke off: {err:?}"))?;
    Ok(Reply { status, headers, body })
}

impl Reply {
    /// A header's value as text.
    pub(crate) fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    }

    /// The body as text.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Whether the gateway marked this answer as a replay.
    pub(crate) fn replayed(&self) -> bool {
        self.header("idempotency-replayed")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "?1")
    }

    /// A string or number field of a JSON object body.
    pub(crate) fn json(&self, field: &str) -> Option<String> {
        json_field(&self.text(), field)
    }

    /// The `charge` number of a `/pay` answer.
    pub(crate) fn charge(&self) -> u64 {
        self.json("charge")
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("no charge in {self}"))
    }

    /// The problem `detail`.
    pub(crate) fn detail(&self) -> String {
        self.json("detail").unwrap_or_default()
    }

    /// Asserts that this is a `201` replay of `first`, with its charge; `what` names this answer
    /// in a failure.
    #[track_caller]
    pub(crate) fn assert_replay_of(&self, first: &Reply, what: &str) {
        assert_eq!(self.status, 201, "{what}: {self}");
        assert!(self.replayed(), "{what} is a replay: {self}");
        assert_eq!(self.charge(), first.charge(), "{what} has the first's charge: {self}");
    }

    /// Asserts that this is the problem `name` with `status`.
    #[track_caller]
    pub(crate) fn assert_problem(&self, status: u16, name: &str) {
        assert_eq!(self.status, status, "expected {status} {name}, got {self}");
        let content_type = self.header("content-type").unwrap_or_default();
        assert!(
            content_type.starts_with("application/problem+json"),
            "a problem is application/problem+json; got {self}"
        );
        assert_eq!(
            self.json("type").as_deref(),
            Some(format!("urn:idem:problem:{name}").as_str()),
            "problem type; got {self}"
        );
        assert_eq!(
            self.json("status").as_deref(),
            Some(status.to_string().as_str()),
            "{self}"
        );
        assert!(
            self.json("title").is_some_and(|t| !t.is_empty()),
            "a problem has a title: {self}"
        );
        assert!(!self.detail().is_empty(), "a problem has a detail: {self}");
    }
}

impl From<idem_test_support::wire::Answer> for Reply {
    /// An answer read off the wire ([`idem_test_support::wire`]).
    fn from(answer: idem_test_support::wire::Answer) -> Self {
        let mut headers = reqwest::header::HeaderMap::new();
        for (name, value) in &answer.headers {
            let name = reqwest::header::HeaderName::from_bytes(name.as_bytes())
                .unwrap_or_else(|err| panic!("a bad header name {name:?}: {err}"));
            let value = reqwest::header::HeaderValue::from_bytes(value)
                .unwrap_or_else(|err| panic!("a bad value of {name}: {err}"));
            headers.append(name, value);
        }
        Self {
            status: answer.status,
            headers,
            body: answer.body.into(),
        }
    }
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut body = self.text();
        if body.len() > 600 {
            body.truncate(600);
            body.push('…');
        }
        write!(f, "{} {:?} body={body:?}", self.status, self.headers)
    }
}

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

/// A fresh, unique, bare idempotency key (not time-ordered).
pub(crate) fn new_key() -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    format!("test-{}-{n}-{:016x}", std::process::id(), random_u64())
}

/// A random number from the standard library's hasher seeds.
pub(crate) fn random_u64() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    RandomState::new().hash_one(nanos)
}

/// A UUIDv7 string whose timestamp is `millis` since the Unix epoch.
pub(crate) fn uuid_v7_at(millis: u64) -> String {
    let ts = format!("{:012x}", millis & 0xffff_ffff_ffff);
    let r = random_u64();
    let rand_a = (r >> 52) & 0xfff;
    let rand_b = 0x8000 | ((r >> 38) & 0x3fff);
    let rand_c = random_u64() & 0xffff_ffff_ffff;
    format!("{}-{}-7{rand_a:03x}-{rand_b:04x}-{rand_c:012x}", &ts[..8], &ts[8..])
}

/// Milliseconds since the Unix epoch, now.
pub(crate) fn now_millis() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// Reads with `read`, every `every`, until `done` holds for the reading, and returns it; panics
/// with `failure` of the last reading once `within` has passed.
pub(crate) async fn read_until<T>(
    within: Duration,
    every: Duration,
    mut read: impl AsyncFnMut() -> T,
    done: impl Fn(&T) -> bool,
    failure: impl Fn(&T) -> String,
) -> T {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let reading = read().await;
        if done(&reading) {
            return reading;
        }
        assert!(tokio::time::Instant::now() < deadline, "{}", failure(&reading));
        tokio::time::sleep(every).await;
    }
}

/// Waits until `counter` reaches `n` (at most `limit`).
pub(crate) async fn wait_for_count(counter: &AtomicUsize, n: usize, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    while counter.load(Ordering::SeqCst) < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the upstream was not called {n} time(s) within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The value of a counter.
pub(crate) fn count(counter: &AtomicUsize) -> usize {
    counter.load(Ordering::SeqCst)
}

/// `text` with every `%XX` decoded (bytes that do not make UTF-8 replaced).
pub(crate) fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|hex| std::str::from_utf8(hex).ok());
        match (bytes[i], hex.and_then(|hex| u8::from_str_radix(hex, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A top-level field of a JSON object text: a string's content, or any other value's JSON text
/// (`7`, `true`, `null`); `None` if the text is not a JSON object or lacks the field.
pub(crate) fn json_field(text: &str, field: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    Some(match value.get(field)? {
        serde_json::Value::String(text) => text.clone(),
        other => other.to_string(),
    })
}

#[test]
fn helpers_work() {
    assert_eq!(
        parse_listening_line("idem listening on http://127.0.0.1:1234 admin http://127.0.0.1:5678"),
        Some(("http://127.0.0.1:1234".to_owned(), "http://127.0.0.1:5678".to_owned()))
    );
    let body = r#"{"type":"urn:idem:problem:key-mismatch","title":"t","status":422,"detail":"the \"body\" differs"}"#;
    assert_eq!(
        json_field(body, "type").as_deref(),
        Some("urn:idem:problem:key-mismatch")
    );
    assert_eq!(json_field(body, "status").as_deref(), Some("422"));
    assert_eq!(json_field(body, "detail").as_deref(), Some("the \"body\" differs"));
    let pay = serde_json::json!({"charge": 7, "received": r#"{"a": 1}"#}).to_string();
    assert_eq!(json_field(&pay, "charge").as_deref(), Some("7"));
    assert_eq!(json_field(&pay, "received").as_deref(), Some(r#"{"a": 1}"#));
    let v7 = uuid_v7_at(0x0123_4567_89ab);
    assert_eq!(&v7[..13], "01234567-89ab");
    assert_eq!(&v7[14..15], "7");
    assert!(matches!(&v7[19..20], "8" | "9" | "a" | "b"), "{v7}");
    assert_eq!(v7.len(), 36);
}
