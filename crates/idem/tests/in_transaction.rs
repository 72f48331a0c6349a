//! The gateway and an upstream that completes its runs in its own PostgreSQL transaction: the
//! upstream receives `Idempotency-Token` and calls `idem_complete(token, status, headers, body)`
//! beside its business write (a ledger row), so the answer commits with the write or neither does.
//! Real `idem serve` processes, killed with SIGKILL; the upstream is the tests' ledger
//! (`common/ledger.rs`), on a real socket.

mod common;

use std::time::Duration;

use common::ledger::{self, Ledger, Then};
use common::{Gateway, client, send};
use idem_test_support::postgres_store;

/// Calls the store's `idem_complete` with `token` (a `201` JSON answer) in a transaction of its own,
/// rolled back; the SQLSTATE if it raised.
async fn complete_with(ledger: &Ledger, token: &str) -> Option<String> {
    complete_with_headers(ledger, token, r#"{"Content-Type": "application/json"}"#).await
}

/// [`complete_with`] with these headers (JSON).
async fn complete_with_headers(ledger: &Ledger, token: &str, headers: &str) -> Option<String> {
    let mut client = ledger::connect(&ledger.database).await;
    let tx = client.transaction().await.expect("begin");
    let called = tx
        .execute(
            &format!(
                "SELECT \"{}\".idem_complete($1, 201, $2::text::jsonb, $3)",
                ledger.schema
            ),
            &[&token, &headers, &&b"{}"[..]],
        )
        .await
        .map(drop)
        .map_err(|err| {
            err.code()
                .map_or_else(|| err.to_string(), |code| code.code().to_owned())
        });
    drop(tx.rollback().await);
    called.err()
}

/// The `search_path` each of the store's `idem_complete` functions runs with.
async fn function_search_paths(ledger: &Ledger) -> Vec<(String, Vec<String>)> {
    ledger::connect(&ledger.database)
        .await
        .query(
            "SELECT p.proname::text, p.proconfig FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = $1 AND p.proname LIKE 'idem_complete%' ORDER BY 1",
            &[&ledger.schema],
        )
        .await
        .expect("read pg_proc")
        .iter()
        .map(|row| (row.get(0), row.get::<_, Option<Vec<String>>>(1).unwrap_or_default()))
        .collect()
}

/// A PostgreSQL store in a schema of its own, the ledger upstream on its database with its next
/// runs planned, and a gateway with `flags` before it.
async fn set_up(flags: &[&str], plan: &[Then]) -> (String, Ledger, Gateway) {
    let store = postgres_store::store_url();
    let (database, schema) = store.split_once("?schema=").expect("a schema option");
    // The schema and its functions exist once the store migrated: `idem migrate` does it.
    let migrated = common::run_idem(&["migrate", "--store", &store], Duration::from_secs(60)).await;
    assert!(migrated.status.success(), "{}", common::describe(&migrated));
    let upstream = Ledger::start(database, schema, 8, true).await;
    upstream.plan(plan);
    let gateway = Gateway::start_on_store(&upstream.url, &store, flags).await;
    (store, upstream, gateway)
}

fn pay_request(gateway: &Gateway, key: &str) -> reqwest::RequestBuilder {
    client()
        .post(gateway.url("/pay"))
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body("{}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_completes_in_its_transaction_is_replayed_and_not_stored_again() {
    let (_, upstream, gateway) = set_up(&[], &[]).await;
    let first = send(pay_request(&gateway, "k1").header("idempotency-token", "forged-by-the-client")).await;
    assert_eq!(first.status, 201, "{first}");
    let runs = upstream.completed();
    assert_eq!(runs.len(), 1);
    let token = runs[0].token.clone().expect("the upstream received a token");
    assert!(token.starts_with("idem1."), "the client's header was replaced: {token}");
    assert_eq!(runs[0].refused, None, "idem_complete took the answer");

    let replay = send(pay_request(&gateway, "k1")).await;
    assert!(replay.replayed(), "{replay}");
    assert_eq!(replay.status, 201);
    assert_eq!(
        replay.text(),
        r#"{"ledger":1,"key":"k1"}"#,
        "the answer the upstream's transaction stored"
    );
    assert_eq!(replay.header("content-type").as_deref(), Some("application/json"));
    assert_eq!(
        replay.header("location").as_deref(),
        Some("/charges/1"),
        "a header only the stored answer has"
    );
    assert_eq!(replay.header("set-cookie"), None, "never stored");
    assert_eq!(upstream.completed().len(), 1, "the upstream ran once");
    assert_eq!(upstream.rows_of("k1").await, 1);

    // The token is this run's only: once used it is stale, and it is no token for another key.
    assert_eq!(complete_with(&upstream, &token).await.as_deref(), Some("IDEM1"));
    let other_key = {
        let mut parts: Vec<String> = token.split('.').map(str::to_owned).collect();
        parts[2] = "6b32".to_owned(); // "k2"
        parts.join(".")
    };
    drop(send(pay_request(&gateway, "k2")).await);
    assert_eq!(complete_with(&upstream, &other_key).await.as_deref(), Some("IDEM1"));
    assert_eq!(complete_with(&upstream, "idem1.zz").await.as_deref(), Some("IDEM3"));
    // Headers are checked before the claim: a value that is not a string never makes an answer.
    for headers in [
        r#"{"Location": null}"#,
        r#"{"Link": ["</a>", null]}"#,
        r#"{"ETag": 7}"#,
        r#"{"Location": "/a\r\nSet-Cookie: x"}"#,
    ] {
        assert_eq!(
            complete_with_headers(&upstream, &token, headers).await.as_deref(),
            Some("IDEM2"),
            "{headers}"
        );
    }
    // The functions find the store's tables whoever calls them: their search_path is the schema's.
    let schema = &upstream.schema;
    for (function, config) in function_search_paths(&upstream).await {
        assert_eq!(config, [format!("search_path={schema}, pg_temp")], "{function}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_an_in_transaction_route_an_answer_whose_transaction_rolled_back_is_not_stored() {
    let (_, upstream, gateway) = set_up(&["--in-transaction"], &[Then::RollBackAndAnswer]).await;
    let first = send(pay_request(&gateway, "k1")).await;
    assert_eq!(first.status, 201, "passed on: {first}");
    assert_eq!(upstream.rows_of("k1").await, 0);
    let retry = send(pay_request(&gateway, "k1")).await;
    assert!(
        !retry.replayed(),
        "a success whose writes rolled back is never replayed: {retry}"
    );
    let runs = upstream.completed();
    assert_eq!(runs.len(), 2);
    assert!(!runs[1].recovered, "nothing of the first run stood");
    assert_eq!(upstream.rows_of("k1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_tampered_to_expire_its_key_at_once_keeps_the_claims_retention() {
    let (_, upstream, gateway) = set_up(&[], &[Then::CommitExpiringAtOnce]).await;
    assert_eq!(send(pay_request(&gateway, "k1")).await.status, 201);
    assert_eq!(upstream.completed()[0].refused, None);
    let retry = send(pay_request(&gateway, "k1")).await;
    assert!(retry.replayed(), "still replayed, not run again: {retry}");
    assert_eq!(upstream.completed().len(), 1);
    assert_eq!(upstream.rows_of("k1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_died_before_its_commit_runs_again_unflagged_on_an_in_transaction_route() {
    let (store, upstream, gateway) = set_up(&["--in-transaction"], &[Then::Die]).await;
    let lost = send(pay_request(&gateway, "k1")).await;
    assert_eq!(lost.status, 502, "{lost}");
    assert_eq!(upstream.rows_of("k1").await, 0, "rolled back");

    let retry = send(pay_request(&gateway, "k1")).await;
    assert_eq!(retry.status, 201, "{retry}");
    let runs = upstream.completed();
    assert_eq!(runs.len(), 2);
    assert!(
        !runs[1].recovered,
        "nothing of the first run stood: the retry is not flagged"
    );
    assert_eq!(upstream.rows_of("k1").await, 1);

    // Without the route's declaration, the same loss is flagged, as for any upstream.
    let gateway = Gateway::start_on_store(&upstream.url, &store, &[]).await;
    upstream.plan(&[Then::Die]);
    assert_eq!(send(pay_request(&gateway, "k2")).await.status, 502);
    assert_eq!(send(pay_request(&gateway, "k2")).await.status, 201);
    assert!(
        upstream.completed()[3].recovered,
        "undeclared: the retry is flagged recovered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_while_its_upstream_ran_leaves_the_answer_to_the_upstreams_commit() {
    let (store, upstream, mut first) = set_up(&["--in-transaction", "--lease", "1s"], &[Then::WaitThenCommit]).await;
    let started = upstream.waiting();
    let pending = tokio::spawn(pay_request(&first, "k1").send());
    started.await;
    first.kill().await;
    drop(pending.await);
    upstream.resume();
    // The upstream commits its row and the answer together, though nobody is listening.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while upstream.completed().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the upstream's run never finished"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(upstream.completed()[0].refused, None);

    let second = Gateway::start_on_store(&upstream.url, &store, &["--in-transaction", "--lease", "1s"]).await;
    let retry = send(pay_request(&second, "k1")).await;
    assert!(retry.replayed(), "the answer the upstream committed: {retry}");
    assert_eq!(upstream.completed().len(), 1, "no second run");
    assert_eq!(upstream.rows_of("k1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_before_its_upstream_committed_is_taken_over_unflagged_and_the_old_run_cannot_commit() {
    let (store, upstream, mut first) = set_up(
        &["--in-transaction", "--lease", "1s"],
        &[Then::WaitThenCommit, Then::Commit],
    )
    .await;
    let started = upstream.waiting();
    let pending = tokio::spawn(pay_request(&first, "k1").send());
    started.await;
    first.kill().await;
    drop(pending.await);
    // Past the dead gateway's lease, another instance takes the key over while the first run's
    // transaction is still open.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = Gateway::start_on_store(&upstream.url, &store, &["--in-transaction", "--lease", "1s"]).await;
    let retry = send(pay_request(&second, "k1")).await;
    assert_eq!(retry.status, 201, "{retry}");
    assert!(!retry.replayed());
    // The first run wakes and tries to complete: its claim is gone, its transaction aborts.
    upstream.resume();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while upstream.completed().len() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "the first run never finished");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let runs = upstream.completed();
    let (takeover, old) = (&runs[0], &runs[1]);
    assert!(
        !takeover.recovered,
        "the dead gateway's run had not committed: the takeover is unflagged"
    );
    assert_eq!(takeover.refused, None);
    assert_eq!(
        old.refused.as_deref(),
        Some("IDEM1"),
        "the old run's token is no longer current"
    );
    assert_eq!(upstream.rows_of("k1").await, 1, "only the takeover's row committed");
    let replay = send(pay_request(&second, "k1")).await;
    assert!(replay.replayed(), "{replay}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_transaction_on_a_store_without_idem_complete_is_refused_at_start() {
    common::assert_serve_refuses(&["--in-transaction"], "in-transaction").await;
}

/// The Python upstream of `examples/python-upstream`, on an ephemeral port; stops when dropped.
struct PythonUpstream {
    child: tokio::process::Child,
    url: String,
}

impl PythonUpstream {
    async fn start(database: &str, schema: &str) -> Self {
        use tokio::io::AsyncBufReadExt;
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/python-upstream/upstream.py"
        );
        let mut child = tokio::process::Command::new("python3")
            .arg(script)
            .env("DATABASE_URL", database)
            .env("IDEM_SCHEMA", schema)
            .env("PORT", "0")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs (bash .ci/services checks it and installs psycopg)");
        let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the Python upstream starts within 30 s")
            .expect("its stdout");
        let Some(line) = line else {
            let output = child.wait_with_output().await.expect("its output");
            panic!(
                "the Python upstream did not start (is psycopg installed? `bash .ci/services` installs it): {}",
                String::from_utf8_lossy(&output.stderr)
            );
        };
        let url = line
            .strip_prefix("python upstream listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_owned();
        Self { child, url }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_upstream_completes_in_its_transaction_and_twenty_copies_charge_once() {
    let store = postgres_store::store_url();
    let (database, schema) = store.split_once("?schema=").expect("a schema option");
    let migrated = common::run_idem(&["migrate", "--store", &store], Duration::from_secs(60)).await;
    assert!(migrated.status.success(), "{}", common::describe(&migrated));
    let python = PythonUpstream::start(database, schema).await;
    let gateway = Gateway::start_on_store(&python.url, &store, &["--in-transaction"]).await;
    let copies = (0..20).map(|_| {
        let request = client()
            .post(gateway.url("/pay"))
            .header("idempotency-key", "\"py-1\"")
            .header("content-type", "application/json")
            .body(r#"{"amount": 1250}"#);
        tokio::spawn(common::try_send(request))
    });
    let mut charges = std::collections::BTreeSet::new();
    for copy in futures_util::future::join_all(copies).await {
        match copy.expect("a copy") {
            Ok(reply) if reply.status == 201 => drop(charges.insert(reply.charge())),
            // A copy still waiting for the first after the wait: the key is in flight.
            Ok(reply) => reply.assert_problem(409, "key-in-flight"),
            Err(err) => panic!("{err}"),
        }
    }
    assert_eq!(charges.len(), 1, "every answer is the one charge: {charges:?}");
    let replay = send(
        client()
            .post(gateway.url("/pay"))
            .header("idempotency-key", "\"py-1\"")
            .header("content-type", "application/json")
            .body(r#"{"amount": 1250}"#),
    )
    .await;
    assert!(replay.replayed(), "{replay}");
    assert_eq!(replay.header("content-type").as_deref(), Some("application/json"));
    let (client, connection) = tokio_postgres::connect(database, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    let rows: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM \"{schema}\".python_ledger WHERE key = 'py-1'"),
            &[],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(rows, 1, "one ledger row, committed with the answer");
    drop(python.child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_bench_writes_the_row_and_the_answer_in_one_transaction() {
    let store = postgres_store::store_url();
    let args = ["bench", "--store", &store, "--requests", "20", "--concurrency", "4"];
    let output = common::run_idem(
        &[&args[..], &["--write", "in-transaction"]].concat(),
        Duration::from_secs(120),
    )
    .await;
    assert!(output.status.success(), "{}", common::describe(&output));
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(report.contains("write: in-transaction"), "{report}");
    assert!(
        report.contains("claim_state×20"),
        "each new key is confirmed by one read: {report}"
    );
    assert!(!report.contains("complete×"), "and never stored by the layer: {report}");
    let output = common::run_idem(
        &[&args[..], &["--write", "separate"]].concat(),
        Duration::from_secs(120),
    )
    .await;
    assert!(output.status.success(), "{}", common::describe(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("complete×20"));
}
