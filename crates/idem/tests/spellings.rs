//! A request is never protected less because of how it is spelt: a path an upstream reads as a
//! route's path gets that route's rules (or is refused), and a method in another case is the
//! method. Each request goes on the wire as written (`idem_test_support::wire`, a raw TCP client:
//! HTTP libraries tidy paths up), through a real `idem serve`, to an upstream that counts what reaches it.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{Method, Uri};
use common::{Gateway, config_file, new_key};
use idem_test_support::task::AbortOnDrop;
use idem_test_support::wire::{self, Answer, Raw};
use tokio::net::TcpListener;

/// The method and path of each request the upstream got, in order.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

/// An upstream that answers every method and path `201` and keeps the method and path of each
/// request it got.
struct Counting {
    addr: SocketAddr,
    seen: Seen,
    _task: AbortOnDrop,
}

impl Counting {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the upstream");
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new()
            .fallback(|State(seen): State<Seen>, method: Method, uri: Uri| async move {
                let mut seen = seen.lock().unwrap();
                seen.push((method.to_string(), uri.path().to_owned()));
                (axum::http::StatusCode::CREATED, format!("{{\"call\":{}}}", seen.len()))
            })
            .with_state(seen.clone());
        let _task = AbortOnDrop::serve(listener, app);
        Self { addr, seen, _task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many requests reached it.
    fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// The method and path of each request that reached it.
    fn seen(&self) -> Vec<(String, String)> {
        self.seen.lock().unwrap().clone()
    }
}

/// Sends `METHOD TARGET HTTP/1.1` exactly as written, with `key` and `body`, and reads the answer.
async fn raw(gw: &Gateway, method: &str, target: &str, key: Option<&str>, body: &str) -> Answer {
    let mut request = Raw::new(method, target).json();
    if let Some(key) = key {
        request = request.h("Idempotency-Key", key);
    }
    wire::send(gw.addr(), &request.sized(body.as_bytes()), Duration::from_secs(30))
        .await
        .unwrap_or_else(|err| panic!("{method} {target}: {err}"))
}

/// Payments need a key and take small bodies; everything else under `/payments/` and the
/// webhooks pass through untouched.
const PAYMENTS: &str = r#"
[[route]]
path = "/payments/{id}"
missing-key = "require"
max-body = "16B"

[[route]]
path = "/payments/*"
enabled = false

[[route]]
path = "/webhooks/*"
enabled = false
"#;

/// Spellings that servers and frameworks read as `/payments/1`.
const PAYMENT_SPELLINGS: &[&str] = &[
    "//payments/1",
    "/payments%2F1",
    "/payments%2f1",
    "/payments//1",
    "/payments/1/",
    "/payments/./1",
    "/payments/x/../1",
    "/webhooks/..%2Fpayments%2F1",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_spelt_otherwise_keeps_the_rules_of_the_route_it_reads_as() {
    let upstream = Counting::start().await;
    let (_dir, config) = config_file(PAYMENTS);
    let gw = Gateway::start(&upstream.url(), &["--config", config.to_str().unwrap()]).await;

    for &target in PAYMENT_SPELLINGS {
        // Keyless: the route requires a key, whatever the spelling.
        raw(&gw, "POST", target, None, "{}")
            .await
            .assert_problem(400, "key-missing");
        // Keyed, with a body over the route's 16 bytes (the default allows 1 MiB).
        let big = raw(&gw, "POST", target, Some(&new_key()), r#"{"amount":100000000}"#).await;
        big.assert_problem(413, "body-too-large");
    }
    assert_eq!(
        upstream.count(),
        0,
        "no refused request reaches the upstream: {:?}",
        upstream.seen()
    );

    // A keyed payment under such a spelling runs once and replays, and is forwarded as sent.
    let key = new_key();
    let first = raw(&gw, "POST", "/payments//1", Some(&key), "{}").await;
    let again = raw(&gw, "POST", "/payments//1", Some(&key), "{}").await;
    assert_eq!((first.status, again.status), (201, 201), "{first:?}\n{again:?}");
    assert!(again.replayed(), "{again:?}");
    assert_eq!(upstream.seen(), [("POST".to_owned(), "/payments//1".to_owned())]);

    // The routes still do what they say for the plain spellings.
    raw(&gw, "POST", "/payments/1", None, "{}")
        .await
        .assert_problem(400, "key-missing");
    let hook = raw(&gw, "POST", "/webhooks/github", None, "{}").await;
    assert_eq!(hook.status, 201, "{hook:?}");
    let refunds = raw(&gw, "POST", "/payments/1/refunds", None, "{}").await;
    assert_eq!(refunds.status, 201, "a pass-through route still passes: {refunds:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spelling_that_reads_as_two_protected_rules_is_refused() {
    let upstream = Counting::start().await;
    let (_dir, config) = config_file(PAYMENTS);
    let gw = Gateway::start(&upstream.url(), &["--config", config.to_str().unwrap()]).await;

    // As sent, `/payments/{id}`; decoded, `/refunds`, under the default rules: which one the
    // upstream runs depends on the upstream, so neither set of rules is applied.
    let answer = raw(&gw, "POST", "/payments/..%2Frefunds", Some(&new_key()), "{}").await;
    answer.assert_problem(400, "path-ambiguous");
    for named in ["/payments/..%2Frefunds", "/refunds", "/payments/{id}", "default"] {
        assert!(answer.text().contains(named), "the detail names {named}: {answer:?}");
    }
    assert_eq!(upstream.count(), 0, "{:?}", upstream.seen());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asterisk_target_gets_the_catch_all_route() {
    let upstream = Counting::start().await;
    let (_dir, config) = config_file("[[route]]\npath = \"/*\"\nmissing-key = \"require\"\nmax-body = \"16B\"\n");
    let gw = Gateway::start(&upstream.url(), &["--config", config.to_str().unwrap()]).await;

    raw(&gw, "POST", "*", None, "{}")
        .await
        .assert_problem(400, "key-missing");
    let big = raw(&gw, "POST", "*", Some(&new_key()), r#"{"amount":100000000}"#).await;
    big.assert_problem(413, "body-too-large");
    assert_eq!(upstream.count(), 0, "{:?}", upstream.seen());
}

/// Under an upstream's path prefix (`--upstream http://host/api`), a path that climbs above its
/// root in any spelling of `..` would reach the upstream as `/api/../admin`, which a normalising
/// server reads as `/admin`, outside the prefix: it is refused before anything is claimed or sent,
/// keyed or not. A `..` that stays inside the prefix is passed on as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_that_climbs_out_of_the_upstream_prefix_never_reaches_it() {
    let upstream = Counting::start().await;
    let gw = Gateway::start(&format!("{}/api", upstream.url()), &[]).await;

    for target in [
        "/../admin",
        "/%2e%2e/admin",
        "/a/..%2F..%2Fadmin",
        "/a/..%5c..%5cadmin",
        "/..;x/admin",
        "/a;%2f..%2f..%2fadmin",
    ] {
        for key in [Some(new_key()), None] {
            let refused = raw(&gw, "POST", target, key.as_deref(), "{}").await;
            refused.assert_problem(400, "path-ambiguous");
            assert!(
                refused.text().contains("/api"),
                "the detail names the prefix: {refused:?}"
            );
        }
    }
    assert_eq!(upstream.count(), 0, "nothing climbed out: {:?}", upstream.seen());

    let key = new_key();
    let inside = raw(&gw, "POST", "/a/../pay", Some(&key), "{}").await;
    assert_eq!(inside.status, 201, "{inside:?}");
    assert!(raw(&gw, "POST", "/a/../pay", Some(&key), "{}").await.replayed());
    assert_eq!(upstream.seen(), [("POST".to_owned(), "/api/a/../pay".to_owned())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_method_in_another_case_is_that_method() {
    let upstream = Counting::start().await;
    let gw = Gateway::start(&upstream.url(), &["--missing-key", "require"]).await;

    for method in ["patch", "post", "Post", "pAtCh"] {
        let key = new_key();
        let first = raw(&gw, method, "/orders", Some(&key), "{}").await;
        let again = raw(&gw, method, "/orders", Some(&key), "{}").await;
        assert_eq!(
            (first.status, again.status),
            (201, 201),
            "{method}: {first:?}\n{again:?}"
        );
        assert!(!first.replayed() && again.replayed(), "{method}: {first:?}\n{again:?}");
        raw(&gw, method, "/orders", None, "{}")
            .await
            .assert_problem(400, "key-missing");
    }
    let methods: Vec<String> = upstream.seen().into_iter().map(|(method, _)| method).collect();
    assert_eq!(
        methods,
        ["patch", "post", "Post", "pAtCh"],
        "each ran once, forwarded as sent"
    );
    // Methods the protocol does not cover still pass through, in any case.
    let read = raw(&gw, "get", "/orders", None, "").await;
    assert_eq!(read.status, 201, "{read:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_are_configured_in_any_case() {
    let upstream = Counting::start().await;
    let flag = Gateway::start(&upstream.url(), &["--methods", "patch,put", "--missing-key", "require"]).await;
    raw(&flag, "PUT", "/a", None, "{}")
        .await
        .assert_problem(400, "key-missing");
    raw(&flag, "patch", "/a", None, "{}")
        .await
        .assert_problem(400, "key-missing");
    assert_eq!(
        raw(&flag, "POST", "/a", None, "{}").await.status,
        201,
        "POST is not listed"
    );

    let (_dir, config) = config_file(
        "methods = [\"post\"]\n\n[[route]]\npath = \"/exports\"\nmethods = \"put\"\nmissing-key = \"require\"\n",
    );
    let file = Gateway::start(&upstream.url(), &["--config", config.to_str().unwrap()]).await;
    raw(&file, "put", "/exports", None, "{}")
        .await
        .assert_problem(400, "key-missing");
    let key = new_key();
    assert_eq!(raw(&file, "Post", "/b", Some(&key), "{}").await.status, 201);
    assert!(raw(&file, "Post", "/b", Some(&key), "{}").await.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_path_readings_setting_adds_what_the_upstream_reads() {
    let upstream = Counting::start().await;
    let (_dir, config) = config_file("[[route]]\npath = \"/payments/{id}\"\nmissing-key = \"require\"\n");
    let config = config.to_str().unwrap();
    let spellings = ["/PAYMENTS/1", "/payments;jsessionid=0A1B/1"];

    // Without the setting, a case-sensitive upstream that keeps `;params` has no such route.
    let standard = Gateway::start(&upstream.url(), &["--config", config]).await;
    for target in spellings {
        assert_eq!(raw(&standard, "POST", target, None, "{}").await.status, 201, "{target}");
    }
    let before = upstream.count();

    // The flag, the environment and the file each set it.
    let flag = Gateway::start(
        &upstream.url(),
        &["--config", config, "--path-readings", "case-insensitive,strip-params"],
    )
    .await;
    let env = Gateway::start_with_env(
        &upstream.url(),
        &["--config", config],
        &[("IDEM_PATH_READINGS", "strip-params,case-insensitive")],
    )
    .await;
    let (_file_dir, file_config) = config_file(
        "path-readings = \"case-insensitive,strip-params\"\n\n[[route]]\npath = \"/payments/{id}\"\nmissing-key = \"require\"\n",
    );
    let file = Gateway::start(&upstream.url(), &["--config", file_config.to_str().unwrap()]).await;
    for gw in [&flag, &env, &file] {
        for target in spellings {
            raw(gw, "POST", target, None, "{}")
                .await
                .assert_problem(400, "key-missing");
        }
    }
    assert_eq!(upstream.count(), before, "{:?}", upstream.seen());

    common::assert_serve_refuses(&["--path-readings", "lowercase"], "path-readings").await;
}
