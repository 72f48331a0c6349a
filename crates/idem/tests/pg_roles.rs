//! Least privilege on PostgreSQL, with real roles and real `idem` processes: a DDL role migrates
//! (`idem migrate`); the gateway serves and the operator lists, inspects and deletes with the DML
//! rights of `docs/stores.md` ("PostgreSQL roles"); the upstream completes its run with `EXECUTE`
//! on `idem_complete` and reads nothing; a missing right is named with its object; and
//! `idem_complete` says why it refused (`IDEM1`/`IDEM2`/`IDEM3`), whoever calls it.

mod common;

use std::net::SocketAddr;
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Gateway, client, describe, run_idem, send};
use tokio::sync::{Mutex, Notify, mpsc};

const COMMAND_LIMIT: Duration = Duration::from_secs(60);
const PASSWORD: &str = "idem-roles-test";

/// The roles of one test, made by the server's superuser and dropped (with all they own) at the end.
struct Roles {
    /// The superuser's URL (the test server's own).
    admin: String,
    /// The store's schema, and another store's.
    schema: String,
    other: String,
}

impl Roles {
    const ALL: [&'static str; 5] = ["ddl", "gateway", "operator", "upstream", "stranger"];

    async fn create() -> Self {
        let admin = idem_test_support::servers::postgres_url();
        let schema = idem_test_support::servers::unique_name("roles");
        let roles = Self {
            admin,
            other: format!("{schema}_other"),
            schema,
        };
        let mut sql = SERIALLY.to_owned();
        for role in Self::ALL {
            sql += &format!("CREATE ROLE {} LOGIN PASSWORD '{PASSWORD}';", roles.role(role));
        }
        // The DDL role creates the store's schemas; nobody else may create anything.
        sql += &format!(
            "DO $$ BEGIN EXECUTE format('GRANT CREATE ON DATABASE %I TO {}', current_database()); END $$;",
            roles.role("ddl")
        );
        sql += "COMMIT;";
        roles.admin_sql(&sql).await;
        roles
    }

    fn role(&self, role: &str) -> String {
        format!("{}_{role}", self.schema)
    }

    /// The URL of the database as `role`, without options.
    fn database(&self, role: &str) -> String {
        let (scheme, rest) = self.admin.split_once("://").expect("a URL");
        let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
        format!("{scheme}://{}:{PASSWORD}@{host}", self.role(role))
    }

    /// The store URL as `role`.
    fn store(&self, role: &str) -> String {
        format!("{}?schema={}", self.database(role), self.schema)
    }

    async fn connect(url: &str) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|err| panic!("connect to {url}: {err}"));
        tokio::spawn(connection);
        client
    }

    async fn admin_sql(&self, sql: &str) {
        Self::connect(&self.admin)
            .await
            .batch_execute(sql)
            .await
            .unwrap_or_else(|err| panic!("{sql}: {err:?}"));
    }

    /// Migrates both stores as the DDL role, which then grants each role what docs/stores.md says.
    async fn migrate_and_grant(&self) {
        for schema in [&self.schema, &self.other] {
            let url = format!("{}?schema={schema}", self.database("ddl"));
            let migrated = run_idem(&["migrate", "--store", &url], COMMAND_LIMIT).await;
            assert!(migrated.status.success(), "{}", describe(&migrated));
        }
        let (s, o) = (&self.schema, &self.other);
        let (gateway, operator, upstream) = (self.role("gateway"), self.role("operator"), self.role("upstream"));
        let grants = format!(
            "GRANT USAGE ON SCHEMA {s} TO {gateway}, {operator}, {upstream};
             GRANT SELECT ON {s}.idem_schema_migrations TO {gateway}, {operator};
             GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.idem_records TO {gateway};
             GRANT SELECT, INSERT, UPDATE ON {s}.idem_scope_salt TO {gateway};
             GRANT EXECUTE ON FUNCTION {s}.idem_claim_insert(text, text, bytea, bytea, bytea, bigint, bigint, bigint, bigint, text, text, text) TO {gateway};
             GRANT SELECT, UPDATE, DELETE ON {s}.idem_records TO {operator};
             GRANT SELECT ON {s}.idem_scope_salt TO {operator};
             GRANT EXECUTE ON FUNCTION {s}.idem_complete(text, integer, jsonb, bytea), {s}.idem_complete(text, integer, text, bytea) TO {upstream};
             GRANT USAGE ON SCHEMA {o} TO {upstream};
             GRANT EXECUTE ON FUNCTION {o}.idem_complete(text, integer, jsonb, bytea), {o}.idem_complete(text, integer, text, bytea) TO {upstream};"
        );
        Self::connect(&self.database("ddl"))
            .await
            .batch_execute(&grants)
            .await
            .unwrap_or_else(|err| panic!("the grants: {err:?}"));
    }
}

