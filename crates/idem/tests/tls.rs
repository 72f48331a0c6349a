//! TLS and HTTP/2 on both sides of `idem serve`: `https://` upstreams checked against a CA given
//! with `--upstream-ca`, the TLS listener (`--tls-cert`, `--tls-key`) with HTTP/2 by ALPN, h2c by
//! prior knowledge on the plain listener and (when asked) to the upstream, and the flag
//! combinations refused at start. Every certificate is made here, by a test CA of its own.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Version, header};
use axum::response::Response;
use axum::routing::post;
use common::{Gateway, Reply, describe, new_key, send};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idem_test_support::task::AbortOnDrop;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt as _;

const PAY_BODY: &str = r#"{"amount":1000,"currency":"EUR"}"#;

// ---------------------------------------------------------------------------------------------
// Certificates
// ---------------------------------------------------------------------------------------------

/// A test CA and a directory for the PEM files it issues.
struct Pki {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, PEM.
    ca_pem: String,
    dir: tempfile::TempDir,
}

/// A certificate and its key, as PEM files.
struct Issued {
    cert: PathBuf,
    key: PathBuf,
}

impl Pki {
    fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("idem test CA {name}"));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let pki = Self {
            issuer: Issuer::new(params, key),
            ca_pem: cert.pem(),
            dir: tempfile::tempdir().unwrap(),
        };
        std::fs::write(pki.ca_path(), &pki.ca_pem).unwrap();
        pki
    }

    /// The CA certificate's PEM file, for `--upstream-ca`.
    fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A server certificate for `localhost` and `127.0.0.1`, signed by this CA.
    fn server(&self, name: &str) -> Issued {
        let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let issued = Issued {
            cert: self.dir.path().join(format!("{name}.crt")),
            key: self.dir.path().join(format!("{name}.key")),
        };
        std::fs::write(&issued.cert, cert.pem()).unwrap();
        std::fs::write(&issued.key, key.serialize_pem()).unwrap();
        issued
    }

    /// A client that trusts this CA only, never a proxy.
    fn client(&self) -> reqwest::ClientBuilder {
        reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(30))
            .tls_certs_only([reqwest::Certificate::from_pem(self.ca_pem.as_bytes()).unwrap()])
    }
}

/// Server TLS for `issued`, offering `alpn` (preferred first).
fn acceptor(issued: &Issued, alpn: &[&[u8]]) -> TlsAcceptor {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_file_iter(&issued.cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(&issued.key).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    TlsAcceptor::from(Arc::new(config))
}

// ---------------------------------------------------------------------------------------------
// An upstream that says which protocol reached it
// ---------------------------------------------------------------------------------------------

/// What one request to the upstream carried.
#[derive(Debug, Clone)]
struct Seen {
    version: Version,
    headers: HeaderMap,
}

#[derive(Debug, Default)]
struct Counts {
    pay: AtomicUsize,
    seen: Mutex<Vec<Seen>>,
}

impl Counts {
    fn record(&self, version: Version, headers: &HeaderMap) {
        self.seen.lock().unwrap().push(Seen {
            version,
            headers: headers.clone(),
        });
    }

    fn pay(&self) -> usize {
        self.pay.load(Ordering::SeqCst)
    }

    fn versions(&self) -> Vec<Version> {
        self.seen.lock().unwrap().iter().map(|s| s.version).collect()
    }

    fn last(&self) -> Seen {
        self.seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("the upstream was called")
    }
}

/// An upstream on 127.0.0.1, plain (HTTP/1.1 and h2c) or over TLS (as its ALPN says), with
/// `POST /pay` (201, `{"charge":N}`) and `POST /chunked` (201, a body without a length, so that
/// HTTP/1.1 sends it chunked). Stops when dropped.
struct TestUpstream {
    addr: SocketAddr,
    counts: Arc<Counts>,
    _task: AbortOnDrop,
}

impl TestUpstream {
    async fn start(tls: Option<TlsAcceptor>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Counts::default());
        let app = Router::new()
            .route("/pay", post(pay).get(read))
            .route("/chunked", post(chunked))
            .with_state(counts.clone());
        let _task = AbortOnDrop::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (app, tls) = (app.clone(), tls.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                        app.clone().oneshot(request.map(Body::new))
                    });
                    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    // A handshake the gateway refuses (an untrusted certificate) just ends here.
                    let _ = match tls {
                        None => builder.serve_connection(TokioIo::new(stream), service).await,
                        Some(tls) => match tls.accept(stream).await {
                            Ok(stream) => builder.serve_connection(TokioIo::new(stream), service).await,
                            Err(_) => return,
                        },
                    };
                });
            }
        });
        Self { addr, counts, _task }
    }

    fn http_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn https_url(&self) -> String {
        format!("https://{}", self.addr)
    }
}

