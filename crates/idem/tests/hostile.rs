//! Hostile traffic against a real `idem serve`: several thousand generated requests, most of them
//! malformed or hostile (written byte by byte over TCP), with well-formed keyed requests interleaved.
//!
//! What must hold, whatever the input:
//! * the gateway stays up and still answers a well-formed keyed request (201, then a replay);
//! * no 5xx: the upstream here never fails, so a 502/503/504 would be the gateway's fault, and a 500
//!   is always a bug; every 4xx that idem writes is `application/problem+json`;
//! * nothing with an invalid idempotency key reaches the upstream: the upstream records the key
//!   headers it receives, every one must parse as a valid key, and no request generated with an
//!   invalid key may arrive at all.
//!
//! The generator is seeded: the seed is printed, and `IDEM_HOSTILE_SEED=<seed>` replays a run.
//! Every request carries its case number in its path (`/h/<case>`), so the upstream's log can be
//! matched with the cases.
//!
//! Which answers are acceptable is decided per case. A request that is a complete, well-formed
//! HTTP/1.1 message ("HTTP-valid") must get an answer. A request that is malformed at the HTTP/1.1
//! level (a control byte in a header value, bogus framing, a body that breaks off, a broken request
//! line, …) is "HTTP-dubious": hyper may refuse it with its own bare `400`/`414`/`431` (no body, no
//! content type) or close the connection without a word, and both are acceptable; a problem
//! answer from idem is acceptable too. For HTTP-valid requests a closed connection without an
//! answer is a failure, except where the client sends a body the gateway is entitled not to read
//! (a refused key with a large body, a body over `--max-body`): there the server may answer early
//! and close, and the kernel's reset can eat the answer. A client that half-closes its side after a
//! request is dubious too: hyper's default (`half_close(false)`) drops such a connection when it
//! reads the end of input, possibly before the answer is written, so only bodies that break off are
//! sent that way.
//!
//! Invalid keys are sent only with `POST` and `PATCH`, the methods idem protects by default; other
//! methods pass through untouched by design. A body that breaks off is the client's fault, keyed or
//! not, so it must not be answered with a 5xx either.
//!
//! The upstream also plays hostile for replays: some of its answers are labelled with a
//! `Content-Encoding` their bytes are not in, or are a decompression bomb; their replays, to
//! clients that do or do not accept the coding, must still be replays and never a 5xx.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use common::{Gateway, json_field, now_millis, random_u64, try_send, uuid_v7_at};
use http_body_util::BodyExt;
use idem_core::IdempotencyKey;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Requests in flight at once.
const CONCURRENCY: usize = 32;
/// How long one exchange may take before the gateway counts as hung.
const ANSWER_LIMIT: Duration = Duration::from_secs(20);
/// The gateway's default `--max-body`.
const MAX_BODY: usize = 1024 * 1024;
/// The key header.
const KEY: &str = "idempotency-key";

// ---------------------------------------------------------------------------------------------
// A seeded generator
// ---------------------------------------------------------------------------------------------

/// SplitMix64: small, seedable, good enough to pick test inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

fn seed() -> u64 {
    match std::env::var("IDEM_HOSTILE_SEED") {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("IDEM_HOSTILE_SEED={text:?} is not a u64")),
        Err(_) => random_u64(),
    }
}

// ---------------------------------------------------------------------------------------------
// What the design says about key header values, written independently of idem-core
// ---------------------------------------------------------------------------------------------

/// Whether hyper (httparse) takes these bytes as a header value: HTAB, SP, VCHAR and obs-text.
fn http_value_ok(value: &[u8]) -> bool {
    value
        .iter()
        .all(|&b| b == b'\t' || (0x20..=0x7e).contains(&b) || b >= 0x80)
}

/// Whether one received key header value is a valid key (docs/design.md, "What is protected"): after the
/// optional whitespace around a field value, either one whole RFC 8941 sf-string with no
/// parameters, or a bare key without `"`, `,` and `\`; the key itself 1 to 255 visible ASCII
/// characters.
fn key_is_valid(raw: &[u8]) -> bool {
    let start = raw.iter().position(|&b| b != b' ' && b != b'\t').unwrap_or(raw.len());
    let end = raw
        .iter()
        .rposition(|&b| b != b' ' && b != b'\t')
        .map_or(start, |i| i + 1);
    let value = &raw[start..end];
    if !value.iter().all(|b| (0x20..=0x7e).contains(b)) {
        return false;
    }
    let key: Vec<u8> = if value.first() == Some(&b'"') {
        let mut key = Vec::new();
        let mut i = 1;
        loop {
            match value.get(i) {
                None => return false,
                Some(b'"') if i + 1 == value.len() => break,
                Some(b'"') => return false,
                Some(b'\\') => match value.get(i + 1) {
                    Some(&c @ (b'"' | b'\\')) => {
                        key.push(c);
                        i += 2;
                    }
                    _ => return false,
                },
                Some(&c) => {
                    key.push(c);
                    i += 1;
                }
            }
        }
        key
    } else {
        if value.iter().any(|b| matches!(b, b'"' | b',' | b'\\')) {
            return false;
        }
        value.to_vec()
    };
    !key.is_empty() && key.len() <= 255 && key.iter().all(u8::is_ascii_graphic)
}

/// Whether idem-core's public parser accepts these values of the key header.
fn library_accepts(values: &[Vec<u8>]) -> bool {
    let mut headers = HeaderMap::new();
    for value in values {
        let Ok(value) = HeaderValue::from_bytes(value) else {
            return false;
        };
        headers.append(KEY, value);
    }
    matches!(IdempotencyKey::from_headers(headers.get_all(KEY)), Ok(Some(_)))
}

// ---------------------------------------------------------------------------------------------
// The upstream: records what reaches it
// ---------------------------------------------------------------------------------------------

/// One request that reached the upstream.
#[derive(Debug)]
struct Arrival {
    case: Option<u64>,
    method: String,
    target: String,
    keys: Vec<Vec<u8>>,
    trailer_keys: Vec<Vec<u8>>,
    recovered: Vec<Vec<u8>>,
    /// The body broke off on the way (a streamed keyless request whose client's body broke).
    broken_body: bool,
}

#[derive(Debug, Default)]
struct UpstreamLog {
    arrivals: Mutex<Vec<Arrival>>,
    calls: AtomicUsize,
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
const BROKEN_CODINGS: &[&str] = &[
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

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(data).expect("gzip into memory");
    encoder.finish().expect("gzip into memory")
}

fn gunzip(data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data).read_to_end(&mut out).ok()?;
    Some(out)
}

async fn start_upstream() -> (String, Arc<UpstreamLog>, tokio::task::JoinHandle<()>) {
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

// ---------------------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------------------

/// The key a request carries, as the test generated it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyClass {
    /// One valid key header.
    Valid,
    /// A key header that is not one valid key (malformed, repeated, …): never processed.
    Invalid,
    /// A valid UUIDv7 key older than `--ttl`: `422 key-expired`, never processed.
    Expired,
    /// No key header.
    Absent,
}

/// What the answer must be, besides the rules that hold for every answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A 2xx from the upstream (a first run, not a replay).
    Success,
    /// A problem with this status from idem.
    Refused(u16),
    /// A 2xx from the upstream or a 4xx problem from idem.
    Either,
    /// Only the rules for every answer.
    Anything,
}

/// How one request (or one of two pipelined requests) is judged.
#[derive(Debug, Clone, Copy)]
struct Spec {
    key: KeyClass,
    /// A complete, well-formed HTTP/1.1 message: it must get an answer.
    http_valid: bool,
    expect: Expect,
    /// The gateway may answer before reading the whole body and close; the answer may be lost.
    early_close_ok: bool,
}

impl Spec {
    fn new(key: KeyClass, http_valid: bool, expect: Expect) -> Self {
        Self {
            key,
            http_valid,
            expect,
            early_close_ok: false,
        }
    }

    /// The gateway may answer before reading the whole body, then close.
    fn early_close(mut self) -> Self {
        self.early_close_ok = true;
        self
    }

    /// How often the upstream may see the case in the end.
    fn reach(&self, then: &Then) -> Reach {
        match (self.key, self.expect, then) {
            (KeyClass::Invalid | KeyClass::Expired, _, _) => Reach::Never,
            (_, Expect::Refused(_), _) => Reach::Never,
            (_, _, Then::Unclaimed(_)) => Reach::Once,
            (_, Expect::Success, _) => Reach::Once,
            _ => Reach::Any,
        }
    }
}

/// An HTTP-valid request that must run (a 2xx from the upstream).
fn runs(key: KeyClass) -> Spec {
    Spec::new(key, true, Expect::Success)
}

/// An HTTP-valid request that idem must refuse with a `status` problem.
fn refused(key: KeyClass, status: u16) -> Spec {
    Spec::new(key, true, Expect::Refused(status))
}

/// An HTTP-valid request that may run or be refused with a problem.
fn either(key: KeyClass) -> Spec {
    Spec::new(key, true, Expect::Either)
}

/// A request malformed at the HTTP/1.1 level: only the rules for every answer hold.
fn dubious(key: KeyClass) -> Spec {
    Spec::new(key, false, Expect::Anything)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    Never,
    Once,
    Any,
}

/// What to send after the first answer.
#[derive(Debug, Clone)]
enum Then {
    Nothing,
    /// The same bytes again: a replay (2xx, `Idempotency-Replayed`), the upstream not called again;
    /// a replayed body decodes as its `Content-Encoding` says.
    Replay,
    /// The same key with another body: `422`.
    Mismatch(Vec<u8>),
    /// After a request whose body broke off: a complete request with the same key runs (nothing
    /// was claimed).
    Unclaimed(Vec<u8>),
    /// The same bytes again, for an answer whose body does not decode: a replay (2xx,
    /// `Idempotency-Replayed`), whatever its body.
    ReplayAsStored,
}

#[derive(Debug, Clone)]
enum Sending {
    /// Bytes written to a fresh connection; `half_close` shuts the write side after them.
    Raw { bytes: Vec<u8>, half_close: bool },
    /// A well-formed keyed JSON POST through reqwest; the retry's body (possibly re-serialised).
    Client { key: String, body: String, retry: String },
}