/// Opens a transaction that changes the database's grants one test at a time: PostgreSQL refuses
/// two concurrent changes of one catalog row ("tuple concurrently updated").
const SERIALLY: &str = "BEGIN; SELECT pg_advisory_xact_lock(7303016);";

impl Drop for Roles {
    fn drop(&mut self) {
        let mut sql = format!(
            "{SERIALLY}DROP SCHEMA IF EXISTS {} CASCADE; DROP SCHEMA IF EXISTS {} CASCADE;",
            self.schema, self.other
        );
        for role in Self::ALL {
            let role = self.role(role);
            sql += &format!("DROP OWNED BY {role} CASCADE; DROP ROLE {role};");
        }
        sql += "COMMIT;";
        let admin = self.admin.clone();
        // A runtime of its own: the test's may be shutting down.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(async move {
                let (client, connection) = tokio_postgres::connect(&admin, tokio_postgres::NoTls).await?;
                tokio::spawn(connection);
                client.batch_execute(&sql).await
            })?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) && !std::thread::panicking() {
            panic!("dropping the test's roles: {dropped:?}");
        }
    }
}

/// What `idem_complete` answered: `Ok`, or the SQLSTATE and the message.
type Called = Result<(), (String, String)>;

fn called(result: Result<u64, tokio_postgres::Error>) -> Called {
    result.map(drop).map_err(|err| match err.as_db_error() {
        Some(db) => (db.code().code().to_owned(), db.message().to_owned()),
        None => (String::new(), err.to_string()),
    })
}

/// `schema.idem_complete(token, 201, headers as text, body)` on `client`.
async fn complete(client: &impl tokio_postgres::GenericClient, schema: &str, token: &str, headers: &str) -> Called {
    called(
        client
            .execute(
                &format!("SELECT {schema}.idem_complete($1, 201, $2::text, $3)"),
                &[&token, &headers, &&br#"{"paid":true}"#[..]],
            )
            .await,
    )
}

/// The upstream: `/complete` completes its run in its own transaction as the upstream role (after
/// trying to divert `idem_complete` to a table of its own); `/hold` hands its token to the test
/// and answers when told.
#[derive(Clone)]
struct Upstream {
    database: String,
    schema: String,
    outcomes: Arc<Mutex<Vec<Called>>>,
    tokens: mpsc::UnboundedSender<String>,
    release: Arc<Notify>,
}

impl Upstream {
    async fn start(database: String, schema: String) -> (Self, mpsc::UnboundedReceiver<String>, String) {
        let (tokens, received) = mpsc::unbounded_channel();
        let upstream = Self {
            database,
            schema,
            outcomes: Arc::default(),
            tokens,
            release: Arc::default(),
        };
        let app = axum::Router::new()
            .route("/complete", post(complete_in_transaction))
            .route("/hold", post(hold))
            .with_state(upstream.clone());
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move { axum::serve(listener, app).await });
        (upstream, received, url)
    }
}

fn token_of(headers: &HeaderMap) -> String {
    headers
        .get("idempotency-token")
        .and_then(|v| v.to_str().ok())
        .expect("the gateway sends Idempotency-Token")
        .to_owned()
}

