//! The upstream of the rule test: a bare HTTP/1.1 server in the test process that records every
//! request it reads (before it answers) and then does what the request's `x-rule-do` header
//! scripts: answer a status, hang past the gateway's timeouts, or drop the connection.
//!
//! It is written on raw TCP ([`idem_test_support::wire`]) rather than a framework because "read the request, then drop the
//! connection without an answer" is exactly what a framework will not do.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_test_support::task::AbortOnDrop;
use idem_test_support::wire::read_request;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The header a test request carries to say what the upstream does with it.
pub(crate) const DO: &str = "x-rule-do";
/// The header that names a test request (its number in the driver), forwarded by the gateway.
pub(crate) const REQ: &str = "x-rule-req";

/// The longest a hung request is held when the gateway never hangs up (past `--run-timeout`).
const LONGEST_HANG: Duration = Duration::from_secs(8);

/// What the upstream does with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Behaviour {
    /// Answer this status at once, with the run's id in the body.
    Status(u16),
    /// Hold the answer this long (past `--upstream-timeout`), then answer 201.
    HangThenCreated(u64),
    /// Hold the connection until the gateway gives the run up and hangs up (`--run-timeout`).
    HangUntilDropped,
    /// Read the request whole, then close the connection without a word.
    Drop,
}

impl Behaviour {
    /// The header value that asks for it.
    pub(crate) fn header(self) -> String {
        match self {
            Self::Status(code) => format!("status:{code}"),
            Self::HangThenCreated(ms) => format!("hang-then-201:{ms}"),
            Self::HangUntilDropped => "hang".to_owned(),
            Self::Drop => "drop".to_owned(),
        }
    }

    fn parse(text: &str) -> Self {
        if let Some(code) = text.strip_prefix("status:") {
            return Self::Status(code.parse().unwrap_or(201));
        }
        if let Some(ms) = text.strip_prefix("hang-then-201:") {
            return Self::HangThenCreated(ms.parse().unwrap_or(0));
        }
        match text {
            "hang" => Self::HangUntilDropped,
            "drop" => Self::Drop,
            _ => Self::Status(201),
        }
    }
}

/// One request as the upstream read it: one run of whatever it asks for.
#[derive(Debug, Clone)]
pub(crate) struct Arrival {
    /// The run's id, unique in the test process; the answer's body carries it.
    pub(crate) run: u64,
    /// The driver's number of the request (`x-rule-req`).
    pub(crate) req: Option<u64>,
    /// `Idempotency-Key` as received.
    pub(crate) key: Option<String>,
    /// `Authorization` as received.
    pub(crate) authorization: Option<String>,
    /// Whether it carried `Idempotency-Recovered: true`.
    pub(crate) recovered: bool,
    /// The method and request target, as received.
    pub(crate) method: String,
    pub(crate) target: String,
    /// The body, as received.
    pub(crate) body: Vec<u8>,
}

#[derive(Debug, Default)]
struct Log {
    arrivals: Mutex<Vec<Arrival>>,
    /// Requests read whose connection is still being handled (answering, hanging).
    open: AtomicUsize,
}

/// The running upstream. Stops when dropped.
#[derive(Debug)]
pub(crate) struct Upstream {
    addr: SocketAddr,
    log: Arc<Log>,
    task: AbortOnDrop,
}

static RUNS: AtomicU64 = AtomicU64::new(1);

impl Upstream {
    /// Listens on an ephemeral port of 127.0.0.1.
    pub(crate) async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the upstream");
        let addr = listener.local_addr().unwrap();
        let log = Arc::new(Log::default());
        let task = accept(listener, log.clone());
        Self { addr, log, task }
    }

    /// Closes the listening socket: connections are refused until [`Self::listen_again`].
    pub(crate) async fn stop_listening(&mut self) {
        self.task.stop().await;
    }

    /// Listens again on the same address.
    pub(crate) async fn listen_again(&mut self) {
        let mut tries = 0;
        let listener = loop {
            match TcpListener::bind(self.addr).await {
                Ok(listener) => break listener,
                Err(err) if tries < 100 => {
                    tries += 1;
                    let _ = err;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(err) => panic!("the upstream cannot listen on {} again: {err}", self.addr),
            }
        };
        self.task = accept(listener, self.log.clone());
    }

    /// `http://127.0.0.1:PORT`.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every run so far, in order of arrival.
    pub(crate) fn arrivals(&self) -> Vec<Arrival> {
        self.log.arrivals.lock().unwrap().clone()
    }

    /// How many runs arrived so far.
    pub(crate) fn arrived(&self) -> usize {
        self.log.arrivals.lock().unwrap().len()
    }

    /// How many requests are still being answered (or hung).
    pub(crate) fn open(&self) -> usize {
        self.log.open.load(Ordering::SeqCst)
    }
}

fn accept(listener: TcpListener, log: Arc<Log>) -> AbortOnDrop {
    AbortOnDrop::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(serve(stream, log.clone()));
        }
    })
}

/// Serves the requests of one connection, each answered with `Connection: close`.
async fn serve(mut stream: TcpStream, log: Arc<Log>) {
    let Some(request) = read_request(&mut stream).await else {
        return;
    };
    let header = |name: &str| request.header(name).map(str::to_owned);
    let behaviour = Behaviour::parse(header(DO).as_deref().unwrap_or(""));
    let run = RUNS.fetch_add(1, Ordering::SeqCst);
    let req = header(REQ).and_then(|r| r.parse().ok());
    log.open.fetch_add(1, Ordering::SeqCst);
    log.arrivals.lock().unwrap().push(Arrival {
        run,
        req,
        key: header("idempotency-key"),
        authorization: header("authorization"),
        recovered: header("idempotency-recovered").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")),
        method: request.method,
        target: request.target,
        body: request.body,
    });
    match behaviour {
        Behaviour::Status(code) => answer(&mut stream, code, run, req).await,
        Behaviour::HangThenCreated(ms) => {
            // Hold the answer; a gateway that hangs up meanwhile ends the wait early.
            let mut byte = [0u8; 1];
            let hung_up = tokio::time::timeout(Duration::from_millis(ms), stream.read(&mut byte)).await;
            if hung_up.is_err() {
                answer(&mut stream, 201, run, req).await;
            }
        }
        Behaviour::HangUntilDropped => {
            let mut byte = [0u8; 1];
            let _ = tokio::time::timeout(LONGEST_HANG, stream.read(&mut byte)).await;
        }
        Behaviour::Drop => {}
    }
    drop(stream);
    log.open.fetch_sub(1, Ordering::SeqCst);
}

async fn answer(stream: &mut TcpStream, code: u16, run: u64, req: Option<u64>) {
    let body = format!(
        r#"{{"run":{run},"req":{}}}"#,
        req.map_or("null".to_owned(), |r| r.to_string())
    );
    let head = format!(
        "HTTP/1.1 {code} Scripted\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
    let _ = stream.shutdown().await;
}