#[derive(Debug)]
struct Case {
    id: u64,
    what: String,
    sending: Sending,
    /// One spec per expected answer (two for pipelined requests).
    specs: Vec<Spec>,
    then: Then,
    /// How often the upstream may see each case number.
    reach: Vec<(u64, Reach)>,
}

/// A request written by hand.
#[derive(Debug, Clone)]
struct Raw {
    line: Vec<u8>,
    headers: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Raw {
    /// `METHOD TARGET HTTP/1.1` with `Host` and `Connection: close`.
    fn new(method: &str, target: &str) -> Self {
        Self::line(format!("{method} {target} HTTP/1.1"))
    }

    /// Any request line, with `Host` and `Connection: close`.
    fn line(line: impl Into<Vec<u8>>) -> Self {
        Self {
            line: line.into(),
            headers: vec![
                (b"Host".to_vec(), b"127.0.0.1".to_vec()),
                (b"Connection".to_vec(), b"close".to_vec()),
            ],
        }
    }

    fn h(mut self, name: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Self {
        self.headers.push((name.as_ref().to_vec(), value.as_ref().to_vec()));
        self
    }

    fn json(self) -> Self {
        self.h("Content-Type", "application/json")
    }

    fn without(mut self, name: &str) -> Self {
        self.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name.as_bytes()));
        self
    }