async fn complete_in_transaction(State(upstream): State<Upstream>, headers: HeaderMap) -> Response {
    let token = token_of(&headers);
    let mut client = Roles::connect(&upstream.database).await;
    let tx = client.transaction().await.expect("begin");
    // A table of the caller's own named like the store's, first on its search_path: the function
    // must not write there (its search_path is pinned: the store's schema, then pg_temp).
    tx.batch_execute(
        "CREATE TEMP TABLE idem_records (scope TEXT, key TEXT, token BYTEA, state TEXT, waiters INTEGER);
         SET LOCAL search_path = pg_temp",
    )
    .await
    .expect("the decoy");
    let outcome = complete(&tx, &upstream.schema, &token, r#"{"Content-Type": "application/json"}"#).await;
    let decoy: i64 = tx
        .query_one("SELECT count(*) FROM pg_temp.idem_records", &[])
        .await
        .expect("count the decoy")
        .get(0);
    assert_eq!(decoy, 0, "idem_complete wrote nothing in the caller's table");
    upstream.outcomes.lock().await.push(outcome.clone());
    if outcome.is_err() {
        drop(tx.rollback().await);
        return (StatusCode::CONFLICT, "refused").into_response();
    }
    tx.commit().await.expect("commit");
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        r#"{"paid":true}"#,
    )
        .into_response()
}

async fn hold(State(upstream): State<Upstream>, headers: HeaderMap) -> Response {
    let released = upstream.release.notified();
    upstream.tokens.send(token_of(&headers)).expect("the test listens");
    released.await;
    (StatusCode::CREATED, "held").into_response()
}

fn pay(gateway: &Gateway, path: &str, key: &str) -> reqwest::RequestBuilder {
    client()
        .post(gateway.url(path))
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body("{}")
}