type Shared = State<Arc<Counts>>;

async fn pay(State(counts): Shared, version: Version, headers: HeaderMap, _body: Bytes) -> Response {
    counts.record(version, &headers);
    let n = counts.pay.fetch_add(1, Ordering::SeqCst) + 1;
    Response::builder()
        .status(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::LOCATION, format!("/charges/{n}"))
        .body(Body::from(format!(r#"{{"charge":{n}}}"#)))
        .unwrap()
}

async fn read(State(counts): Shared, version: Version, headers: HeaderMap) -> Response {
    counts.record(version, &headers);
    Response::new(Body::from("{}"))
}

async fn chunked(State(counts): Shared, version: Version, headers: HeaderMap) -> Response {
    counts.record(version, &headers);
    let n = counts.pay.fetch_add(1, Ordering::SeqCst) + 1;
    let parts = vec![
        Ok::<Bytes, std::io::Error>(Bytes::from(format!(r#"{{"charge":{n},"#))),
        Ok(Bytes::from_static(br#""items":["a","b"]}"#)),
    ];
    Response::builder()
        .status(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(futures_util::stream::iter(parts)))
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A keyed JSON POST to `url` through `client`; its answer and the protocol version it came in.
async fn post_keyed(client: &reqwest::Client, url: &str, key: &str) -> (Reply, Version) {
    let request = client
        .post(url)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(PAY_BODY);
    let response = request
        .try_clone()
        .unwrap()
        .send()
        .await
        .unwrap_or_else(|err| panic!("no answer from {url}: {err:?}"));
    let version = response.version();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.bytes().await.expect("the whole body");
    (Reply { status, headers, body }, version)
}

/// Asserts that an answer carries none of the headers HTTP/2 forbids.
#[track_caller]
fn assert_no_connection_headers(reply: &Reply) {
    for name in [
        "connection",
        "transfer-encoding",
        "keep-alive",
        "upgrade",
        "proxy-connection",
    ] {
        assert!(reply.header(name).is_none(), "{name} on an HTTP/2 answer: {reply}");
    }
}

/// A new run, then its replay; both `expected_version`; the upstream runs once.
async fn runs_once_and_replays(
    client: &reqwest::Client,
    url: &str,
    upstream: &TestUpstream,
    expected_version: Version,
) {
    let key = new_key();
    let runs = upstream.counts.pay();
    let (first, version) = post_keyed(client, url, &key).await;
    assert_eq!(first.status, 201, "{first}");
    assert!(!first.replayed(), "{first}");
    assert_eq!(version, expected_version, "the first answer's protocol: {first}");
    let (again, version) = post_keyed(client, url, &key).await;
    assert_eq!(again.status, 201, "{again}");
    assert!(again.replayed(), "the retry is a replay: {again}");
    assert_eq!(again.json("charge"), first.json("charge"), "{again}");
    assert_eq!(version, expected_version, "the replay's protocol: {again}");
    assert_eq!(upstream.counts.pay(), runs + 1, "the upstream ran once");
    if expected_version == Version::HTTP_2 {
        assert_no_connection_headers(&first);
        assert_no_connection_headers(&again);
    }
}

// ---------------------------------------------------------------------------------------------
// (1) https:// upstreams
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_with_a_ca_from_upstream_ca_runs_once_and_replays() {
    let pki = Pki::new("upstream");
    // HTTP/1.1 only, by ALPN: the gateway must not insist on HTTP/2.
    let upstream = TestUpstream::start(Some(acceptor(&pki.server("upstream"), &[b"http/1.1"]))).await;
    let ca = pki.ca_path();
    let gw = Gateway::start(&upstream.https_url(), &["--upstream-ca", ca.to_str().unwrap()]).await;

    runs_once_and_replays(&gw.client, &gw.url("/pay"), &upstream, Version::HTTP_11).await;
    let seen = upstream.counts.last();
    assert_eq!(seen.version, Version::HTTP_11);
    assert_eq!(
        seen.headers.get("x-forwarded-proto").unwrap(),
        "http",
        "the client came over plain HTTP"
    );
    assert!(seen.headers.get("idempotency-key").is_some(), "the key is forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_whose_certificate_is_not_trusted_is_502_and_nothing_runs() {
    let trusted = Pki::new("trusted");
    let stranger = Pki::new("stranger");
    let upstream = TestUpstream::start(Some(acceptor(&stranger.server("upstream"), &[b"h2", b"http/1.1"]))).await;
    let ca = trusted.ca_path();
    let gw = Gateway::start(&upstream.https_url(), &["--upstream-ca", ca.to_str().unwrap()]).await;

    let key = new_key();
    let first = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    first.assert_problem(502, "upstream-unavailable");
    // Nothing was sent, so the key was released: the retry tries again instead of waiting.
    assert!(
        first.detail().contains("TLS certificate was rejected") && first.detail().contains("UnknownIssuer"),
        "the detail names the certificate problem: {first}"
    );
    let again = gw.post_json("/pay", Some(&key), PAY_BODY).await;
    again.assert_problem(502, "upstream-unavailable");
    assert_eq!(upstream.counts.pay(), 0, "nothing reached the upstream");
    let stderr = gw.stderr();
    assert!(
        stderr.contains("certificate"),
        "the log says the certificate is why:\n{stderr}"
    );
}

/// A self-signed certificate for `localhost` and `127.0.0.1` made as most people make one for a
/// test upstream: `openssl req -x509` (CA:TRUE, its own leaf), in `dir` as `NAME.crt`/`NAME.key`.
fn openssl_self_signed(dir: &Path, name: &str) -> Issued {
    openssl_self_signed_for(dir, name, "DNS:localhost,IP:127.0.0.1")
}

/// [`openssl_self_signed`] for the names `san` (`subjectAltName` syntax).
fn openssl_self_signed_for(dir: &Path, name: &str, san: &str) -> Issued {
    let issued = Issued {
        cert: dir.join(format!("{name}.crt")),
        key: dir.join(format!("{name}.key")),
    };
    let output = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"])
        .arg("-keyout")
        .arg(&issued.key)
        .arg("-out")
        .arg(&issued.cert)
        .args(["-subj", "/CN=localhost", "-addext", &format!("subjectAltName={san}")])
        .output()
        .expect("run openssl, which this test needs to make its certificate (apt-get install openssl)");
    assert!(output.status.success(), "openssl req -x509: {}", describe(&output));
    issued
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_openssl_self_signed_certificate_given_as_upstream_ca_is_accepted_as_pinned() {
    let dir = tempfile::tempdir().unwrap();
    let cert = openssl_self_signed(dir.path(), "upstream");
    let upstream = TestUpstream::start(Some(acceptor(&cert, &[b"h2", b"http/1.1"]))).await;
    let gw = Gateway::start(&upstream.https_url(), &["--upstream-ca", cert.cert.to_str().unwrap()]).await;

    runs_once_and_replays(&gw.client, &gw.url("/pay"), &upstream, Version::HTTP_11).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_self_signed_certificate_that_is_not_pinned_is_502_naming_the_certificate_problem() {
    let dir = tempfile::tempdir().unwrap();
    let pinned = openssl_self_signed(dir.path(), "pinned");
    let other = openssl_self_signed(dir.path(), "other");
    let upstream = TestUpstream::start(Some(acceptor(&other, &[b"http/1.1"]))).await;
    let gw = Gateway::start(&upstream.https_url(), &["--upstream-ca", pinned.cert.to_str().unwrap()]).await;

    let reply = gw.post_json("/pay", Some(&new_key()), PAY_BODY).await;
    reply.assert_problem(502, "upstream-unavailable");
    let detail = reply.detail();
    assert!(
        detail.contains("TLS certificate") && detail.contains("rejected"),
        "the detail says the upstream's certificate was rejected: {detail}"
    );
    assert!(
        detail.contains("CA certificate") && detail.contains("--upstream-ca"),
        "and why: {detail}"
    );
    assert_eq!(upstream.counts.pay(), 0, "nothing reached the upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_certificate_still_has_to_name_the_upstream() {
    let dir = tempfile::tempdir().unwrap();
    // Pinned, but made for another host than the one the gateway dials (127.0.0.1).
    let cert = openssl_self_signed_for(dir.path(), "elsewhere", "DNS:elsewhere.example");
    let upstream = TestUpstream::start(Some(acceptor(&cert, &[b"http/1.1"]))).await;
    let gw = Gateway::start(&upstream.https_url(), &["--upstream-ca", cert.cert.to_str().unwrap()]).await;

    let reply = gw.post_json("/pay", Some(&new_key()), PAY_BODY).await;
    reply.assert_problem(502, "upstream-unavailable");
    assert!(
        reply.detail().contains("TLS certificate") && reply.detail().contains("not valid for name"),
        "{reply}"
    );
    assert_eq!(upstream.counts.pay(), 0, "nothing reached the upstream");
}

// ---------------------------------------------------------------------------------------------
// (2) the TLS listener
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_listener_answers_over_http2_and_over_http1_when_forced() {
    let pki = Pki::new("listener");
    let upstream = TestUpstream::start(None).await;
    let server = pki.server("gateway");
    let gw = Gateway::start(
        &upstream.http_url(),
        &[
            "--tls-cert",
            server.cert.to_str().unwrap(),
            "--tls-key",
            server.key.to_str().unwrap(),
        ],
    )
    .await;
    assert!(
        gw.base.starts_with("https://"),
        "the listening line says https: {}",
        gw.base
    );

    // ALPN: h2 when the client offers it.
    let h2 = pki.client().build().unwrap();
    runs_once_and_replays(&h2, &gw.url("/pay"), &upstream, Version::HTTP_2).await;
    let seen = upstream.counts.last();
    assert_eq!(
        seen.headers.get("x-forwarded-proto").unwrap(),
        "https",
        "the upstream is told the client came over TLS"
    );
    assert_eq!(
        seen.version,
        Version::HTTP_11,
        "to a plain upstream: HTTP/1.1 unless asked"
    );
    // An upstream answer with no length (chunked on HTTP/1.1) reaches an HTTP/2 client framed
    // its way, first and on replay.
    let key = new_key();
    for _ in 0..2 {
        let (reply, version) = post_keyed(&h2, &gw.url("/chunked"), &key).await;
        assert_eq!((reply.status, version), (201, Version::HTTP_2), "{reply}");
        assert!(reply.text().ends_with(r#""items":["a","b"]}"#), "{reply}");
        assert_no_connection_headers(&reply);
    }

    // ALPN: http/1.1 when that is all the client offers.
    let h1 = pki.client().http1_only().build().unwrap();
    runs_once_and_replays(&h1, &gw.url("/pay"), &upstream, Version::HTTP_11).await;
    assert_eq!(
        upstream.counts.last().headers.get("x-forwarded-proto").unwrap(),
        "https"
    );

    // A client that does not trust the CA gets no answer at all.
    let stranger = Pki::new("stranger").client().build().unwrap();
    let refused = stranger.post(gw.url("/pay")).body(PAY_BODY).send().await;
    assert!(
        refused.is_err(),
        "a client that does not trust the certificate: {refused:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// (3) h2c to the plain listener
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_by_prior_knowledge_reaches_the_plain_listener() {
    let upstream = TestUpstream::start(None).await;
    let gw = Gateway::start(&upstream.http_url(), &[]).await;
    let h2c = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .http2_prior_knowledge()
        .build()
        .unwrap();

    runs_once_and_replays(&h2c, &gw.url("/pay"), &upstream, Version::HTTP_2).await;
    let seen = upstream.counts.last();
    assert_eq!(
        seen.version,
        Version::HTTP_11,
        "to a plain upstream: HTTP/1.1 unless asked"
    );
    assert_eq!(seen.headers.get("x-forwarded-proto").unwrap(), "http");
    // HTTP/2 names the host in `:authority`, not in a Host header.
    let authority = gw.base.trim_start_matches("http://");
    assert_eq!(
        seen.headers.get("x-forwarded-host").map(|v| v.to_str().unwrap()),
        Some(authority),
        "the upstream is told which host the client asked for"
    );
    let key = new_key();
    for _ in 0..2 {
        let (reply, version) = post_keyed(&h2c, &gw.url("/chunked"), &key).await;
        assert_eq!((reply.status, version), (201, Version::HTTP_2), "{reply}");
        assert_no_connection_headers(&reply);
    }
}

// ---------------------------------------------------------------------------------------------
// (4) HTTP/2 to the upstream
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_that_offers_h2_gets_http2() {
    let pki = Pki::new("h2-upstream");
    let upstream = TestUpstream::start(Some(acceptor(&pki.server("upstream"), &[b"h2", b"http/1.1"]))).await;
    let ca = pki.ca_path();
    let gw = Gateway::start(&upstream.https_url(), &["--upstream-ca", ca.to_str().unwrap()]).await;

    runs_once_and_replays(&gw.client, &gw.url("/pay"), &upstream, Version::HTTP_11).await;
    // A request passed through (not keyed) goes the same way.
    let read = send(gw.client.get(gw.url("/pay"))).await;
    assert_eq!(read.status, 200, "{read}");
    assert_eq!(
        upstream.counts.versions(),
        [Version::HTTP_2, Version::HTTP_2],
        "ALPN chose h2"
    );
    let seen = upstream.counts.last();
    assert!(
        seen.headers.get(header::CONNECTION).is_none() && seen.headers.get(header::TE).is_none(),
        "no connection-specific header goes over HTTP/2: {:?}",
        seen.headers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_to_a_plain_upstream_only_when_asked() {
    let upstream = TestUpstream::start(None).await;
    let asked = Gateway::start(&upstream.http_url(), &["--upstream-http2"]).await;
    runs_once_and_replays(&asked.client, &asked.url("/pay"), &upstream, Version::HTTP_11).await;
    assert_eq!(upstream.counts.versions(), [Version::HTTP_2], "h2c by prior knowledge");

    let not_asked = Gateway::start(&upstream.http_url(), &[]).await;
    runs_once_and_replays(&not_asked.client, &not_asked.url("/pay"), &upstream, Version::HTTP_11).await;
    assert_eq!(
        upstream.counts.last().version,
        Version::HTTP_11,
        "HTTP/1.1 unless asked"
    );
}

// ---------------------------------------------------------------------------------------------
// (5) settings that cannot work
// ---------------------------------------------------------------------------------------------

/// Runs `idem serve` with `args` and `env`, expecting it to refuse to start: exit 2 and a message
/// that names `flag` (and everything in `mentions`).
async fn refused(args: &[&str], env: &[(&str, &str)], flag: &str, mentions: &[&str]) {
    let output = common::serve_refusing(args, env).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("idem: --{flag}:")),
        "{args:?} {env:?} names --{flag}: {}",
        describe(&output)
    );
    for mention in mentions {
        assert!(
            stderr.contains(mention),
            "{args:?} {env:?} mentions {mention}: {}",
            describe(&output)
        );
    }
}

fn text(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_that_cannot_work_exit_2_naming_the_flag() {
    let pki = Pki::new("flags");
    let server = pki.server("gateway");
    let other = pki.server("other");
    let (cert, key, ca) = (text(&server.cert), text(&server.key), pki.ca_path());
    let plain = ["--upstream", "http://127.0.0.1:9"];
    let https = ["--upstream", "https://127.0.0.1:9"];
    let not_pem = pki.dir.path().join("notes.txt");
    std::fs::write(&not_pem, "not a certificate\n").unwrap();
    let missing = pki.dir.path().join("missing.pem");

    fn flags<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
        [base, more].concat()
    }
    let (missing, not_pem, other_key, ca) = (text(&missing), text(&not_pem), text(&other.key), text(&ca));
    // What is given, and the flag (and the files) the refusal names.
    #[rustfmt::skip]
    let cases = [
        // Both or neither, from flags or from the environment.
        (flags(&plain, &["--tls-cert", cert]), vec![], "tls-key", vec![]),
        (flags(&plain, &["--tls-key", key]), vec![], "tls-cert", vec![]),
        (plain.to_vec(), vec![("IDEM_TLS_CERT", cert)], "tls-key", vec![]),
        // Files that cannot be read or hold no PEM, named.
        (flags(&plain, &["--tls-cert", missing, "--tls-key", key]), vec![], "tls-cert", vec!["missing.pem"]),
        (flags(&plain, &["--tls-cert", not_pem, "--tls-key", key]), vec![], "tls-cert", vec!["notes.txt"]),
        (flags(&plain, &["--tls-cert", cert, "--tls-key", not_pem]), vec![], "tls-key", vec!["notes.txt"]),
        // A key that is not the certificate's.
        (flags(&plain, &["--tls-cert", cert, "--tls-key", other_key]), vec![], "tls-key", vec!["other.key"]),
        (flags(&https, &["--upstream-ca", not_pem]), vec![], "upstream-ca", vec!["notes.txt"]),
        (https.to_vec(), vec![("IDEM_UPSTREAM_CA", missing)], "upstream-ca", vec!["missing.pem"]),
        // Combinations that mean nothing.
        (flags(&plain, &["--upstream-ca", ca]), vec![], "upstream-ca", vec![]),
        (flags(&https, &["--upstream-http2"]), vec![], "upstream-http2", vec![]),
        (https.to_vec(), vec![("IDEM_UPSTREAM_HTTP2", "true")], "upstream-http2", vec![]),
        (vec!["--upstream", "ftp://127.0.0.1:9"], vec![], "upstream", vec![]),
    ];
    for (args, env, flag, mentions) in cases {
        refused(&args, &env, flag, &mentions).await;
    }
}