    /// The head, ending with the empty line.
    fn head(&self) -> Vec<u8> {
        let mut out = self.line.clone();
        out.extend_from_slice(b"\r\n");
        for (name, value) in &self.headers {
            out.extend_from_slice(name);
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    /// With `Content-Length` and `body`.
    fn sized(&self, body: &[u8]) -> Vec<u8> {
        let mut out = self.clone().h("Content-Length", body.len().to_string()).head();
        out.extend_from_slice(body);
        out
    }

    /// The head, then `rest` as is.
    fn then_raw(&self, rest: &[u8]) -> Vec<u8> {
        let mut out = self.head();
        out.extend_from_slice(rest);
        out
    }
}

/// `body` as one chunk and the last chunk.
fn chunked(body: &[u8]) -> Vec<u8> {
    let mut out = format!("{:x}\r\n", body.len()).into_bytes();
    out.extend_from_slice(body);
    out.extend_from_slice(b"\r\n0\r\n\r\n");
    out
}

fn token(id: u64) -> String {
    // `~` never appears in generated junk, so keys built around distinct tokens never collide.
    format!("~{id}~")
}

fn target(id: u64) -> String {
    format!("/h/{id}")
}

fn small_body(id: u64) -> Vec<u8> {
    format!(r#"{{"case":{id},"amount":1000}}"#).into_bytes()
}

struct Gen {
    rng: Rng,
    next: u64,
    cases: Vec<Case>,
}

impl Gen {
    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// A protected method.
    fn method(&mut self) -> &'static str {
        if self.rng.chance(75) { "POST" } else { "PATCH" }
    }

    fn raw(&mut self, id: u64, what: impl Into<String>, bytes: Vec<u8>, spec: Spec, then: Then) {
        self.push_raw(id, what, bytes, false, spec, then);
    }

    fn push_raw(&mut self, id: u64, what: impl Into<String>, bytes: Vec<u8>, half_close: bool, spec: Spec, then: Then) {
        let reach = vec![(id, spec.reach(&then))];
        self.cases.push(Case {
            id,
            what: what.into(),
            sending: Sending::Raw { bytes, half_close },
            specs: vec![spec],
            then,
            reach,
        });
    }

    /// A replay follow-up, some of the time.
    fn maybe_replay(&mut self, percent: u64) -> Then {
        if self.rng.chance(percent) {
            Then::Replay
        } else {
            Then::Nothing
        }
    }

    /// A protected request with one key header holding `value`; its expectations follow from the
    /// value (see [`key_is_valid`], [`http_value_ok`]).
    fn key_value(&mut self, id: u64, what: String, value: &[u8]) {
        let method = self.method();
        let bytes = Raw::new(method, &target(id))
            .json()
            .h("Idempotency-Key", value)
            .sized(&small_body(id));
        let http_valid = http_value_ok(value);
        let valid = key_is_valid(value);
        let (key, expect) = match (http_valid, valid) {
            (false, _) => (KeyClass::Invalid, Expect::Anything),
            (true, true) => (KeyClass::Valid, Expect::Success),
            (true, false) => (KeyClass::Invalid, Expect::Refused(400)),
        };
        let then = if valid && http_valid {
            self.maybe_replay(25)
        } else {
            Then::Nothing
        };
        let what = format!("{method} {what}: Idempotency-Key: {}", escape(value, 120));
        self.raw(id, what, bytes, Spec::new(key, http_valid, expect), then);
    }
}

fn escape(bytes: &[u8], limit: usize) -> String {
    let shown = &bytes[..bytes.len().min(limit)];
    let mut text = shown.escape_ascii().to_string();
    if bytes.len() > limit {
        text.push_str(&format!("… ({} bytes)", bytes.len()));
    }
    text
}

// ---------------------------------------------------------------------------------------------
// The generators
// ---------------------------------------------------------------------------------------------

/// Every byte 0x00-0xFF in a key: at its start, in its middle, inside an sf-string, and alone.
fn key_bytes(g: &mut Gen) {
    for b in 0u8..=255 {
        for form in ["start", "middle", "sf-string", "alone"] {
            let id = g.id();
            let t = token(id);
            let value: Vec<u8> = match form {
                "start" => [&[b][..], t.as_bytes(), b"z"].concat(),
                "middle" => [t.as_bytes(), &[b][..], b"z"].concat(),
                "sf-string" => [b"\"", t.as_bytes(), &[b][..], b"z\""].concat(),
                // The only single-byte keys of a run, so they are unique too.
                _ => vec![b],
            };
            g.key_value(id, format!("key byte 0x{b:02x} ({form})"), &value);
        }
    }
}

/// sf-string and list edge cases, and lengths around the limit. `T` stands for the case's token.
fn key_shapes(g: &mut Gen) {
    let shapes: &[&[u8]] = &[
        b"\"T",
        b"\"T\\\"x\"",
        b"\"T\\\\x\"",
        b"\"T\\x\"",
        b"\"T\\u0041\"",
        b"\"T\";a=1",
        b"\"T\"; a=1",
        b"\"T\";a",
        b"\"T\";a=1;b=?0",
        b"\"T\";",
        b"T;a=1",
        b"T;",
        b"T=",
        b"(\"T\" \"u\")",
        b"(\"T\")",
        b"(T u)",
        b"(T)",
        b"\"T\", \"u\"",
        b"\"T\",",
        b"T, u",
        b"T,",
        b",T",
        b"\"T\"x",
        b"\"T\"\"",
        b"\"T\"\"u\"",
        b"\"T\" \"u\"",
        b"\"T\" , ",
        b"\"\"",
        b"\"",
        b"\"\\\"",
        b"\\",
        b"\"T\" ",
        b" T",
        b"\tT\t",
        b"\"T\"\t",
        b"'T'",
        b"T\"",
        b"\"T\\\"",
        b"\"T\\\\\"",
        b"\"T\\",
        b"\"\\T\"",
        b"?T",
        b"?1T",
        b":VGVzdA==:T",
        b"*T",
        b"@T",
        b"\"T%22\"",
        b"T\\x",
        b"=?utf-8?b?T?=",
        b"T u",
        b"\"T u\"",
        b"\" T\"",
        b"\"T \"",
        b"\"T\tu\"",
        b"T\tu",
        b"\"T\x80\"",
        b"T\xc3\xa9",
        b"\"T\xc3\xa9\"",
        b"T\x7f",
        b"T()<>@:/[]?={}",
        b"\"T()<>@,;:/[]?={}\"",
        b"\"T,u\"",
        b"T\r\n x",
        b"T\r\nIdempotency-Key x",
    ];
    for _ in 0..3 {
        for shape in shapes {
            let id = g.id();
            let t = token(id);
            let mut value = Vec::new();
            for &b in *shape {
                if b == b'T' {
                    value.extend_from_slice(t.as_bytes());
                } else {
                    value.push(b);
                }
            }
            g.key_value(id, "sf-string shape".to_owned(), &value);
        }
    }
    // Lengths: the limit is 255 characters of key, whatever the quoting.
    for _ in 0..3 {
        let lengths: &[(&str, usize)] = &[
            ("bare", 1),
            ("bare", 254),
            ("bare", 255),
            ("bare", 256),
            ("bare", 10_000),
            ("bare", 100_000),
            ("quoted", 255),
            ("quoted", 256),
            ("quoted+escapes", 255),
            ("quoted+escapes", 256),
            ("bare+spaces", 255),
        ];
        for &(form, len) in lengths {
            let id = g.id();
            let t = token(id);
            let pad = |n: usize| "k".repeat(n.saturating_sub(t.len()));
            let value = match form {
                "bare" if len < t.len() => "k".to_owned(), // unique enough: only one per round
                "bare" => format!("{t}{}", pad(len)),
                "quoted" => format!("\"{t}{}\"", pad(len)),
                // Each `\"` is one character of key but two bytes on the wire.
                "quoted+escapes" => format!("\"{t}{}{}\"", "\\\"".repeat(100), pad(len - 100)),
                _ => format!("  {t}{}  \t", pad(len)),
            };
            if form == "bare" && len == 1 {
                continue; // covered by the byte sweep
            }
            g.key_value(id, format!("{form} key of {len} characters"), value.as_bytes());
        }
    }
}

/// Random junk around a unique token, classified by the rules above.
fn key_fuzz(g: &mut Gen, count: usize) {
    fn junk(rng: &mut Rng, out: &mut Vec<u8>, n: usize) {
        const SPECIAL: &[u8] = b"\"\\,;=()?:*<>@[]{}/' \t";
        for _ in 0..n {
            let b = match rng.below(100) {
                0..=54 => 0x21 + rng.below(94) as u8,
                55..=84 => *rng.pick(SPECIAL),
                85..=92 => 0x80 + rng.below(128) as u8,
                // Control bytes, but not CR or LF: those end the header line, and what follows
                // could parse as another header.
                _ => *rng.pick(&[0x00, 0x01, 0x08, 0x0b, 0x0c, 0x1b, 0x1f, 0x7f]),
            };
            out.push(if b == b'~' { b'-' } else { b });
        }
    }
    for _ in 0..count {
        let id = g.id();
        let mut value = Vec::new();
        if g.rng.chance(45) {
            value.push(b'"');
        }
        let n = g.rng.below(6);
        junk(&mut g.rng, &mut value, n);
        value.extend_from_slice(token(id).as_bytes());
        let n = if g.rng.chance(8) {
            200 + g.rng.below(100)
        } else {
            g.rng.below(6)
        };
        junk(&mut g.rng, &mut value, n);
        if g.rng.chance(40) {
            value.push(b'"');
        }
        g.key_value(id, "fuzzed key".to_owned(), &value);
    }
}

/// Several key headers, and repeated headers around a valid key.
fn repeated_headers(g: &mut Gen) {
    for _ in 0..4 {
        let sets: Vec<(&str, Vec<(&str, String)>)> = {
            let a = token(g.next + 1);
            vec![
                (
                    "same key twice",
                    vec![("Idempotency-Key", a.clone()), ("Idempotency-Key", a.clone())],
                ),
                (
                    "two keys",
                    vec![("Idempotency-Key", a.clone()), ("Idempotency-Key", format!("{a}b"))],
                ),
                (
                    "valid and invalid",
                    vec![("Idempotency-Key", a.clone()), ("Idempotency-Key", "a b".into())],
                ),
                (
                    "valid and empty",
                    vec![("Idempotency-Key", a.clone()), ("Idempotency-Key", String::new())],
                ),
                (
                    "differing case",
                    vec![("Idempotency-Key", a.clone()), ("IDEMPOTENCY-KEY", format!("{a}b"))],
                ),
                (
                    "three",
                    vec![
                        ("idempotency-key", a.clone()),
                        ("Idempotency-key", a.clone()),
                        ("Idempotency-Key", a.clone()),
                    ],
                ),
                (
                    "quoted and bare",
                    vec![("Idempotency-Key", format!("\"{a}\"")), ("Idempotency-Key", a.clone())],
                ),
                ("empty value", vec![("Idempotency-Key", String::new())]),
                ("only spaces", vec![("Idempotency-Key", "   ".into())]),
            ]
        };
        for (what, headers) in sets {
            let id = g.id();
            let method = g.method();
            let mut raw = Raw::new(method, &target(id)).json();
            for (name, value) in headers {
                raw = raw.h(name, value);
            }
            let bytes = raw.sized(&small_body(id));
            let spec = refused(KeyClass::Invalid, 400);
            g.raw(
                id,
                format!("{method} repeated key headers: {what}"),
                bytes,
                spec,
                Then::Nothing,
            );
        }
        // Repeated headers next to one valid key: idem may refuse them (a repeated scope header is
        // `400 scope-invalid`) or let them through; either way the key is valid.
        let others: &[(&str, Headers<'_>)] = &[
            (
                "two credentials",
                &[("Authorization", b"Bearer a"), ("Authorization", b"Bearer b")],
            ),
            (
                "the same credential twice",
                &[("Authorization", b"Bearer a"), ("Authorization", b"Bearer a")],
            ),
            ("an empty credential", &[("Authorization", b"")]),
            ("two content types", &[("Content-Type", b"text/plain")]),
            (
                "two accept-encodings",
                &[("Accept-Encoding", b"gzip"), ("Accept-Encoding", b"br")],
            ),
        ];
        for (what, headers) in others {
            let id = g.id();
            let mut raw = Raw::new(g.method(), &target(id)).json().h("Idempotency-Key", token(id));
            for (name, value) in *headers {
                raw = raw.h(name, value);
            }
            let then = g.maybe_replay(30);
            let spec = either(KeyClass::Valid);
            g.raw(id, format!("valid key, {what}"), raw.sized(&small_body(id)), spec, then);
        }
    }
}

/// Large heads: long values, many headers, long targets.
fn huge_heads(g: &mut Gen) {
    for _ in 0..2 {
        let id = g.id();
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        let junk = "j".repeat(50_000);
        g.raw(
            id,
            "valid key, a 50 KB header",
            raw.clone().h("X-Junk", &junk).sized(&small_body(id)),
            runs(KeyClass::Valid),
            Then::Replay,
        );

        let id = g.id();
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        let bytes = raw
            .h("Authorization", format!("Bearer {}", "c".repeat(60_000)))
            .sized(&small_body(id));
        g.raw(
            id,
            "valid key, a 60 KB credential",
            bytes,
            runs(KeyClass::Valid),
            Then::Replay,
        );

        let id = g.id();
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        let bytes = raw.h(format!("X-{}", "n".repeat(10_000)), "1").sized(&small_body(id));
        g.raw(
            id,
            "valid key, a 10 KB header name",
            bytes,
            runs(KeyClass::Valid),
            Then::Nothing,
        );

        let id = g.id();
        let mut raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        for i in 0..90 {
            raw = raw.h(format!("X-Many-{i}"), "1");
        }
        g.raw(
            id,
            "valid key, 90 headers",
            raw.sized(&small_body(id)),
            runs(KeyClass::Valid),
            Then::Nothing,
        );

        // Beyond hyper's limits (100 headers, a ~400 KB head, a 64 KB target): hyper's 431/414.
        let id = g.id();
        let mut raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        for i in 0..120 {
            raw = raw.h(format!("X-Many-{i}"), "1");
        }
        g.raw(
            id,
            "valid key, 120 headers",
            raw.sized(&small_body(id)),
            dubious(KeyClass::Valid),
            Then::Nothing,
        );

        for (class, key) in [
            (KeyClass::Valid, token(g.next + 1)),
            (KeyClass::Invalid, "a b".to_owned()),
        ] {
            let id = g.id();
            let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", &key);
            let bytes = raw.h("X-Junk", "j".repeat(500_000)).sized(&small_body(id));
            g.raw(
                id,
                format!("{class:?} key, a 500 KB header"),
                bytes,
                dubious(class),
                Then::Nothing,
            );
        }

        let id = g.id();
        let long_target = format!("{}?{}", target(id), "q".repeat(70_000));
        let raw = Raw::new("POST", &long_target).json().h("Idempotency-Key", "a b");
        g.raw(
            id,
            "invalid key, a 70 KB target",
            raw.sized(&small_body(id)),
            dubious(KeyClass::Invalid),
            Then::Nothing,
        );

        let id = g.id();
        let raw = Raw::new("POST", &target(id))
            .json()
            .h("Idempotency-Key", "x".repeat(300_000));
        g.raw(
            id,
            "a 300 KB key",
            raw.sized(&small_body(id)),
            dubious(KeyClass::Invalid),
            Then::Nothing,
        );
    }
}

/// A key for a framing case: valid, invalid or none.
fn framing_key(g: &mut Gen, id: u64) -> (KeyClass, Option<Vec<u8>>) {
    match g.rng.below(3) {
        0 => (KeyClass::Valid, Some(token(id).into_bytes())),
        1 => (KeyClass::Invalid, Some(format!("\"{}", token(id)).into_bytes())),
        _ => (KeyClass::Absent, None),
    }
}

fn framed_raw(g: &mut Gen, id: u64) -> (KeyClass, Raw) {
    let (class, key) = framing_key(g, id);
    let mut raw = Raw::new(g.method(), &target(id)).json();
    if let Some(key) = key {
        raw = raw.h("Idempotency-Key", key);
    }
    (class, raw)
}

/// After a body that broke off: the same key with a whole body must run.
fn unclaimed(class: KeyClass, id: u64) -> Then {
    if class == KeyClass::Valid {
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        Then::Unclaimed(raw.sized(br#"{"whole":true}"#))
    } else {
        Then::Nothing
    }
}

/// Bogus `Content-Length` values and lengths that do not match the body. The client half-closes
/// after the bytes, so that a body shorter than announced breaks off instead of waiting.
fn content_lengths(g: &mut Gen) {
    for _ in 0..6 {
        let body = small_body(0);
        for bogus in [
            "-1",
            "abc",
            "1e3",
            "0x10",
            "+5",
            "5 5",
            "99999999999999999999",
            "",
            "5,6",
            "007",
            " 5 ",
        ] {
            let id = g.id();
            let (class, raw) = framed_raw(g, id);
            let bytes = raw.h("Content-Length", bogus).then_raw(&body[..5]);
            // Dubious: hyper refuses most of these; the few it takes (leading zeros, list of one
            // value) are complete requests, answered by idem.
            g.push_raw(
                id,
                format!("Content-Length: {bogus:?}"),
                bytes,
                true,
                dubious(class),
                Then::Nothing,
            );
        }
        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw
            .h("Content-Length", "5")
            .h("Content-Length", "6")
            .then_raw(b"123456");
        g.raw(
            id,
            "two differing Content-Lengths",
            bytes,
            dubious(class),
            Then::Nothing,
        );

        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw.h("Content-Length", "5").h("Content-Length", "5").then_raw(b"12345");
        g.raw(id, "two equal Content-Lengths", bytes, dubious(class), Then::Nothing);

        // A body that breaks off: half of what was announced, then the client half-closes.
        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw.h("Content-Length", "100").then_raw(&body[..body.len().min(20)]);
        let then = unclaimed(class, id);
        g.push_raw(
            id,
            "Content-Length 100, 20 bytes, half-close",
            bytes,
            true,
            dubious(class),
            then,
        );

        // More body than announced: the rest is a broken second request.
        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw.h("Content-Length", "5").then_raw(b"12345GARBAGE\r\n\r\n");
        g.raw(id, "Content-Length 5, 16 bytes", bytes, dubious(class), Then::Nothing);

        // Both framings at once (a smuggling classic).
        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw
            .h("Content-Length", "3")
            .h("Transfer-Encoding", "chunked")
            .then_raw(&chunked(b"{}"));
        g.raw(id, "Content-Length and chunked", bytes, dubious(class), Then::Nothing);

        // Declared over --max-body, little sent.
        let id = g.id();
        let (class, raw) = framed_raw(g, id);
        let bytes = raw.h("Content-Length", (MAX_BODY * 2).to_string()).then_raw(b"[1,2,3");
        let spec = dubious(class).early_close();
        g.push_raw(
            id,
            "Content-Length 2 MiB, 6 bytes, half-close",
            bytes,
            true,
            spec,
            Then::Nothing,
        );
    }
}

/// Malformed chunked bodies, trailers, odd `Transfer-Encoding`s.
fn chunked_bodies(g: &mut Gen) {
    let body = small_body(0);
    for _ in 0..5 {
        let broken: Vec<(&str, Vec<u8>, bool)> = vec![
            ("bad chunk size", b"zz\r\nhello\r\n0\r\n\r\n".to_vec(), false),
            ("negative chunk size", b"-5\r\nhello\r\n0\r\n\r\n".to_vec(), false),
            (
                "chunk size overflow",
                b"ffffffffffffffffffff\r\nhello\r\n0\r\n\r\n".to_vec(),
                false,
            ),
            ("no CRLF after the data", b"5\r\nhelloXX0\r\n\r\n".to_vec(), false),
            ("chunk longer than its size", b"2\r\nhello\r\n0\r\n\r\n".to_vec(), false),
            ("LF only", b"5\nhello\n0\n\n".to_vec(), false),
            ("truncated data, half-close", b"10\r\nhello".to_vec(), true),
            ("truncated size line, half-close", b"1".to_vec(), true),
            ("no last chunk, half-close", b"5\r\nhello\r\n".to_vec(), true),
            (
                "bad trailer, half-close",
                b"5\r\nhello\r\n0\r\nno colon here\r\n\r\n".to_vec(),
                true,
            ),
        ];
        for (what, rest, half_close) in broken {
            let id = g.id();
            let (class, raw) = framed_raw(g, id);
            let bytes = raw.h("Transfer-Encoding", "chunked").then_raw(&rest);
            let then = if half_close {
                unclaimed(class, id)
            } else {
                Then::Nothing
            };
            g.push_raw(id, format!("chunked: {what}"), bytes, half_close, dubious(class), then);
        }
        for te in [
            "gzip, chunked",
            "chunked, gzip",
            "xchunked",
            "chunked, chunked",
            "identity",
        ] {
            let id = g.id();
            let (class, raw) = framed_raw(g, id);
            let bytes = raw.h("Transfer-Encoding", te).then_raw(&chunked(&body));
            g.raw(
                id,
                format!("Transfer-Encoding: {te}"),
                bytes,
                dubious(class),
                Then::Nothing,
            );
        }
        // Well-formed chunked bodies: a valid key runs, an invalid one is refused.
        for (what, rest) in [
            ("one chunk", chunked(&body)),
            (
                "chunk extensions",
                [
                    b"5;ext=1;q=\"x\"\r\n".as_slice(),
                    &body[..5],
                    b"\r\n",
                    format!("{:x}\r\n", body.len() - 5).as_bytes(),
                    &body[5..],
                    b"\r\n0\r\n\r\n",
                ]
                .concat(),
            ),
            (
                "one-byte chunks",
                body.iter()
                    .flat_map(|&b| [b'1', b'\r', b'\n', b, b'\r', b'\n'])
                    .chain(*b"0\r\n\r\n")
                    .collect(),
            ),
        ] {
            let id = g.id();
            let (class, raw) = framed_raw(g, id);
            let bytes = raw.h("Transfer-Encoding", "chunked").then_raw(&rest);
            let expect = match class {
                KeyClass::Invalid => Expect::Refused(400),
                _ => Expect::Success,
            };
            let then = if class == KeyClass::Valid {
                g.maybe_replay(50)
            } else {
                Then::Nothing
            };
            g.raw(
                id,
                format!("chunked: {what}"),
                bytes,
                Spec::new(class, true, expect),
                then,
            );
        }
        // A key in the trailers: the head decides; the trailers must not smuggle a key upstream.
        for (head_key, trailer_key) in [(None, "a b"), (None, "\"x"), (Some(()), "a b"), (None, "~trailer~")] {
            let id = g.id();
            let mut raw = Raw::new("POST", &target(id))
                .json()
                .h("Transfer-Encoding", "chunked")
                .h("Trailer", "Idempotency-Key");
            let class = match head_key {
                Some(()) => {
                    raw = raw.h("Idempotency-Key", token(id));
                    KeyClass::Valid
                }
                None => KeyClass::Absent,
            };
            let mut rest = format!("{:x}\r\n", body.len()).into_bytes();
            rest.extend_from_slice(&body);
            rest.extend_from_slice(format!("\r\n0\r\nIdempotency-Key: {trailer_key}\r\n\r\n").as_bytes());
            g.raw(
                id,
                format!("chunked with Idempotency-Key: {trailer_key} in the trailers"),
                raw.then_raw(&rest),
                runs(class),
                Then::Nothing,
            );
        }
        // Over --max-body without a Content-Length: refused once the limit is passed.
        let id = g.id();
        let raw = Raw::new("POST", &target(id))
            .json()
            .h("Idempotency-Key", token(id))
            .h("Transfer-Encoding", "chunked");
        let mut rest = Vec::new();
        let piece = vec![b'7'; 64 * 1024];
        for _ in 0..(MAX_BODY / piece.len() + 2) {
            rest.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
            rest.extend_from_slice(&piece);
            rest.extend_from_slice(b"\r\n");
        }
        rest.extend_from_slice(b"0\r\n\r\n");
        let spec = refused(KeyClass::Valid, 413).early_close();
        g.raw(
            id,
            "chunked body over --max-body",
            raw.then_raw(&rest),
            spec,
            Then::Nothing,
        );
    }
}

/// Bodies that are not JSON, or are JSON at its edges, under a valid key (they must run, and a
/// byte-identical retry must replay), and a few keyless.
fn hostile_bodies(g: &mut Gen) {
    let nested_ok = format!("{}{}", "[".repeat(127), "]".repeat(127));
    let nested_over = format!("{}{}", "[".repeat(128), "]".repeat(128));
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("100k [", vec![b'['; 100_000]),
        ("50k {\"a\":", "{\"a\":".repeat(50_000).into_bytes()),
        (
            "100k balanced []",
            format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
        ),
        ("nesting 127", nested_ok.into_bytes()),
        ("nesting 128", nested_over.into_bytes()),
        (
            "an integer of 300k digits",
            format!("1{}", "0".repeat(300_000)).into_bytes(),
        ),
        (
            "a decimal of 200k digits",
            format!("[0.{}1]", "0".repeat(200_000)).into_bytes(),
        ),
        ("a huge exponent", b"1e999999999999999999999".to_vec()),
        (
            "the largest exponent",
            b"[1e1000000000000000,-1e-1000000000000000]".to_vec(),
        ),
        ("just past the largest exponent", b"[1e1000000000000001]".to_vec()),
        (
            "a 40-digit exponent",
            b"[1e0000000000000000000000000000000000000001]".to_vec(),
        ),
        ("f64 overflow", b"[1e400,-1e400,1e-400]".to_vec()),
        ("2^53+1", b"{\"n\":9007199254740993}".to_vec()),
        (
            "50k big numbers",
            format!("[{}0]", "1.5e300,".repeat(50_000)).into_bytes(),
        ),
        ("-0 and 0", b"[-0,0,-0.0,0e5,-0E-5]".to_vec()),
        ("lone high surrogate", b"\"\\ud800\"".to_vec()),
        ("lone low surrogate", b"{\"s\":\"\\udc00\"}".to_vec()),
        ("high surrogate then a letter", b"[\"\\ud800\\u0041\"]".to_vec()),
        ("reversed surrogates", b"\"\\udc00\\ud800\"".to_vec()),
        ("surrogate pair", b"\"\\ud83d\\ude00\"".to_vec()),
        ("surrogate in a name", b"{\"\\ud800\":1}".to_vec()),
        ("truncated \\u", b"\"\\u12\"".to_vec()),
        ("\\u at the end", b"\"\\u".to_vec()),
        ("bad escape", b"\"\\x41\"".to_vec()),
        ("invalid UTF-8", b"{\"a\":\"\xff\xfe\"}".to_vec()),
        ("overlong UTF-8", b"\"\xc0\xaf\"".to_vec()),
        ("UTF-8 surrogate", b"\"\xed\xa0\x80\"".to_vec()),
        ("truncated UTF-8", b"\"\xe2\x82\"".to_vec()),
        ("BOM", b"\xef\xbb\xbf{}".to_vec()),
        ("NUL in a string", b"{\"a\":\"\x00\"}".to_vec()),
        ("NUL after", b"{}\x00".to_vec()),
        ("duplicate names", b"{\"a\":1,\"a\":2}".to_vec()),
        ("trailing comma", b"[1,]".to_vec()),
        ("unterminated", b"{\"a\":".to_vec()),
        ("unterminated string", b"\"abc".to_vec()),
        ("garbage after", b"{} x".to_vec()),
        ("two documents", b"{}{}".to_vec()),
        ("empty", Vec::new()),
        ("whitespace", b"   \n\t\r ".to_vec()),
        ("vertical tab", b"\x0b{}".to_vec()),
        ("literals", b"[true,false,null,tru,nul]".to_vec()),
        ("bad numbers", b"[01,1.,.5,+1,1e,--1,0x10,NaN,Infinity]".to_vec()),
        ("a 500 KB string", format!("\"{}\"", "a".repeat(500_000)).into_bytes()),
        ("100k escapes", format!("\"{}\"", "\\n".repeat(100_000)).into_bytes()),
        (
            "30k members",
            format!(
                "{{{}\"z\":0}}",
                (0..30_000).map(|i| format!("\"k{i}\":{i},")).collect::<String>()
            )
            .into_bytes(),
        ),
        (
            "30k equal names",
            format!("{{{}\"z\":0}}", "\"k\":1,".repeat(30_000)).into_bytes(),
        ),
        ("just under --max-body", vec![b' '; MAX_BODY]),
    ];
    let content_types: &[&[u8]] = &[
        b"application/json",
        b"application/json; charset=utf-8",
        b"APPLICATION/JSON",
        b"application/problem+json",
        b"application/vnd.x+json",
        b"application/json; charset=\xff\xfe",
        b"application/json, text/html",
        b"text/plain",
        b"\xff/\xfe",
    ];
    for round in 0..4 {
        for (what, body) in &bodies {
            let id = g.id();
            if round == 3 {
                // An invalid key is refused whatever the body; the gateway need not read a large
                // one first, and may close before it was all sent.
                let raw = Raw::new(g.method(), &target(id))
                    .json()
                    .h("Idempotency-Key", format!("\"{}", token(id)));
                let mut spec = refused(KeyClass::Invalid, 400);
                spec.early_close_ok = body.len() > 32 * 1024;
                g.raw(
                    id,
                    format!("body {what}, invalid key"),
                    raw.sized(body),
                    spec,
                    Then::Nothing,
                );
                continue;
            }
            let keyless = round == 2;
            let content_type = *g.rng.pick(content_types);
            let mut raw =
                Raw::new(if keyless { "POST" } else { g.method() }, &target(id)).h("Content-Type", content_type);
            let class = if keyless {
                KeyClass::Absent
            } else {
                raw = raw.h("Idempotency-Key", token(id));
                KeyClass::Valid
            };
            let then = if keyless { Then::Nothing } else { g.maybe_replay(60) };
            let what = format!("body {what} ({}, {class:?} key)", escape(content_type, 60));
            g.raw(id, what, raw.sized(body), runs(class), then);
        }
    }
    // Compressed request bodies that are not: idem may hash them as they are, or refuse them.
    for _ in 0..4 {
        for (coding, body) in [
            ("gzip", b"\x1f\x8b\x08\x00garbage".to_vec()),
            ("gzip", b"not gzip at all".to_vec()),
            ("gzip, br", b"{}".to_vec()),
            ("zstd", vec![0x28, 0xb5, 0x2f, 0xfd, 0xff, 0xff]),
            ("x-\u{fffd}", b"{}".to_vec()),
        ] {
            let id = g.id();
            let raw = Raw::new(g.method(), &target(id))
                .json()
                .h("Idempotency-Key", token(id))
                .h("Content-Encoding", coding);
            let then = g.maybe_replay(50);
            g.raw(
                id,
                format!("Content-Encoding: {coding} with a garbage body"),
                raw.sized(&body),
                either(KeyClass::Valid),
                then,
            );
        }
    }
    // Over --max-body, announced: 413, possibly before the body is read.
    for _ in 0..2 {
        let id = g.id();
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        let spec = refused(KeyClass::Valid, 413).early_close();
        g.raw(
            id,
            "body of --max-body + 1",
            raw.sized(&vec![b'1'; MAX_BODY + 1]),
            spec,
            Then::Nothing,
        );
        // A same-key retry with a different body after a mismatch is 422; checked here on a body
        // that is not JSON.
        let id = g.id();
        let raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", token(id));
        let other = raw.sized(b"{\"a\":1,\"a\":3}");
        g.raw(
            id,
            "not I-JSON, then another body under the same key",
            raw.sized(b"{\"a\":1,\"a\":2}"),
            runs(KeyClass::Valid),
            Then::Mismatch(other),
        );
    }
}

/// Replays of a gzip-encoded answer to clients with junk `Accept-Encoding`s, and of answers whose
/// bytes are not in their coding.
fn accept_encodings(g: &mut Gen) {
    let junk: &[&[u8]] = &[
        b"gzip;q=abc",
        b"*;q=0",
        b"identity;q=0, *;q=0",
        b"gzip;q=0",
        b"gzip;q=0, identity",
        b"\xff\xfe",
        b"br;q=1e9999",
        b"gzip;q=0.5;q=1",
        b"x-gzip",
        b"GZIP",
        b"gzip;q=-1",
        b"gzip;q=1.0000",
        b"gzip, gzip, gzip",
        b";;;",
        b"=",
        b"q=1",
        b"identity;q=0",
        b"zstd;q=0.001, br;q=0.002",
        b"*",
        b"gzip;Q=0",
        b"",
    ];
    for _ in 0..3 {
        for value in junk {
            let id = g.id();
            let raw = Raw::new("POST", &format!("{}/gz", target(id)))
                .json()
                .h("Idempotency-Key", token(id))
                .h("Accept-Encoding", value);
            g.raw(
                id,
                format!("gzip answer, Accept-Encoding: {}", escape(value, 60)),
                raw.sized(&small_body(id)),
                runs(KeyClass::Valid),
                Then::Replay,
            );
        }
        // A hostile upstream: answers labelled with a coding they are not in, and a bomb; replayed
        // to clients that accept only identity (so the gateway has to decode) or anything.
        for name in BROKEN_CODINGS {
            for accept in [&b"identity"[..], b"gzip;q=0, br;q=0, zstd;q=0, deflate;q=0", b"*"] {
                let id = g.id();
                let raw = Raw::new("POST", &format!("{}/bad-{name}", target(id)))
                    .json()
                    .h("Idempotency-Key", token(id))
                    .h("Accept-Encoding", accept);
                let what = format!("upstream answer bad-{name}, Accept-Encoding: {}", escape(accept, 60));
                g.raw(
                    id,
                    what,
                    raw.sized(&small_body(id)),
                    runs(KeyClass::Valid),
                    Then::ReplayAsStored,
                );
            }
        }
        let id = g.id();
        let long = ",".repeat(2000) + &"gzip;q=0.1,".repeat(500);
        let raw = Raw::new("POST", &format!("{}/gz", target(id)))
            .json()
            .h("Idempotency-Key", token(id))
            .h("Accept-Encoding", long);
        g.raw(
            id,
            "gzip answer, 7 KB Accept-Encoding",
            raw.sized(&small_body(id)),
            runs(KeyClass::Valid),
            Then::Replay,
        );
    }
}

/// Odd or non-UTF-8 headers beside a key.
fn odd_headers(g: &mut Gen) {
    let valid: &[(&str, &[u8], &[u8])] = &[
        ("non-UTF-8 header", b"X-Junk", b"\x80\xff\xfe"),
        ("non-UTF-8 credential", b"Authorization", b"Bearer \xff\xfe\x80"),
        ("non-UTF-8 Accept", b"Accept", b"\x80"),
        ("non-UTF-8 X-Forwarded-For", b"X-Forwarded-For", b"\xff"),
        ("non-UTF-8 Connection", b"Connection", b"\xff"),
        ("Connection naming the key", b"Connection", b"idempotency-key"),
        ("a forged Idempotency-Recovered", b"Idempotency-Recovered", b"true"),
        ("Expect: 100-continue", b"Expect", b"100-continue"),
        ("a bogus Expect", b"Expect", b"200-ok"),
        ("TE: trailers", b"TE", b"trailers"),
        ("Upgrade: h2c", b"Upgrade", b"h2c"),
        ("Upgrade: websocket", b"Upgrade", b"websocket"),
        ("Idempotency-Replayed from the client", b"Idempotency-Replayed", b"true"),
        (
            "Content-Type with NUL-free junk",
            b"Content-Type",
            b"application/json; boundary=\"\x80\"",
        ),
    ];
    for _ in 0..3 {
        for (what, name, value) in valid {
            let id = g.id();
            let raw = Raw::new(g.method(), &target(id))
                .json()
                .h("Idempotency-Key", token(id))
                .h(name, value);
            let then = g.maybe_replay(40);
            g.raw(
                id,
                format!("valid key, {what}"),
                raw.sized(&small_body(id)),
                runs(KeyClass::Valid),
                then,
            );
            // The same with an invalid key: refused before anything else.
            let id = g.id();
            let raw = Raw::new(g.method(), &target(id))
                .json()
                .h("Idempotency-Key", format!("{} x", token(id)))
                .h(name, value);
            g.raw(
                id,
                format!("invalid key, {what}"),
                raw.sized(&small_body(id)),
                refused(KeyClass::Invalid, 400),
                Then::Nothing,
            );
        }
        // Heads without Host, or with two.
        let id = g.id();
        let raw = Raw::new("POST", &target(id))
            .without("Host")
            .json()
            .h("Idempotency-Key", token(id));
        g.raw(
            id,
            "valid key, no Host",
            raw.sized(&small_body(id)),
            either(KeyClass::Valid),
            Then::Nothing,
        );
        let id = g.id();
        let raw = Raw::new("POST", &target(id))
            .h("Host", "evil.example")
            .json()
            .h("Idempotency-Key", token(id));
        g.raw(
            id,
            "valid key, two Hosts",
            raw.sized(&small_body(id)),
            dubious(KeyClass::Valid),
            Then::Nothing,
        );
        let id = g.id();
        let raw = Raw::new("POST", &target(id))
            .without("Host")
            .h("Host", b"\xff\xfe")
            .json()
            .h("Idempotency-Key", token(id));
        g.raw(
            id,
            "valid key, non-UTF-8 Host",
            raw.sized(&small_body(id)),
            dubious(KeyClass::Valid),
            Then::Nothing,
        );
        // Broken header lines: hyper refuses the head.
        for (what, line) in [
            ("space before the colon", &b"Idempotency-Key : a b"[..]),
            ("empty name", b": x"),
            ("name with a space", b"X Junk: 1"),
            ("obs-fold", b"X-Junk: a\r\n folded"),
            ("DEL in a value", b"X-Junk: a\x7fb"),
            ("NUL in a name", b"X-J\x00nk: 1"),
            ("no colon", b"Idempotency-Key a b"),
        ] {
            let id = g.id();
            let mut raw = Raw::new("POST", &target(id)).json().h("Idempotency-Key", "a b");
            raw.headers.push((line.to_vec(), Vec::new()));
            // `h` writes "name: value"; for these the whole line is in the name.
            let bytes = raw.sized(&small_body(id));
            let bytes = replace_all(&bytes, &[line, b": \r\n"].concat(), &[line, b"\r\n"].concat());
            g.raw(
                id,
                format!("invalid key, header line with {what}"),
                bytes,
                dubious(KeyClass::Invalid),
                Then::Nothing,
            );
        }
    }
}

/// Header lines given as (name, value).
type Headers<'a> = &'a [(&'a str, &'a [u8])];

fn replace_all(haystack: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut i = 0;
    while i < haystack.len() {
        if haystack[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(haystack[i]);
            i += 1;
        }
    }
    out
}

/// Odd request lines, pipelining, an HTTP/2 preface.
fn request_lines(g: &mut Gen) {
    for _ in 0..3 {
        // Well-formed HTTP, odd forms: idem must judge the key as usual.
        for (what, line, http_valid) in [
            ("HTTP/1.0", "POST {t} HTTP/1.0", true),
            ("absolute form", "POST http://127.0.0.1{t} HTTP/1.1", true),
            ("double slash", "POST /{t} HTTP/1.1", true),
            ("dot segments", "POST {t}/../../x HTTP/1.1", true),
            ("odd query", "POST {t}?a=%ZZ&b=%00&&=; HTTP/1.1", true),
            ("extra word", "POST {t} HTTP/1.1 x", false),
            ("HTTP/2.0 line", "POST {t} HTTP/2.0", false),
            ("HTTP/1.2", "POST {t} HTTP/1.2", false),
            ("lower-case version", "POST {t} http/1.1", false),
            ("no version", "POST {t}", false),
            ("tab separators", "POST\t{t}\tHTTP/1.1", false),
            ("two spaces", "POST  {t} HTTP/1.1", false),
            ("fragment", "POST {t}#frag HTTP/1.1", false),
            ("asterisk", "POST * HTTP/1.1", false),
            ("NUL in the target", "POST {t}\0 HTTP/1.1", false),
            ("non-UTF-8 target", "POST {t}?\u{ff} HTTP/1.1", false),
        ] {
            for valid_key in [true, false] {
                let id = g.id();
                let line = line.replace("{t}", &target(id));
                let line = if what == "non-UTF-8 target" {
                    replace_all(line.as_bytes(), "\u{ff}".as_bytes(), b"\xff")
                } else {
                    line.into_bytes()
                };
                let key = if valid_key {
                    token(id)
                } else {
                    format!("{} x", token(id))
                };
                let raw = Raw::line(line).json().h("Idempotency-Key", key);
                let (class, expect) = match (valid_key, http_valid) {
                    (_, false) => (
                        if valid_key { KeyClass::Valid } else { KeyClass::Invalid },
                        Expect::Anything,
                    ),
                    (true, true) => (KeyClass::Valid, Expect::Success),
                    (false, true) => (KeyClass::Invalid, Expect::Refused(400)),
                };
                let what = format!("request line: {what}, {class:?} key");
                g.raw(
                    id,
                    what,
                    raw.sized(&small_body(id)),
                    Spec::new(class, http_valid, expect),
                    Then::Nothing,
                );
            }
        }
        // Two requests in one write, without bodies (so nothing needs draining in between).
        for (first_valid, second_valid) in [(false, false), (true, false), (false, true), (true, true)] {
            let (a, b) = (g.id(), g.id());
            let key = |id: u64, valid: bool| if valid { token(id) } else { format!("\"{}", token(id)) };
            let first = Raw::new("POST", &target(a))
                .without("Connection")
                .json()
                .h("Idempotency-Key", key(a, first_valid));
            let second = Raw::new("POST", &target(b))
                .json()
                .h("Idempotency-Key", key(b, second_valid));
            let bytes = [first.sized(b""), second.sized(b"")].concat();
            let spec = |valid: bool| {
                if valid {
                    runs(KeyClass::Valid)
                } else {
                    refused(KeyClass::Invalid, 400)
                }
            };
            let specs = vec![spec(first_valid), spec(second_valid)];
            let reach = vec![(a, specs[0].reach(&Then::Nothing)), (b, specs[1].reach(&Then::Nothing))];
            g.cases.push(Case {
                id: a,
                what: format!("pipelined: {first_valid} key then {second_valid} key"),
                sending: Sending::Raw {
                    bytes,
                    half_close: false,
                },
                specs,
                then: Then::Nothing,
                reach,
            });
        }
        // An HTTP/2 preface, then junk; and an HTTP/2 preface then a keyed HTTP/1.1 request.
        let id = g.id();
        g.raw(
            id,
            "HTTP/2 preface then junk",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x04\xff\xff\xff\xff\xff\xff\xff\xff".to_vec(),
            dubious(KeyClass::Absent),
            Then::Nothing,
        );
        let id = g.id();
        let http1 = Raw::new("POST", &target(id))
            .json()
            .h("Idempotency-Key", "a b")
            .sized(&small_body(id));
        g.raw(
            id,
            "HTTP/2 preface then HTTP/1.1",
            [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".as_slice(), &http1].concat(),
            dubious(KeyClass::Invalid),
            Then::Nothing,
        );
        let id = g.id();
        let junk: Vec<u8> = (0..512).map(|_| g.rng.next() as u8).collect();
        g.raw(id, "binary junk", junk, dubious(KeyClass::Absent), Then::Nothing);
        let id = g.id();
        g.raw(
            id,
            "TLS ClientHello",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03".to_vec(),
            dubious(KeyClass::Absent),
            Then::Nothing,
        );
    }
}

/// Well-formed keyed requests with random valid keys, sent by a real client, each retried.
fn well_formed(g: &mut Gen, count: usize) {
    for _ in 0..count {
        let id = g.id();
        let t = token(id);
        let kind = g.rng.below(10);
        let (key, quoted) = match kind {
            0 => (uuid_v7_at(now_millis()), false),
            1 => (format!("{t}{:016x}{:016x}", g.rng.next(), g.rng.next()), false),
            _ => {
                let len = g.rng.below(256 - t.len());
                let mut key = t.clone();
                for _ in 0..len {
                    let c = (0x21 + g.rng.below(94) as u8) as char;
                    key.push(if c == '~' { '+' } else { c });
                }
                let needs_quotes = key.contains(['"', ',', '\\']);
                (key, needs_quotes || g.rng.chance(40))
            }
        };
        let header = if quoted {
            format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
        } else {
            key.clone()
        };
        let amount = g.rng.below(1_000_000);
        let note: String = (0..g.rng.below(40))
            .map(|_| (b'a' + g.rng.below(26) as u8) as char)
            .collect();
        let body = format!(r#"{{"amount":{amount},"currency":"EUR","note":"{note}"}}"#);
        let (retry, then) = match g.rng.below(20) {
            // The same value serialised differently still replays.
            0..=7 => (
                format!(r#"{{ "note": "{note}", "currency": "EUR", "amount": {amount} }}"#),
                Then::Replay,
            ),
            8 => (
                format!(r#"{{"amount":{},"currency":"EUR","note":"{note}"}}"#, amount + 1),
                Then::Mismatch(Vec::new()),
            ),
            _ => (body.clone(), Then::Replay),
        };
        let spec = runs(KeyClass::Valid);
        g.cases.push(Case {
            id,
            what: format!("well-formed, Idempotency-Key: {header}"),
            sending: Sending::Client {
                key: header,
                body,
                retry,
            },
            specs: vec![spec],
            reach: vec![(id, Reach::Once)],
            then,
        });
    }
    // Time-ordered keys older than --ttl: refused as expired, never run.
    for _ in 0..20 {
        let id = g.id();
        let key = uuid_v7_at(now_millis() - 3 * 24 * 3600 * 1000);
        let spec = refused(KeyClass::Expired, 422);
        g.cases.push(Case {
            id,
            what: format!("UUIDv7 key from three days ago: {key}"),
            sending: Sending::Client {
                key,
                body: "{}".into(),
                retry: "{}".into(),
            },
            specs: vec![spec],
            reach: vec![(id, Reach::Never)],
            then: Then::Nothing,
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Sending and reading answers
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    /// False if the connection ended before the whole body came.
    complete: bool,
}

impl Answer {
    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    fn is_problem(&self) -> bool {
        self.header("content-type")
            .is_some_and(|ct| ct.trim().to_ascii_lowercase().starts_with("application/problem+json"))
    }

    fn by_upstream(&self) -> bool {
        self.header("x-upstream").is_some()
    }

    fn replayed(&self) -> bool {
        self.header("idempotency-replayed")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "?1")
    }

    fn problem_type(&self) -> Option<String> {
        json_field(&String::from_utf8_lossy(&self.body), "type")
    }

    fn label(&self) -> String {
        match (self.is_problem(), self.problem_type()) {
            (true, Some(kind)) => format!("{} {}", self.status, kind.rsplit(':').next().unwrap_or(&kind)),
            _ if self.by_upstream() => format!("{} upstream", self.status),
            _ if self.replayed() => format!("{} replayed", self.status),
            _ => format!("{} other", self.status),
        }
    }

    fn describe(&self) -> String {
        let headers: Vec<String> = self
            .headers
            .iter()
            .map(|(n, v)| format!("{n}: {}", escape(v, 80)))
            .collect();
        format!(
            "{}{} [{}] body={}",
            self.status,
            if self.complete { "" } else { " (body broke off)" },
            headers.join("; "),
            escape(&self.body, 300)
        )
    }
}

/// How an exchange ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ending {
    /// All the answers wanted came.
    Answered,
    /// The server closed the connection.
    Closed,
    /// The connection broke (reset).
    Broken(String),
    /// Neither an answer nor a close within [`ANSWER_LIMIT`]: a hang.
    TimedOut,
    /// The bytes that came back are not HTTP/1.x.
    NotHttp(String),
    /// Could not connect at all.
    ConnectFailed(String),
}

#[derive(Default)]
struct Parsed {
    answers: Vec<Answer>,
    not_http: bool,
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Parses as many answers as `buf` holds (1xx answers skipped). At `eof`, a last answer whose body
/// is incomplete is returned too, marked incomplete.
fn parse_answers(buf: &[u8], eof: bool) -> Parsed {
    let mut parsed = Parsed::default();
    let mut pos = 0;
    while pos < buf.len() {
        let rest = &buf[pos..];
        let prefix = &rest[..rest.len().min(7)];
        if !b"HTTP/1.".starts_with(prefix) {
            parsed.not_http = true;
            return parsed;
        }
        let Some(end) = find(rest, b"\r\n\r\n") else {
            return parsed;
        };
        let mut lines = rest[..end]
            .split(|&b| b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
        let status_line = String::from_utf8_lossy(lines.next().unwrap_or_default()).into_owned();
        let Some(status) = status_line.split(' ').nth(1).and_then(|s| s.parse::<u16>().ok()) else {
            parsed.not_http = true;
            return parsed;
        };
        let headers: Vec<(String, Vec<u8>)> = lines
            .filter_map(|line| {
                let colon = line.iter().position(|&b| b == b':')?;
                let name = String::from_utf8_lossy(&line[..colon]).trim().to_ascii_lowercase();
                Some((name, line[colon + 1..].trim_ascii().to_vec()))
            })
            .collect();
        let body_start = pos + end + 4;
        let header = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        };
        if (100..200).contains(&status) {
            pos = body_start;
            continue;
        }
        let (body, consumed, complete) = if status == 204 || status == 304 {
            (Vec::new(), 0, true)
        } else if header("transfer-encoding").is_some_and(|te| te.to_ascii_lowercase().contains("chunked")) {
            match dechunk(&buf[body_start..]) {
                Some((body, consumed)) => (body, consumed, true),
                None if eof => (buf[body_start..].to_vec(), buf.len() - body_start, false),
                None => return parsed,
            }
        } else if let Some(len) = header("content-length").and_then(|l| l.trim().parse::<usize>().ok()) {
            if buf.len() - body_start >= len {
                (buf[body_start..body_start + len].to_vec(), len, true)
            } else if eof {
                (buf[body_start..].to_vec(), buf.len() - body_start, false)
            } else {
                return parsed;
            }
        } else if eof {
            (buf[body_start..].to_vec(), buf.len() - body_start, true)
        } else {
            return parsed;
        };
        parsed.answers.push(Answer {
            status,
            headers,
            body,
            complete,
        });
        pos = body_start + consumed;
    }
    parsed
}

/// A chunked body: its data and how many bytes it took, if it is all there.
fn dechunk(buf: &[u8]) -> Option<(Vec<u8>, usize)> {
    let mut body = Vec::new();
    let mut pos = 0;
    loop {
        let line_end = pos + find(&buf[pos..], b"\r\n")?;
        let size_text = String::from_utf8_lossy(&buf[pos..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        pos = line_end + 2;
        if size == 0 {
            let end = pos + find(&buf[pos..], b"\r\n")?;
            // Trailers, if any, end with an empty line.
            let end = if end == pos {
                end
            } else {
                pos + find(&buf[pos..], b"\r\n\r\n")? + 2
            };
            return Some((body, end + 2));
        }
        if buf.len() < pos + size + 2 {
            return None;
        }
        body.extend_from_slice(&buf[pos..pos + size]);
        pos += size + 2;
    }
}

/// Writes `bytes` on a new connection (half-closing after them if asked) while reading, until
/// `want` answers came, the server closed, or [`ANSWER_LIMIT`] passed.
async fn exchange(addr: SocketAddr, bytes: &[u8], half_close: bool, want: usize) -> (Vec<Answer>, Ending) {
    let mut stream = match tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(err)) => return (Vec::new(), Ending::ConnectFailed(err.to_string())),
        Err(_) => return (Vec::new(), Ending::ConnectFailed("timed out".into())),
    };
    let _ = stream.set_nodelay(true);
    // Borrowed halves: dropping them does not shut the write side down.
    let (mut reader, mut writer) = stream.split();
    let write = async {
        let written = writer.write_all(bytes).await;
        if written.is_ok() && half_close {
            let _ = writer.shutdown().await;
        }
    };
    let read = async {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            match reader.read(&mut chunk).await {
                Ok(0) => return (parse_answers(&buf, true), Ending::Closed),
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    let parsed = parse_answers(&buf, false);
                    if parsed.not_http {
                        return (parsed, Ending::NotHttp(escape(&buf, 60)));
                    }
                    if parsed.answers.len() >= want {
                        return (parsed, Ending::Answered);
                    }
                }
                Err(err) => return (parse_answers(&buf, true), Ending::Broken(err.to_string())),
            }
        }
    };
    let read = tokio::time::timeout(ANSWER_LIMIT, read);
    tokio::pin!(write, read);
    let mut writing = true;
    loop {
        tokio::select! {
            () = &mut write, if writing => writing = false,
            outcome = &mut read => {
                return match outcome {
                    Ok((parsed, ending)) => (parsed.answers, ending),
                    Err(_) => (Vec::new(), Ending::TimedOut),
                };
            }
        }
    }
}

fn from_reply(reply: common::Reply) -> Answer {
    Answer {
        status: reply.status,
        headers: reply
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect(),
        body: reply.body.to_vec(),
        complete: true,
    }
}

// ---------------------------------------------------------------------------------------------
// Judging
// ---------------------------------------------------------------------------------------------

/// The rules for every answer, then the case's expectation.
fn judge(spec: &Spec, answer: Option<&Answer>, ending: &Ending) -> Result<(), String> {
    let Some(answer) = answer else {
        return match ending {
            Ending::TimedOut => Err(format!(
                "no answer and no close within {ANSWER_LIMIT:?}: the gateway hung"
            )),
            Ending::ConnectFailed(err) => Err(format!("could not connect to the gateway: {err}")),
            _ if !spec.http_valid || spec.early_close_ok => Ok(()),
            other => Err(format!("no answer ({other:?}) to a well-formed HTTP/1.1 request")),
        };
    };
    if answer.status >= 500 {
        return Err(format!(
            "a {} answer (nothing here is the upstream's fault)",
            answer.status
        ));
    }
    if !answer.complete && spec.http_valid {
        return Err("the answer's body broke off".into());
    }
    match answer.status {
        200..=299 => {
            if matches!(spec.key, KeyClass::Invalid | KeyClass::Expired) {
                return Err(format!("a request with an {:?} key got a {}", spec.key, answer.status));
            }
            if !answer.by_upstream() {
                return Err("a 2xx that the upstream did not write (a first request cannot be a replay)".into());
            }
        }
        400..=499 => {
            if !answer.is_problem() {
                // hyper's own refusals of a malformed head: 400, 414 or 431 with no content type;
                // or the upstream's answer to a streamed body that broke off.
                let hyper = matches!(answer.status, 400 | 414 | 431) && answer.header("content-type").is_none();
                if spec.http_valid || !(hyper || answer.by_upstream()) {
                    return Err(format!("a {} that is not application/problem+json", answer.status));
                }
            }
        }
        other => return Err(format!("an unexpected {other}")),
    }
    let ok = |cond: bool, what: &str| if cond { Ok(()) } else { Err(format!("expected {what}")) };
    let success = (200..300).contains(&answer.status) && answer.by_upstream();
    match spec.expect {
        Expect::Success => ok(success, "a 2xx from the upstream"),
        Expect::Refused(status) => ok(
            answer.status == status && answer.is_problem(),
            &format!("a {status} problem"),
        ),
        Expect::Either => ok(
            success || answer.is_problem(),
            "a 2xx from the upstream or a 4xx problem",
        ),
        Expect::Anything => Ok(()),
    }
}

/// A replay: 2xx, marked replayed, not from the upstream, its body decoding as its headers say.
fn judge_replay(answer: Option<&Answer>, ending: &Ending, decodes: bool) -> Result<(), String> {
    let Some(answer) = answer else {
        return Err(format!("no answer to the retry ({ending:?})"));
    };
    if !(200..300).contains(&answer.status) || !answer.replayed() || answer.by_upstream() || !answer.complete {
        return Err("expected the retry to be a replay (2xx, Idempotency-Replayed: true)".into());
    }
    if !decodes {
        return Ok(());
    }
    let body = match answer.header("content-encoding").as_deref().map(str::trim) {
        None | Some("") | Some("identity") => Some(answer.body.clone()),
        Some(coding) if coding.eq_ignore_ascii_case("gzip") => gunzip(&answer.body),
        Some(coding) => return Err(format!("a replay in an unexpected coding {coding:?}")),
    };
    match body {
        Some(body) if String::from_utf8_lossy(&body).contains("\"case\"") => Ok(()),
        Some(_) => Err("the replay's body is not the upstream's answer".into()),
        None => Err("the replay's body does not decode as its Content-Encoding says".into()),
    }
}

fn judge_follow_up(expect: Expect, answer: Option<&Answer>, ending: &Ending) -> Result<(), String> {
    let spec = Spec::new(KeyClass::Valid, true, expect);
    judge(&spec, answer, ending)?;
    match answer {
        Some(answer) if answer.replayed() => Err("the follow-up was answered as a replay".into()),
        _ => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------------
// Running
// ---------------------------------------------------------------------------------------------

struct Ctx {
    addr: SocketAddr,
    base: String,
    client: reqwest::Client,
    seed: u64,
    /// `IDEM_HOSTILE_VERBOSE=1`: print every case's answers.
    verbose: bool,
}

#[derive(Default)]
struct Tally {
    requests: AtomicUsize,
    failures: Mutex<Vec<String>>,
    labels: Mutex<BTreeMap<String, usize>>,
    endings: Mutex<BTreeMap<String, usize>>,
}

impl Tally {
    fn count(&self, answers: &[Answer], ending: &Ending) {
        let mut labels = self.labels.lock().unwrap();
        for answer in answers {
            *labels.entry(answer.label()).or_default() += 1;
        }
        let ending = match ending {
            Ending::Broken(_) => "broken".to_owned(),
            Ending::NotHttp(_) => "not HTTP".to_owned(),
            Ending::ConnectFailed(_) => "connect failed".to_owned(),
            other => format!("{other:?}").to_lowercase(),
        };
        *self.endings.lock().unwrap().entry(ending).or_default() += 1;
    }

    fn fail(&self, ctx: &Ctx, case: &Case, step: &str, why: String, answer: Option<&Answer>, ending: &Ending) {
        let request = match &case.sending {
            Sending::Raw { bytes, half_close } => {
                format!(
                    "{}{}",
                    escape(bytes, 400),
                    if *half_close { " <half-close>" } else { "" }
                )
            }
            Sending::Client { key, body, .. } => format!("reqwest POST /h/{} key {key:?} body {body}", case.id),
        };
        self.failures.lock().unwrap().push(format!(
            "case {} [{}; key {:?}] ({step}): {why}\n    request: {request}\n    answer: {}\n    ending: {ending:?} (seed {})",
            case.id,
            case.what,
            case.specs.iter().map(|s| s.key).collect::<Vec<_>>(),
            answer.map_or_else(|| "none".to_owned(), Answer::describe),
            ctx.seed,
        ));
    }
}

async fn run_case(ctx: &Ctx, case: &Case, tally: &Tally) {
    let (answers, ending) = match &case.sending {
        Sending::Raw { bytes, half_close } => exchange(ctx.addr, bytes, *half_close, case.specs.len()).await,
        Sending::Client { key, body, .. } => client_send(ctx, case.id, key, body).await,
    };
    tally.requests.fetch_add(1, Ordering::Relaxed);
    tally.count(&answers, &ending);
    if ctx.verbose {
        let labels: Vec<String> = answers.iter().map(Answer::label).collect();
        let keys: Vec<KeyClass> = case.specs.iter().map(|s| s.key).collect();
        eprintln!(
            "hostile: case {} [{}; key {keys:?}] -> {labels:?} {ending:?}",
            case.id, case.what
        );
    }
    let mut all_good = true;
    for (i, spec) in case.specs.iter().enumerate() {
        if let Err(why) = judge(spec, answers.get(i), &ending) {
            all_good = false;
            tally.fail(ctx, case, &format!("answer {}", i + 1), why, answers.get(i), &ending);
        }
    }
    if !all_good {
        return;
    }
    // A retry is a replay (or a mismatch) only of a first request that ran; an `Either` case may
    // have been refused.
    let ran = answers
        .first()
        .is_some_and(|a| (200..300).contains(&a.status) && a.by_upstream());
    if matches!(case.then, Then::Replay | Then::ReplayAsStored | Then::Mismatch(_)) && !ran {
        return;
    }
    let (step, expect, answers, ending) = match (&case.then, &case.sending) {
        (Then::Nothing, _) => return,
        (Then::Replay, Sending::Raw { bytes, .. }) => {
            let (answers, ending) = exchange(ctx.addr, bytes, false, 1).await;
            ("replay", None, answers, ending)
        }
        (Then::ReplayAsStored, Sending::Raw { bytes, .. }) => {
            let (answers, ending) = exchange(ctx.addr, bytes, false, 1).await;
            (
                "replay of an answer that does not decode",
                Some(Expect::Success),
                answers,
                ending,
            )
        }
        (Then::ReplayAsStored, Sending::Client { .. }) => unreachable!("only raw cases replay broken codings"),
        (Then::Replay, Sending::Client { key, retry, .. }) => {
            let (answers, ending) = client_send(ctx, case.id, key, retry).await;
            ("replay", None, answers, ending)
        }
        (Then::Mismatch(bytes), Sending::Raw { .. }) => {
            let (answers, ending) = exchange(ctx.addr, bytes, false, 1).await;
            ("mismatch", Some(Expect::Refused(422)), answers, ending)
        }
        (Then::Mismatch(_), Sending::Client { key, retry, .. }) => {
            let (answers, ending) = client_send(ctx, case.id, key, retry).await;
            ("mismatch", Some(Expect::Refused(422)), answers, ending)
        }
        (Then::Unclaimed(bytes), _) => {
            let (answers, ending) = exchange(ctx.addr, bytes, false, 1).await;
            (
                "whole retry after a broken body",
                Some(Expect::Success),
                answers,
                ending,
            )
        }
    };
    tally.requests.fetch_add(1, Ordering::Relaxed);
    tally.count(&answers, &ending);
    let verdict = match expect {
        None => judge_replay(answers.first(), &ending, true),
        Some(_) if matches!(case.then, Then::ReplayAsStored) => judge_replay(answers.first(), &ending, false),
        Some(expect) => judge_follow_up(expect, answers.first(), &ending),
    };
    if let Err(why) = verdict {
        tally.fail(ctx, case, step, why, answers.first(), &ending);
    }
}

async fn client_send(ctx: &Ctx, id: u64, key: &str, body: &str) -> (Vec<Answer>, Ending) {
    let request = ctx
        .client
        .post(format!("{}{}", ctx.base, target(id)))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned());
    match try_send(request).await {
        Ok(reply) => (vec![from_reply(reply)], Ending::Answered),
        Err(err) => (Vec::new(), Ending::Broken(err)),
    }
}

/// Whether the process is alive (not a zombie), where `/proc` can tell.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| !matches!(state, 'Z' | 'X')),
        Err(_) => !cfg!(target_os = "linux"),
    }
}

/// The upstream's log sees what the test relies on: every value of a key header and keys in
/// trailers (sent here directly, not through the gateway). Clears the log afterwards.
async fn check_the_upstream_log(url: &str, log: &UpstreamLog) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_never_crash_the_gateway_nor_reach_the_upstream_with_an_invalid_key() {
    let seed = seed();
    eprintln!("hostile: seed {seed} (replay this run with IDEM_HOSTILE_SEED={seed})");
    let started = Instant::now();
    let (upstream_url, log, _upstream) = start_upstream().await;
    check_the_upstream_log(&upstream_url, &log).await;
    let gw = Gateway::start(&upstream_url, &[]).await;

    let mut g = Gen {
        rng: Rng(seed),
        next: 0,
        cases: Vec::new(),
    };
    key_bytes(&mut g);
    key_shapes(&mut g);
    key_fuzz(&mut g, 1500);
    repeated_headers(&mut g);
    huge_heads(&mut g);
    content_lengths(&mut g);
    chunked_bodies(&mut g);
    hostile_bodies(&mut g);
    accept_encodings(&mut g);
    odd_headers(&mut g);
    request_lines(&mut g);
    well_formed(&mut g, 800);
    let mut cases = std::mem::take(&mut g.cases);
    g.rng.shuffle(&mut cases);
    let expected_reach: Vec<(u64, Reach, usize)> = cases
        .iter()
        .enumerate()
        .flat_map(|(i, case)| case.reach.iter().map(move |&(id, reach)| (id, reach, i)))
        .collect();
    eprintln!("hostile: {} cases generated in {:?}", cases.len(), started.elapsed());

    let ctx = Arc::new(Ctx {
        addr: gw.addr(),
        base: gw.base.clone(),
        client: gw.client.clone(),
        seed,
        verbose: std::env::var_os("IDEM_HOSTILE_VERBOSE").is_some(),
    });
    let cases = Arc::new(cases);
    let tally = Arc::new(Tally::default());
    let next = Arc::new(AtomicU64::new(0));
    let sending = Instant::now();
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (ctx, cases, tally, next) = (ctx.clone(), cases.clone(), tally.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    let Some(case) = cases.get(i) else { break };
                    run_case(&ctx, case, &tally).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("a worker panicked");
    }
    let sent = tally.requests.load(Ordering::Relaxed);
    eprintln!(
        "hostile: {sent} requests answered or refused in {:?}",
        sending.elapsed()
    );

    // 1. The gateway is still up and still does its job.
    let pid = gw.pid();
    let mut failures = std::mem::take(&mut *tally.failures.lock().unwrap());
    if !alive(pid) {
        failures.push(format!("the gateway process {pid} died"));
    }
    let final_key = common::new_key();
    let final_body = r#"{"amount":1,"currency":"EUR"}"#;
    match try_send(
        gw.post("/h/0/final", final_body)
            .header("content-type", "application/json")
            .header("idempotency-key", &final_key),
    )
    .await
    {
        Ok(first) if first.status == 201 && !first.replayed() => {
            match try_send(
                gw.post("/h/0/final", final_body)
                    .header("content-type", "application/json")
                    .header("idempotency-key", &final_key),
            )
            .await
            {
                Ok(second) if second.status == 201 && second.replayed() && second.body == first.body => {}
                other => failures.push(format!("the final retry was not a replay: {other:?}")),
            }
        }
        other => failures.push(format!("the final well-formed request did not get 201: {other:?}")),
    }
    let stderr = gw.stderr();
    if let Some(at) = stderr.find("panicked") {
        let from = stderr[..at].rfind('\n').map_or(0, |i| i + 1);
        let line = stderr[from..].lines().next().unwrap_or_default();
        failures.push(format!("the gateway logged a panic: {line}"));
    }

    // 3. What reached the upstream. Give handlers of abandoned connections a moment to arrive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let arrivals = std::mem::take(&mut *log.arrivals.lock().unwrap());
    let mut counts: HashMap<u64, usize> = HashMap::new();
    for arrival in &arrivals {
        if let Some(case) = arrival.case {
            *counts.entry(case).or_default() += 1;
        }
        let shown = |keys: &[Vec<u8>]| keys.iter().map(|k| escape(k, 100)).collect::<Vec<_>>().join(" | ");
        let keys_valid = library_accepts(&arrival.keys) && arrival.keys.iter().all(|k| key_is_valid(k));
        if !arrival.keys.is_empty() && !keys_valid {
            failures.push(format!(
                "an invalid key reached the upstream: {} {} with Idempotency-Key {}",
                arrival.method,
                arrival.target,
                shown(&arrival.keys)
            ));
        }
        if arrival.trailer_keys.iter().any(|k| !key_is_valid(k)) {
            failures.push(format!(
                "an invalid key reached the upstream in the trailers: {} {} with {}",
                arrival.method,
                arrival.target,
                shown(&arrival.trailer_keys)
            ));
        }
        if !arrival.recovered.is_empty() {
            failures.push(format!(
                "Idempotency-Recovered reached the upstream although nothing crashed: {} {}",
                arrival.method, arrival.target
            ));
        }
    }
    for (id, reach, index) in expected_reach {
        let seen = counts.get(&id).copied().unwrap_or(0);
        let case = &cases[index];
        let wrong = match reach {
            Reach::Never => seen != 0,
            Reach::Once => seen != 1,
            Reach::Any => false,
        };
        if wrong {
            failures.push(format!(
                "case {id} [{}]: the upstream saw it {seen} time(s), expected {reach:?}",
                case.what
            ));
        }
    }

    let keyed = arrivals.iter().filter(|a| !a.keys.is_empty()).count();
    let trailed = arrivals.iter().filter(|a| !a.trailer_keys.is_empty()).count();
    let broken = arrivals.iter().filter(|a| a.broken_body).count();
    eprintln!(
        "hostile: upstream arrivals with a key header: {keyed}, with a key in the trailers: {trailed}, \
         whose body broke off: {broken}"
    );
    eprintln!("hostile: answers by kind: {:?}", tally.labels.lock().unwrap());
    eprintln!("hostile: exchanges by ending: {:?}", tally.endings.lock().unwrap());
    eprintln!(
        "hostile: the upstream was called {} times; total run time {:?}",
        arrivals.len(),
        started.elapsed()
    );
    assert!(sent >= 3000, "only {sent} requests were sent");
    if !failures.is_empty() {
        let shown: Vec<&String> = failures.iter().take(40).collect();
        panic!(
            "{} failure(s) with seed {seed} (IDEM_HOSTILE_SEED={seed} replays the run); the first {}:\n{}",
            failures.len(),
            shown.len(),
            shown.iter().map(|f| f.as_str()).collect::<Vec<_>>().join("\n")
        );
    }
}