/// Runs `idem serve` on `store`, expecting it to refuse to start (it must not listen).
async fn serve_refused(store: &str, upstream: &str) -> Output {
    common::serve_to_end(upstream, store, COMMAND_LIMIT).await
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_and_the_operator_work_with_dml_rights_only() {
    let roles = Roles::create().await;
    roles.migrate_and_grant().await;
    let upstream = common::Upstream::start().await;
    let gateway = Gateway::start_on_store(&upstream.url(), &roles.store("gateway"), &[]).await;
    let first = gateway.post_json("/pay", Some("k1"), "{}").await;
    assert_eq!(first.status, 201, "{first}");
    let replay = gateway.post_json("/pay", Some("k1"), "{}").await;
    assert!(replay.replayed(), "{replay}");
    assert_eq!(replay.text(), first.text());

    let operator = roles.store("operator");
    let listed = run_idem(&["list", "--store", &operator, "--json"], COMMAND_LIMIT).await;
    assert!(listed.status.success(), "{}", describe(&listed));
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains("\"k1\""),
        "{}",
        describe(&listed)
    );
    let inspected = run_idem(&["inspect", "--store", &operator, "k1"], COMMAND_LIMIT).await;
    assert!(inspected.status.success(), "{}", describe(&inspected));
    let deleted = run_idem(&["delete", "--store", &operator, "k1"], COMMAND_LIMIT).await;
    assert!(deleted.status.success(), "{}", describe(&deleted));
    let again = gateway.post_json("/pay", Some("k1"), "{}").await;
    assert_eq!(again.status, 201);
    assert!(!again.replayed(), "deleted: the key ran again");
    assert_eq!(upstream.state.pay.load(std::sync::atomic::Ordering::SeqCst), 2);

    // The operator's role cannot claim: the gateway refuses to start on it, naming what it lacks.
    let refused = serve_refused(&operator, &upstream.url()).await;
    assert_eq!(refused.status.code(), Some(1), "{}", describe(&refused));
    assert!(
        stderr(&refused).contains(&format!("INSERT on table {}.idem_records", roles.schema)),
        "{}",
        describe(&refused)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_completes_with_execute_alone_and_reads_nothing() {
    let roles = Roles::create().await;
    roles.migrate_and_grant().await;
    let (upstream, _tokens, url) = Upstream::start(roles.database("upstream"), roles.schema.clone()).await;
    let gateway = Gateway::start_on_store(&url, &roles.store("gateway"), &["--in-transaction"]).await;
    let first = send(pay(&gateway, "/complete", "k1")).await;
    assert_eq!(first.status, 201, "{first}");
    assert_eq!(
        *upstream.outcomes.lock().await,
        [Ok(())],
        "idem_complete took the answer"
    );
    let replay = send(pay(&gateway, "/complete", "k1")).await;
    assert!(
        replay.replayed(),
        "the upstream's transaction stored the answer: {replay}"
    );
    assert_eq!(replay.text(), r#"{"paid":true}"#);
    assert_eq!(upstream.outcomes.lock().await.len(), 1, "the upstream ran once");

    let s = &roles.schema;
    let as_upstream = Roles::connect(&roles.database("upstream")).await;
    for statement in [
        format!("SELECT count(*) FROM {s}.idem_records"),
        format!("SELECT count(*) FROM {s}.idem_scope_salt"),
        format!("UPDATE {s}.idem_records SET state = 'unknown'"),
        // Invoker functions stay the caller's rights: no way round through them.
        format!("SELECT {s}.idem_complete_claim('a', 'k1', '\\x00', '\\x00', 0, 0, 0, '', 201)"),
    ] {
        let refused = called(as_upstream.execute(&statement, &[]).await);
        assert_eq!(
            refused.as_ref().map_err(|(code, _)| code.as_str()),
            Err("42501"),
            "{statement}: {refused:?}"
        );
    }
    // Without the grant, no completion: EXECUTE is not PUBLIC's.
    let stranger = Roles::connect(&roles.database("stranger")).await;
    roles
        .admin_sql(&format!("GRANT USAGE ON SCHEMA {s} TO {}", roles.role("stranger")))
        .await;
    let refused = complete(&stranger, s, "idem1.00.00.00.0.0", "{}").await;
    let (code, message) = refused.expect_err("no EXECUTE, no completion");
    assert_eq!(code, "42501");
    assert!(message.contains("function idem_complete"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_right_is_named_with_its_object() {
    let roles = Roles::create().await;
    roles.migrate_and_grant().await;
    let s = &roles.schema;
    let upstream = common::Upstream::start().await;

    // No USAGE on the schema: every command says so, exit 1.
    let stranger = roles.store("stranger");
    let usage = format!("lacks USAGE on schema {s}");
    let listed = run_idem(&["list", "--store", &stranger], COMMAND_LIMIT).await;
    let served = serve_refused(&stranger, &upstream.url()).await;
    for (command, output) in [("list", &listed), ("serve", &served)] {
        assert_eq!(output.status.code(), Some(1), "{command}: {}", describe(output));
        assert!(stderr(output).contains(&usage), "{command}: {}", describe(output));
    }

    // A right missing on a table: named with the table.
    roles
        .admin_sql(&format!(
            "REVOKE DELETE ON {s}.idem_records FROM {}",
            roles.role("gateway")
        ))
        .await;
    let served = serve_refused(&roles.store("gateway"), &upstream.url()).await;
    assert_eq!(served.status.code(), Some(1), "{}", describe(&served));
    assert!(
        stderr(&served).contains(&format!("DELETE on table {s}.idem_records")),
        "{}",
        describe(&served)
    );
    roles
        .admin_sql(&format!(
            "GRANT DELETE ON {s}.idem_records TO {}",
            roles.role("gateway")
        ))
        .await;

    // A schema one version behind (its newest version hidden): the gateway's role cannot migrate
    // it and says who can.
    let versions = format!("{s}.idem_schema_migrations");
    roles
        .admin_sql(&format!(
            "UPDATE {versions} SET version = -version WHERE version = (SELECT max(version) FROM {versions})"
        ))
        .await;
    let served = serve_refused(&roles.store("gateway"), &upstream.url()).await;
    assert_eq!(served.status.code(), Some(1), "{}", describe(&served));
    let said = stderr(&served);
    assert!(said.contains(&format!("CREATE on schema {s}")), "{said}");
    assert!(
        said.contains(&format!("the ownership of table {s}.idem_records")),
        "{said}"
    );
    assert!(said.contains("run `idem migrate` with a role that has it"), "{said}");
    roles
        .admin_sql(&format!("UPDATE {versions} SET version = -version WHERE version < 0"))
        .await;
    let gateway = Gateway::start_on_store(&upstream.url(), &roles.store("gateway"), &[]).await;
    assert_eq!(gateway.post_json("/pay", Some("k1"), "{}").await.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_complete_names_the_cause_of_a_refusal() {
    let roles = Roles::create().await;
    roles.migrate_and_grant().await;
    let (s, other) = (roles.schema.as_str(), roles.other.as_str());
    let (upstream, mut tokens, url) = Upstream::start(roles.database("upstream"), roles.schema.clone()).await;
    let gateway = Gateway::start_on_store(&url, &roles.store("gateway"), &[]).await;
    let mut held = Vec::new();
    let mut hand_over = async |key: &str| {
        let request = pay(&gateway, "/hold", key);
        held.push(tokio::spawn(async move { drop(common::try_send(request).await) }));
        tokio::time::timeout(COMMAND_LIMIT, tokens.recv())
            .await
            .expect("the upstream received the run")
            .expect("a token")
    };
    let (k1, k2, k3) = (hand_over("k1").await, hand_over("k2").await, hand_over("k3").await);
    let with_field = |token: &str, at: usize, value: &str| {
        let mut parts: Vec<&str> = token.split('.').collect();
        parts[at] = value;
        parts.join(".")
    };
    let mut client = Roles::connect(&roles.database("upstream")).await;
    let json = r#"{"Content-Type": "application/json"}"#;
    let mut cases: Vec<(&str, Called, &str, String)> = vec![
        (
            "headers that are not JSON",
            complete(&client, s, &k1, "not json").await,
            "IDEM2",
            "headers are not JSON".to_owned(),
        ),
        (
            "headers that are JSON but not an object",
            complete(&client, s, &k1, "[1]").await,
            "IDEM2",
            "not a JSON array".to_owned(),
        ),
        (
            "a ttl out of range",
            complete(&client, s, &with_field(&k1, 4, "9223372036854775807"), json).await,
            "IDEM3",
            "ttl (its fifth field), 9223372036854775807 ms, is out of range".to_owned(),
        ),
        (
            "a retention that is no number",
            complete(&client, s, &with_field(&k1, 5, "forever"), json).await,
            "IDEM3",
            "tombstone retention (its sixth field) is not valid".to_owned(),
        ),
        (
            "a token of another store's schema",
            complete(&client, other, &k1, json).await,
            "IDEM1",
            format!("no record of this key in schema {other}"),
        ),
    ];
    // Twice in one transaction; then the first commits, and the token is spent.
    let tx = client.transaction().await.expect("begin");
    assert_eq!(complete(&tx, s, &k1, json).await, Ok(()));
    cases.push((
        "completed already in this transaction",
        complete(&tx, s, &k1, json).await,
        "IDEM1",
        "completed its record already, in this transaction".to_owned(),
    ));
    drop(tx.rollback().await);
    let tx = client.transaction().await.expect("begin");
    assert_eq!(complete(&tx, s, &k1, json).await, Ok(()));
    tx.commit().await.expect("commit");
    cases.push((
        "completed already by a committed transaction",
        complete(&client, s, &k1, json).await,
        "IDEM1",
        "completed its record already, in a transaction that committed before".to_owned(),
    ));
    // The operator deletes k2 in flight (fenced), then deletes what is left.
    let operator = roles.store("operator");
    for (case, cause) in [
        ("deleted in flight", "the claim was released"),
        ("deleted", "it was deleted"),
    ] {
        let deleted = run_idem(&["delete", "--store", &operator, "k2"], COMMAND_LIMIT).await;
        assert!(deleted.status.success(), "{}", describe(&deleted));
        cases.push((case, complete(&client, s, &k2, json).await, "IDEM1", cause.to_owned()));
    }
    // k3 taken over by another run (its lease ran out): another token on the record; then that
    // run completed it.
    for (case, change, cause) in [
        (
            "taken over",
            "token = '\\x0102'",
            "another run took the key over (this run's lease ran out) and holds it now",
        ),
        (
            "taken over and completed",
            "state = 'completed'",
            "another run took the key over (this run's lease ran out) and completed it",
        ),
    ] {
        roles
            .admin_sql(&format!("UPDATE {s}.idem_records SET {change} WHERE key = 'k3'"))
            .await;
        cases.push((case, complete(&client, s, &k3, json).await, "IDEM1", cause.to_owned()));
    }
    upstream.release.notify_waiters();
    for request in held {
        drop(request.await);
    }
    for (case, outcome, code, cause) in cases {
        let (got, message) = outcome.expect_err(case);
        assert_eq!(got, code, "{case}: {message}");
        assert!(message.contains(&cause), "{case}: {message:?} does not say {cause:?}");
    }
}
