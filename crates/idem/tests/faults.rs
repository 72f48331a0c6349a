//! Faults through the gateway (`idem serve`), injected for real: a neighbour holding the SQLite
//! write lock, an upstream that never answers, a client that hangs up while its claim is made.
//! None of them may run a key twice without `Idempotency-Recovered: true`, or lose an answer.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::{Gateway, count, new_key, send, try_send};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The SQLite file behind a gateway's `sqlite://PATH` store.
fn sqlite_path(gw: &Gateway) -> PathBuf {
    PathBuf::from(gw.store.strip_prefix("sqlite://").expect("a sqlite:// store"))
}

/// Takes the database's write lock from another connection, as a neighbour process writing to
/// the same file would, and holds it for `hold`. Returns once the lock is held.
fn hold_write_lock(path: PathBuf, hold: Duration) -> std::thread::JoinHandle<()> {
    let (locked, is_locked) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        let conn = rusqlite::Connection::open(&path).expect("open the gateway's SQLite file");
        conn.busy_timeout(Duration::from_secs(30)).expect("busy timeout");
        conn.execute_batch("BEGIN IMMEDIATE").expect("take the write lock");
        locked.send(()).expect("the test waits for the lock");
        std::thread::sleep(hold);
        conn.execute_batch("COMMIT").expect("give the write lock back");
    });
    is_locked.recv().expect("the lock was taken");
    holder
}

/// A scrape of the gateway's `/metrics`.
async fn metrics(gw: &Gateway) -> String {
    send(gw.client.get(format!("{}/metrics", gw.admin))).await.text()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_the_store_refuses_is_held_and_stored_not_run_again() {
    let (upstream, gw, key) = common::start(&["--lease", "3s", "--upstream-timeout", "1s"]).await;
    let first = tokio::spawn({
        let request = gw.keyed("/pay?delay=2000", &key, r#"{"amount":100}"#);
        send(request)
    });
    // The claim is made at once; then a neighbour takes the write lock for 45 s: across the
    // upstream's answer (at 2 s), many lease renewals (each waiting out SQLite's 10 s busy
    // timeout), and well past the first attempts to store the answer.
    common::wait_for_count(&upstream.state.pay, 1, Duration::from_secs(10)).await;
    let lock = hold_write_lock(sqlite_path(&gw), Duration::from_secs(45));
    let first = first.await.unwrap();
    first.assert_problem(504, "upstream-timeout");

    tokio::time::sleep(Duration::from_secs(8)).await;
    let while_held = metrics(&gw).await;
    tokio::task::spawn_blocking(move || lock.join().unwrap()).await.unwrap();

    // Well past the lease that was not renewed while the lock was held: the retry must be the
    // replay of the one run, not a takeover running the payment again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let retry = gw.post_json("/pay?delay=2000", Some(&key), r#"{"amount":100}"#).await;
    assert_eq!(retry.status, 201, "{retry}");
    assert!(retry.replayed(), "{retry}");
    assert_eq!(retry.charge(), 1);
    assert_eq!(count(&upstream.state.pay), 1, "the upstream ran once");
    assert!(
        while_held.lines().any(|line| line == "idem_pending_answers 1"),
        "the held answer was visible: {while_held}"
    );
    assert!(
        metrics(&gw).await.lines().any(|line| line == "idem_pending_answers 0"),
        "nothing is held any more"
    );
}

/// An upstream whose first `POST /pay` never answers; later ones answer 201 with the
/// `Idempotency-Recovered` header they saw.
async fn hanging_upstream() -> (String, Arc<AtomicUsize>, JoinHandle<()>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let app = Router::new().route(
        "/pay",
        post(move |headers: HeaderMap| {
            let counter = counter.clone();
            async move {
                if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                    std::future::pending::<()>().await;
                }
                let recovered = headers
                    .get("idempotency-recovered")
                    .map(|v| v.to_str().unwrap_or("?").to_owned())
                    .unwrap_or_default();
                (StatusCode::CREATED, format!(r#"{{"recovered":"{recovered}"}}"#))
            }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, calls, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_upstream_is_given_up_after_the_run_timeout() {
    let (url, calls, _task) = hanging_upstream().await;
    let gw = Gateway::start(
        &url,
        &[
            "--lease",
            "3s",
            "--upstream-timeout",
            "1s",
            "--wait",
            "1s",
            "--run-timeout",
            "2s",
        ],
    )
    .await;
    let key = new_key();
    let first = gw.post_json("/pay", Some(&key), "{}").await;
    first.assert_problem(504, "upstream-timeout");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The run was given up and the key released as unknown: the retry runs, and the upstream is
    // told it may be a repeat. Before, every retry got 409 until the gateway restarted.
    let retry = gw.post_json("/pay", Some(&key), "{}").await;
    assert_eq!(retry.status, 201, "{retry}");
    assert_eq!(retry.json("recovered").as_deref(), Some("true"), "{retry}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let again = gw.post_json("/pay", Some(&key), "{}").await;
    assert!(again.replayed(), "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_its_claim_is_made_leaves_no_orphan() {
    let (upstream, gw, key) = common::start(&["--wait", "1s"]).await;
    // The claim cannot be written until the neighbour lets go of the lock, 2 s from now; the
    // client gives up after 500 ms and closes its connection.
    let lock = hold_write_lock(sqlite_path(&gw), Duration::from_secs(2));
    let impatient = gw.keyed("/pay", &key, "{}").timeout(Duration::from_millis(500));
    assert!(try_send(impatient).await.is_err(), "the client hung up");
    tokio::task::spawn_blocking(move || lock.join().unwrap()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The claim made after the client left was released at once: the retry runs as new. Before,
    // it was in flight for a whole lease (409), then run marked recovered for a request the
    // upstream never saw.
    let retry = gw.post_json("/pay", Some(&key), "{}").await;
    assert_eq!(retry.status, 201, "{retry}");
    assert!(!retry.replayed(), "nothing ran for the client that left: {retry}");
    assert_eq!(retry.header("x-seen-recovered"), None, "{retry}");
    assert_eq!(count(&upstream.state.pay), 1);
}
