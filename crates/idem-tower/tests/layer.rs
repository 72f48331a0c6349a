//! The layer around an axum app, on a real SQLite store: store round trips, lease renewal,
//! hang-ups, scopes from the application, routes, and retention on an injected clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use axum::Router;
use axum::body::Body as AxumBody;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use idem_core::store::StoreOperation as Operation;
use idem_core::testkit::{CountingStore, counting};
use idem_core::{
    ManualClock, MissingKeyPolicy, Policy, RouteRule, Routes, Scope, ScopeSource, Store, StoreError, UnixMillis,
    store::{
        Begin, BeginRequest, Checkpoint, ClaimState, Completion, FencingToken, ListQuery, Listed, Purged, Record,
        RecordId, Release, ScopeSalt, StoreIdentity, WaitOutcome,
    },
};
use idem_sqlite::SqliteStore;
use idem_tower::{CheckpointError, Checkpoints, IdempotencyLayer};
use tower::ServiceExt;

struct App {
    router: Router,
    runs: Arc<AtomicUsize>,
    _dir: tempfile::TempDir,
}

async fn sqlite() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("idem.db"))
        .await
        .expect("open sqlite");
    (store, dir)
}

/// A SQLite store that counts its operations (shared, to read the counts), and its folder.
async fn counted_sqlite() -> (Arc<CountingStore<SqliteStore>>, tempfile::TempDir) {
    let (store, dir) = sqlite().await;
    (Arc::new(counting(store)), dir)
}

/// Deletes the scope salt of the SQLite file at `path`, as a store written by a version before
/// salts has none.
async fn forget_the_salt(path: &std::path::Path) {
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("open the SQLite file");
    sqlx::query("DELETE FROM idem_scope_salt")
        .execute(&pool)
        .await
        .expect("delete the salt");
    pool.close().await;
}

/// `POST /pay` counts its runs, sleeps `?ms=N` and answers 201 with the run number.
fn app(layer: IdempotencyLayer, dir: tempfile::TempDir) -> App {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let router = Router::new()
        .route(
            "/pay",
            post(move |query: axum::extract::RawQuery| {
                let counter = counter.clone();
                async move {
                    let ms = query.0.and_then(|q| q.strip_prefix("ms=")?.parse().ok()).unwrap_or(0);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    let run = counter.fetch_add(1, Ordering::SeqCst) + 1;
                    (StatusCode::CREATED, format!("run {run}"))
                }
            }),
        )
        .layer(layer)
        // Built once, as `axum::serve` does, not again for every request.
        .with_state(());
    App {
        router,
        runs,
        _dir: dir,
    }
}

fn pay(key: &str, query: &str) -> Request<AxumBody> {
    Request::post(format!("/pay{query}"))
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body(AxumBody::from(r#"{"amount":10}"#))
        .expect("request")
}

async fn send(router: &Router, request: Request<AxumBody>) -> (StatusCode, bool, String) {
    let response = router.clone().oneshot(request).await.expect("infallible");
    let replayed = response
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let status = response.status();
    let body = response.into_body().collect().await.expect("body").to_bytes();
    (status, replayed, String::from_utf8_lossy(&body).into_owned())
}

/// Sends each row's request in turn: each must be answered 201 with the row's body, replayed or
/// not as the row says. A row is `(what it shows, request, replayed, body)`; a failure names it.
async fn expect_created<'a>(
    router: &Router,
    rows: impl IntoIterator<Item = (&'a str, Request<AxumBody>, bool, &'a str)>,
) {
    for (row, request, replayed, body) in rows {
        assert_eq!(
            send(router, request).await,
            (StatusCode::CREATED, replayed, body.to_owned()),
            "{row}"
        );
    }
}

fn pay_as(key: &str, credential: &'static str) -> Request<AxumBody> {
    let mut request = pay(key, "");
    request
        .headers_mut()
        .insert("authorization", axum::http::HeaderValue::from_static(credential));
    request
}

/// A caller's credential costs no store operation per request: the store's salt is read once.
/// On a store that held records before it had a salt (an upgrade), a key new under the keyed
/// hash costs one read more, to find a record stored under the unsalted scope, which replays.
#[tokio::test]
async fn credential_scopes_read_the_salt_once_and_look_up_older_records_only_after_an_upgrade() {
    let (store, dir) = counted_sqlite().await;
    let layer = IdempotencyLayer::from_shared(store.clone());
    let fresh = app(layer.clone(), dir);
    let mut salt_reads = Vec::new();
    for (key, replayed) in [("k1", false), ("k1", true), ("k2", false)] {
        store.reset();
        assert_eq!(send(&fresh.router, pay_as(key, "Bearer alice")).await.1, replayed);
        assert_eq!(store.total(), if replayed { 1 } else { 2 }, "{key}");
        salt_reads.push(store.count(Operation::ScopeSalt));
    }
    // A router built again from the same layer (as an unfinished axum router does for every
    // request) shares the salt already read.
    let again = app(layer, tempfile::tempdir().unwrap());
    store.reset();
    assert!(!send(&again.router, pay_as("k3", "Bearer alice")).await.1);
    salt_reads.push(store.count(Operation::ScopeSalt));
    assert_eq!(salt_reads, [1, 0, 0, 0], "read once, at the first request");

    // A store with a record from before the salt: the previous version's unsalted scope.
    let (old, dir) = counted_sqlite().await;
    let unsalted = {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(b"Bearer alice");
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        Scope::from_stored(format!("cred:{hex}"))
    };
    let before = app(
        IdempotencyLayer::from_shared(old.clone()).with_policy(Policy {
            scope: ScopeSource::Extension,
            ..Policy::default()
        }),
        tempfile::tempdir().unwrap(),
    );
    let mut request = pay("old", "");
    request.extensions_mut().insert(unsalted.clone());
    assert_eq!(
        send(&before.router, request).await,
        (StatusCode::CREATED, false, "run 1".into())
    );
    drop(before);
    // The previous version made no salt: the one this version made for that first request goes.
    forget_the_salt(&dir.path().join("idem.db")).await;

    let upgraded = app(IdempotencyLayer::from_shared(old.clone()), dir);
    let replay = send(&upgraded.router, pay_as("old", "Bearer alice")).await;
    assert_eq!(
        replay,
        (StatusCode::CREATED, true, "run 1".into()),
        "stored before the upgrade"
    );
    assert_eq!(upgraded.runs.load(Ordering::SeqCst), 0);
    old.reset();
    assert!(
        !send(&upgraded.router, pay_as("new", "Bearer alice")).await.1,
        "a new key runs"
    );
    assert_eq!(old.count(Operation::Get), 1, "one look under the unsalted scope");
    assert_eq!(old.total(), 3, "begin, the look, complete");
}

#[tokio::test]
async fn a_new_request_costs_two_store_operations_and_a_replay_one() {
    let (store, dir) = counted_sqlite().await;
    let app = app(IdempotencyLayer::from_shared(store.clone()), dir);

    assert_eq!(
        send(&app.router, pay("k1", "")).await,
        (StatusCode::CREATED, false, "run 1".into())
    );
    assert_eq!(store.count(Operation::Begin), 1);
    assert_eq!(store.count(Operation::Complete), 1);
    assert_eq!(store.total(), 2, "a new keyed request is begin + complete");

    store.reset();
    assert_eq!(
        send(&app.router, pay("k1", "")).await,
        (StatusCode::CREATED, true, "run 1".into())
    );
    assert_eq!(store.count(Operation::Begin), 1);
    assert_eq!(store.total(), 1, "a replay is one begin");

    store.reset();
    let keyless = Request::post("/pay").body(AxumBody::empty()).expect("request");
    assert_eq!(send(&app.router, keyless).await.0, StatusCode::CREATED);
    assert_eq!(
        store.total(),
        0,
        "a keyless request under the allow policy never touches the store"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_slow_handler_keeps_its_lease() {
    let (store, dir) = counted_sqlite().await;
    let layer = IdempotencyLayer::from_shared(store.clone()).with_lease(Duration::from_millis(300));
    let app = app(layer, dir);

    let router = app.router.clone();
    let first = tokio::spawn(async move { send(&router, pay("slow", "?ms=1500")).await });
    // Well past the first lease: without renewal this copy would take the key over and run again.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let copy = send(&app.router, pay("slow", "?ms=1500")).await;
    let first = first.await.expect("task");
    assert_eq!(first, (StatusCode::CREATED, false, "run 1".into()));
    assert_eq!(
        copy,
        (StatusCode::CREATED, true, "run 1".into()),
        "the copy waited and got the replay"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "the handler ran once");
    assert!(
        store.count(Operation::Renew) >= 2,
        "the lease was renewed while the handler ran"
    );
}

#[tokio::test]
async fn a_client_hanging_up_does_not_cancel_the_handler() {
    let (store, dir) = sqlite().await;
    let layer = IdempotencyLayer::new(store);
    let tasks = layer.tasks();
    let app = app(layer, dir);

    let hung_up = tokio::time::timeout(Duration::from_millis(100), send(&app.router, pay("gone", "?ms=500"))).await;
    assert!(hung_up.is_err(), "the client gave up before the answer");
    tasks.close();
    tasks.wait().await;
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "the handler ran to completion");
    assert_eq!(
        send(&app.router, pay("gone", "?ms=500")).await,
        (StatusCode::CREATED, true, "run 1".into())
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn scopes_can_come_from_the_application() {
    let (store, dir) = sqlite().await;
    let layer = IdempotencyLayer::new(store).with_scope(ScopeSource::Extension);
    let app = app(layer, dir);
    let as_tenant = |tenant: &str| {
        let mut request = pay("shared-key", "");
        request.extensions_mut().insert(Scope::application(tenant));
        request
    };
    expect_created(
        &app.router,
        [
            ("the first tenant runs", as_tenant("acme"), false, "run 1"),
            ("another tenant's same key runs", as_tenant("globex"), false, "run 2"),
            ("the first tenant's key replays", as_tenant("acme"), true, "run 1"),
        ],
    )
    .await;
}

#[tokio::test]
async fn answers_expire_to_tombstones_then_disappear() {
    let (store, dir) = sqlite().await;
    let clock = ManualClock::starting_now();
    let layer = IdempotencyLayer::new(store)
        .with_clock(Arc::new(clock.clone()))
        .with_ttl(Duration::from_secs(3600))
        .with_tombstone_ttl(Duration::from_secs(7200));
    let app = app(layer, dir);

    assert_eq!(send(&app.router, pay("order-1", "")).await.0, StatusCode::CREATED);
    clock.advance(Duration::from_secs(3599));
    assert!(
        send(&app.router, pay("order-1", "")).await.1,
        "replayable within the ttl"
    );
    clock.advance(Duration::from_secs(2));
    let (status, _, body) = send(&app.router, pay("order-1", "")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(body.contains("key-expired") && body.contains("new key"), "{body}");
    clock.advance(Duration::from_secs(3600));
    assert_eq!(
        send(&app.router, pay("order-1", "")).await,
        (StatusCode::CREATED, false, "run 2".into())
    );
}

/// How the handler's first run ends.
#[derive(Debug, Clone, Copy)]
enum FirstRun {
    /// It panics after it may have acted (outcome unknown).
    Panics,
    /// It hangs, as an upstream that never answers.
    Hangs,
}

/// `POST /pay` behind `layer`: its first run ends as `first` says; later ones answer 201
/// `run <n> recovered=<flag>`. Also the count of runs.
fn first_run(first: FirstRun, layer: IdempotencyLayer) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let router = Router::new()
        .route(
            "/pay",
            post(move |info: axum::Extension<idem_tower::IdempotencyInfo>| {
                let counter = counter.clone();
                async move {
                    let run = counter.fetch_add(1, Ordering::SeqCst) + 1;
                    if run == 1 {
                        match first {
                            FirstRun::Panics => panic!("the handler's first run panics after it may have acted"),
                            FirstRun::Hangs => std::future::pending::<()>().await,
                        }
                    }
                    (StatusCode::CREATED, format!("run {run} recovered={}", info.recovered))
                }
            }),
        )
        .layer(layer);
    (router, runs)
}

/// A key whose run ended without an answer (a panic: outcome unknown) expires at its ttl as an
/// answered key does: past it the retry is `422 key-expired` until the tombstone's end, never a
/// run without `recovered`.
#[tokio::test]
async fn an_unknown_outcome_expires_at_its_ttl_and_keeps_a_tombstone() {
    let (store, dir) = sqlite().await;
    let clock = ManualClock::starting_now();
    let (router, runs) = first_run(
        FirstRun::Panics,
        IdempotencyLayer::new(store)
            .with_clock(Arc::new(clock.clone()))
            .with_ttl(Duration::from_secs(3600))
            .with_tombstone_ttl(Duration::from_secs(7200)),
    );

    let (status, _, body) = send(&router, pay("k", "")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    clock.advance(Duration::from_secs(3601));
    let (status, _, body) = send(&router, pay("k", "")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body.contains("key-expired") && body.contains("new key"), "{body}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "not run again past the ttl");
    clock.advance(Duration::from_secs(3600));
    assert_eq!(
        send(&router, pay("k", "")).await,
        (StatusCode::CREATED, false, "run 2 recovered=false".into()),
        "past the tombstone the key is new"
    );
    drop(dir);
}

/// A claim whose holder vanished (its lease ended: here an instance whose clock is three hours
/// behind) is taken over only within its ttl: past it the key is `422 key-expired`.
#[tokio::test]
async fn an_abandoned_claim_past_its_ttl_is_key_expired() {
    let (store, dir) = sqlite().await;
    let now = UnixMillis::now();
    let behind = ManualClock::new(now.minus(Duration::from_secs(3 * 3600)));
    let layer = |clock: ManualClock| {
        IdempotencyLayer::new(store.clone())
            .with_clock(Arc::new(clock))
            .with_ttl(Duration::from_secs(3600))
    };
    let holder = app(layer(behind), dir);
    let hung = tokio::spawn({
        let router = holder.router.clone();
        async move { send(&router, pay("k", "?ms=3000")).await }
    });
    // The holder's claim is made (an anonymous caller's), under its lease of 60 s on its clock.
    let id = RecordId {
        scope: Scope::anonymous(),
        key: idem_core::IdempotencyKey::new("k").unwrap(),
    };
    for attempt in 0.. {
        if store.get(&id).await.unwrap().is_some() {
            break;
        }
        assert!(attempt < 500, "the holder never claimed the key");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let retry = app(layer(ManualClock::new(now)), tempfile::tempdir().unwrap());
    let (status, _, body) = send(&retry.router, pay("k", "?ms=3000")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body.contains("key-expired"), "{body}");
    assert_eq!(retry.runs.load(Ordering::SeqCst), 0, "not run again past the ttl");
    hung.abort();
}

#[tokio::test]
async fn provisional_keys_dedupe_a_double_tap_and_leave_no_tombstone() {
    let (store, dir) = sqlite().await;
    let clock = ManualClock::starting_now();
    let layer = IdempotencyLayer::new(store)
        .with_clock(Arc::new(clock.clone()))
        .with_missing_key(MissingKeyPolicy::Fingerprint {
            window: Duration::from_secs(5),
        });
    let app = app(layer, dir);
    // One caller's double tap: a provisional key is per caller, and an anonymous one has none.
    let tap = || {
        Request::post("/pay")
            .header("authorization", "Bearer alice")
            .body(AxumBody::from("amount=10"))
            .expect("request")
    };
    let other = Request::post("/pay")
        .header("authorization", "Bearer alice")
        .body(AxumBody::from("amount=11"))
        .expect("request");
    expect_created(
        &app.router,
        [
            ("the first tap runs", tap(), false, "run 1"),
            ("the double tap is caught", tap(), true, "run 1"),
            ("another body runs", other, false, "run 2"),
        ],
    )
    .await;
    clock.advance(Duration::from_secs(6));
    // Without a credential nothing tells two callers apart: their requests pass through.
    let anonymous = || {
        Request::post("/pay")
            .body(AxumBody::from("amount=12"))
            .expect("request")
    };
    expect_created(
        &app.router,
        [
            (
                "after the window the same body is a new request, not key-expired",
                tap(),
                false,
                "run 3",
            ),
            ("an anonymous caller runs", anonymous(), false, "run 4"),
            (
                "two anonymous callers never share an answer",
                anonymous(),
                false,
                "run 5",
            ),
        ],
    )
    .await;
}

/// A store whose server cannot be reached: every operation fails.
#[derive(Debug)]
struct Unreachable;

fn down() -> StoreError {
    StoreError::unavailable(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "connection refused",
    ))
}

#[async_trait]
impl Store for Unreachable {
    async fn begin(&self, _: BeginRequest<'_>) -> Result<Begin, StoreError> {
        Err(down())
    }
    async fn complete(&self, _: &RecordId, _: FencingToken, _: Completion) -> Result<(), StoreError> {
        Err(down())
    }
    async fn claim_state(&self, _: &RecordId, _: FencingToken) -> Result<ClaimState, StoreError> {
        Err(down())
    }
    fn completes_in_transactions(&self) -> bool {
        false
    }
    async fn release(&self, _: &RecordId, _: FencingToken, _: Release) -> Result<(), StoreError> {
        Err(down())
    }
    async fn renew(&self, _: &RecordId, _: FencingToken, _: UnixMillis) -> Result<(), StoreError> {
        Err(down())
    }
    async fn get(&self, _: &RecordId) -> Result<Option<Record>, StoreError> {
        Err(down())
    }
    async fn scope_salt(&self, _: ScopeSalt) -> Result<ScopeSalt, StoreError> {
        Err(down())
    }
    async fn identity(&self) -> Result<Option<StoreIdentity>, StoreError> {
        Err(down())
    }
    async fn delete(&self, _: &RecordId) -> Result<Option<Record>, StoreError> {
        Err(down())
    }
    async fn checkpoint(&self, _: &RecordId, _: FencingToken, _: Checkpoint) -> Result<(), StoreError> {
        Err(down())
    }
    async fn checkpoints(&self, _: &RecordId) -> Result<Vec<Checkpoint>, StoreError> {
        Err(down())
    }
    async fn wait(&self, _: &RecordId, _: FencingToken, _: tokio::time::Instant) -> Result<WaitOutcome, StoreError> {
        Err(down())
    }
    async fn purge(&self, _: UnixMillis, _: usize) -> Result<Purged, StoreError> {
        Err(down())
    }
    async fn ping(&self) -> Result<(), StoreError> {
        Err(down())
    }
    async fn clock(&self) -> Result<UnixMillis, StoreError> {
        Err(down())
    }
    fn invalidations(&self) -> Option<std::sync::Arc<idem_core::store::Invalidations>> {
        None
    }
    fn count_replay(&self, _: &RecordId) {}
    async fn list(&self, _: &ListQuery) -> Result<Vec<Listed>, StoreError> {
        Err(down())
    }
}

#[tokio::test]
async fn an_unreachable_store_fails_closed_unless_told_otherwise() {
    let closed = app(IdempotencyLayer::new(Unreachable), tempfile::tempdir().expect("dir"));
    let response = closed.router.clone().oneshot(pay("k", "")).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().contains_key("retry-after"));
    assert_eq!(closed.runs.load(Ordering::SeqCst), 0, "nothing runs without a claim");

    let open = app(
        IdempotencyLayer::new(Unreachable).with_fail_open(true),
        tempfile::tempdir().expect("dir"),
    );
    assert_eq!(
        send(&open.router, pay("k", "")).await,
        (StatusCode::CREATED, false, "run 1".into())
    );
}

/// The problem type of an answer, if it is a problem.
fn problem_type(body: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(body).ok()?;
    value.get("type")?.as_str().map(str::to_owned)
}

#[tokio::test]
async fn a_panicking_handler_is_a_problem_and_its_retry_runs_marked_recovered() {
    let (store, dir) = sqlite().await;
    let (router, runs) = first_run(FirstRun::Panics, IdempotencyLayer::new(store));

    let (status, replayed, body) = send(&router, pay("k", "")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert!(!replayed);
    assert_eq!(
        problem_type(&body).as_deref(),
        Some("urn:idem:problem:internal-error"),
        "{body}"
    );

    // The key was released as unknown at once (no lease to wait out): the retry runs, told that
    // the first run may have had effects, and its answer is the one kept.
    let retry = send(&router, pay("k", "")).await;
    assert_eq!(retry, (StatusCode::CREATED, false, "run 2 recovered=true".into()));
    let again = send(&router, pay("k", "")).await;
    assert_eq!(again, (StatusCode::CREATED, true, "run 2 recovered=true".into()));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    drop(dir);
}

#[tokio::test]
async fn a_panic_in_the_layer_is_a_problem_not_a_dead_connection() {
    let (store, dir) = sqlite().await;
    let (mut held, _, _) = Held::new(store);
    held.begin_panics = true;
    let app = app(IdempotencyLayer::new(held), dir);
    let (status, _, body) = send(&app.router, pay("k", "")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert_eq!(
        problem_type(&body).as_deref(),
        Some("urn:idem:problem:internal-error"),
        "{body}"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 0, "nothing runs without a claim");
}

/// A real SQLite store whose `begin` or `renew` can be held shut, as a held lock or a half-open
/// connection would hold them, or whose `begin` panics, as a bug would.
#[derive(Debug)]
struct Held {
    store: SqliteStore,
    begin: tokio::sync::watch::Receiver<bool>,
    renew: tokio::sync::watch::Receiver<bool>,
    renewals_started: AtomicUsize,
    begin_panics: bool,
    /// While set, `begin` runs in the store and its reply is lost (`Unavailable`).
    begin_reply_lost: Arc<AtomicBool>,
}

impl Held {
    /// Over `store`, with `begin` and `renew` shut until their senders send `true`.
    fn new(store: SqliteStore) -> (Self, tokio::sync::watch::Sender<bool>, tokio::sync::watch::Sender<bool>) {
        let (open_begin, begin) = tokio::sync::watch::channel(false);
        let (open_renew, renew) = tokio::sync::watch::channel(false);
        let held = Self {
            store,
            begin,
            renew,
            renewals_started: AtomicUsize::new(0),
            begin_panics: false,
            begin_reply_lost: Arc::default(),
        };
        (held, open_begin, open_renew)
    }
}

async fn opened(gate: &tokio::sync::watch::Receiver<bool>) {
    let mut gate = gate.clone();
    let _ = gate.wait_for(|open| *open).await;
}

#[async_trait]
impl Store for Held {
    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin, StoreError> {
        assert!(!self.begin_panics, "a bug in the store");
        opened(&self.begin).await;
        let begun = self.store.begin(request).await;
        if self.begin_reply_lost.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable(std::io::Error::other("the reply was lost")));
        }
        begun
    }
    async fn complete(&self, id: &RecordId, token: FencingToken, done: Completion) -> Result<(), StoreError> {
        self.store.complete(id, token, done).await
    }
    async fn claim_state(&self, id: &RecordId, token: FencingToken) -> Result<ClaimState, StoreError> {
        self.store.claim_state(id, token).await
    }
    fn completes_in_transactions(&self) -> bool {
        self.store.completes_in_transactions()
    }
    async fn release(&self, id: &RecordId, token: FencingToken, how: Release) -> Result<(), StoreError> {
        self.store.release(id, token, how).await
    }
    async fn renew(&self, id: &RecordId, token: FencingToken, until: UnixMillis) -> Result<(), StoreError> {
        self.renewals_started.fetch_add(1, Ordering::SeqCst);
        opened(&self.renew).await;
        self.store.renew(id, token, until).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.store.get(id).await
    }
    async fn scope_salt(&self, candidate: ScopeSalt) -> Result<ScopeSalt, StoreError> {
        self.store.scope_salt(candidate).await
    }
    async fn identity(&self) -> Result<Option<StoreIdentity>, StoreError> {
        self.store.identity().await
    }
    async fn delete(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.store.delete(id).await
    }
    async fn checkpoint(&self, id: &RecordId, token: FencingToken, checkpoint: Checkpoint) -> Result<(), StoreError> {
        self.store.checkpoint(id, token, checkpoint).await
    }
    async fn checkpoints(&self, id: &RecordId) -> Result<Vec<Checkpoint>, StoreError> {
        self.store.checkpoints(id).await
    }
    async fn wait(
        &self,
        id: &RecordId,
        token: FencingToken,
        until: tokio::time::Instant,
    ) -> Result<WaitOutcome, StoreError> {
        self.store.wait(id, token, until).await
    }
    async fn purge(&self, now: UnixMillis, batch: usize) -> Result<Purged, StoreError> {
        self.store.purge(now, batch).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.store.ping().await
    }
    async fn clock(&self) -> Result<UnixMillis, StoreError> {
        self.store.clock().await
    }
    fn invalidations(&self) -> Option<std::sync::Arc<idem_core::store::Invalidations>> {
        self.store.invalidations()
    }
    fn count_replay(&self, id: &RecordId) {
        self.store.count_replay(id);
    }
    async fn list(&self, query: &ListQuery) -> Result<Vec<Listed>, StoreError> {
        self.store.list(query).await
    }
}

#[tokio::test]
async fn a_hanging_renewal_never_pauses_the_handler() {
    let (store, _dir) = sqlite().await;
    let (held, open_begin, open_renew) = Held::new(store);
    open_begin.send_replace(true);
    let store = Arc::new(held);
    let watched = store.clone();
    // The handler goes on only once a renewal is under way (and hanging): if the renewal were
    // awaited in place of the handler, the handler would never be polled again and never answer.
    let router = Router::new()
        .route(
            "/pay",
            post(move || {
                let watched = watched.clone();
                async move {
                    while watched.renewals_started.load(Ordering::SeqCst) == 0 {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    for _ in 0..5 {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    (StatusCode::CREATED, "paid")
                }
            }),
        )
        .layer(IdempotencyLayer::from_shared(store.clone()).with_lease(Duration::from_millis(300)));
    let answered = tokio::time::timeout(Duration::from_secs(20), send(&router, pay("k", ""))).await;
    open_renew.send_replace(true);
    let (status, _, body) = answered.expect("the handler answered while its renewal hung");
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "paid"));
}

#[tokio::test]
async fn a_store_that_hangs_is_a_503_and_a_claim_it_makes_late_is_released() {
    let (store, dir) = sqlite().await;
    let (held, open_begin, open_renew) = Held::new(store);
    open_renew.send_replace(true);
    let app = app(
        IdempotencyLayer::new(held).with_store_timeout(Duration::from_millis(200)),
        dir,
    );
    let (status, _, body) = tokio::time::timeout(Duration::from_secs(20), send(&app.router, pay("k", "")))
        .await
        .expect("a hanging store is answered, not waited for");
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(
        problem_type(&body).as_deref(),
        Some("urn:idem:problem:store-unavailable")
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 0);

    // The store now makes the claim it was asked for: nobody will run under it, so it is released
    // at once, and the retry runs as new instead of waiting out a lease (409) or running recovered.
    open_begin.send_replace(true);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let retry = send(&app.router, pay("k", "")).await;
    assert_eq!(retry, (StatusCode::CREATED, false, "run 1".into()));
}

/// `POST /pay` behind the layer on `store` (lease 1 s, run timeout 300 ms): the first run hangs
/// ([`first_run`]).
fn first_run_hangs(store: impl Store) -> (Router, Arc<AtomicUsize>) {
    first_run(
        FirstRun::Hangs,
        IdempotencyLayer::new(store)
            .with_lease(Duration::from_secs(1))
            .with_run_timeout(Duration::from_millis(300)),
    )
}

/// A `begin` that took over a run whose outcome is unknown, and whose reply was lost (a reset
/// after it ran, a write no replica acknowledged): the claim is given up as unknown, not
/// forgotten, so the next run is still marked recovered.
#[tokio::test]
async fn a_takeover_whose_reply_was_lost_leaves_the_next_run_marked_recovered() {
    let (store, _dir) = sqlite().await;
    let (held, open_begin, open_renew) = Held::new(store);
    open_begin.send_replace(true);
    open_renew.send_replace(true);
    let reply_lost = held.begin_reply_lost.clone();
    let (router, runs) = first_run_hangs(held);
    let (status, _, _) = send(&router, pay("k", "")).await;
    assert_eq!(
        status,
        StatusCode::GATEWAY_TIMEOUT,
        "the first run hangs and is given up: unknown"
    );

    reply_lost.store(true, Ordering::SeqCst);
    let (status, _, body) = send(&router, pay("k", "")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    reply_lost.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;

    let retry = send(&router, pay("k", "")).await;
    assert_eq!(retry, (StatusCode::CREATED, false, "run 2 recovered=true".into()));
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the lost takeover ran nothing");
}

#[tokio::test]
async fn a_handler_past_the_run_timeout_is_given_up_and_its_retry_runs_recovered() {
    let (store, _dir) = sqlite().await;
    let (router, runs) = first_run_hangs(store);
    let (status, _, body) = tokio::time::timeout(Duration::from_secs(20), send(&router, pay("k", "")))
        .await
        .expect("a hung run is given up");
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{body}");
    assert_eq!(
        problem_type(&body).as_deref(),
        Some("urn:idem:problem:upstream-timeout")
    );
    // Its lease is still being renewed nowhere, and the key is not wedged: the retry runs at once.
    let retry = send(&router, pay("k", "")).await;
    assert_eq!(retry, (StatusCode::CREATED, false, "run 2 recovered=true".into()));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn routes_give_paths_their_own_policy_or_let_them_pass_untouched() {
    let (store, _dir) = counted_sqlite().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        post(move || {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            async move { (StatusCode::CREATED, format!("run {run}")) }
        })
    };
    let defaults = Policy::default();
    let routes = Routes::new()
        .with("/webhooks/*", RouteRule::PassThrough)
        .unwrap()
        .with(
            "/exports/{id}",
            RouteRule::Protect(Policy {
                missing_key: MissingKeyPolicy::Require,
                ..defaults.clone()
            }),
        )
        .unwrap();
    let router = Router::new()
        .route("/pay", handler.clone())
        .route("/webhooks/github", handler.clone())
        .route("/exports/{id}", handler)
        .layer(IdempotencyLayer::from_shared(store.clone()).with_routes(routes));
    let keyed = |path: &str| {
        Request::post(path)
            .header("idempotency-key", "\"route-key\"")
            .body(AxumBody::from("{}"))
            .expect("request")
    };
    let keyless = |path: &str| Request::post(path).body(AxumBody::empty()).expect("request");

    // A pass-through route: the same key twice runs twice, and the store is never asked.
    expect_created(
        &router,
        [
            ("a pass-through route runs", keyed("/webhooks/github"), false, "run 1"),
            ("and runs the same key again", keyed("/webhooks/github"), false, "run 2"),
        ],
    )
    .await;
    assert_eq!(store.total(), 0, "a pass-through route never touches the store");

    // The route's own policy: keys are required there, and only there.
    let (status, _, body) = send(&router, keyless("/exports/7")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(
        problem_type(&body).as_deref(),
        Some("urn:idem:problem:key-missing"),
        "{body}"
    );
    assert_eq!(send(&router, keyless("/pay")).await.0, StatusCode::CREATED);

    // Protected paths still replay, under their route's policy or the default.
    expect_created(
        &router,
        [
            (
                "a key on a route of its own policy runs",
                keyed("/exports/7"),
                false,
                "run 4",
            ),
            ("and replays", keyed("/exports/7"), true, "run 4"),
        ],
    )
    .await;
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

/// `POST /steps`: charges (counted), records it as a step, then fails the first time (a panic, as
/// an instance dying mid-request would leave the record: outcome unknown).
fn stepped_app(layer: IdempotencyLayer, charges: Arc<AtomicUsize>, failures: Arc<AtomicUsize>) -> Router {
    Router::new()
        .route(
            "/steps",
            post(move |axum::Extension(steps): axum::Extension<Checkpoints>| {
                let (charges, failures) = (charges.clone(), failures.clone());
                async move {
                    let charge: String = steps
                        .step("charged", || async {
                            let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
                            Ok::<_, CheckpointError>(format!("ch_{n}"))
                        })
                        .await
                        .expect("the step is recorded");
                    if failures.fetch_add(1, Ordering::SeqCst) == 0 {
                        panic!("the instance dies after the charge");
                    }
                    (StatusCode::CREATED, format!("{charge} recovered={}", steps.recovered()))
                }
            }),
        )
        .layer(layer)
}

#[tokio::test]
async fn a_recovered_run_resumes_after_the_steps_recorded_before_it() {
    let (store, _dir) = counted_sqlite().await;
    let (charges, failures) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let router = stepped_app(IdempotencyLayer::from_shared(store.clone()), charges.clone(), failures);
    let request = || {
        Request::post("/steps")
            .header("idempotency-key", "\"steps-1\"")
            .body(AxumBody::from("{}"))
            .expect("request")
    };
    let (status, _, _) = send(&router, request()).await;
    assert_eq!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "the first run died after its charge"
    );
    assert_eq!(charges.load(Ordering::SeqCst), 1);
    assert_eq!(store.count(Operation::Checkpoint), 1);
    assert_eq!(store.count(Operation::Checkpoints), 0, "a new run reads no checkpoints");

    let (status, replayed, body) = send(&router, request()).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false), "{body}");
    assert_eq!(
        body, "ch_1 recovered=true",
        "the retry resumed after the recorded charge"
    );
    assert_eq!(charges.load(Ordering::SeqCst), 1, "charged once");
    assert_eq!(
        store.count(Operation::Checkpoints),
        1,
        "the recovered run read them once"
    );
    let (_, replayed, body) = send(&router, request()).await;
    assert!(replayed, "{body}");
}

#[tokio::test]
async fn a_run_whose_claim_was_lost_cannot_record_a_step() {
    let (store, _dir) = sqlite().await;
    let store: Arc<dyn Store> = Arc::new(store);
    let (reached, reached_rx) = tokio::sync::oneshot::channel::<Checkpoints>();
    let reached = Arc::new(std::sync::Mutex::new(Some(reached)));
    let (go, go_rx) = tokio::sync::watch::channel(false);
    let outcome = Arc::new(std::sync::Mutex::new(None));
    let router = Router::new()
        .route(
            "/steps",
            post({
                let outcome = outcome.clone();
                move |axum::Extension(steps): axum::Extension<Checkpoints>| {
                    let (reached, outcome, mut go) = (reached.clone(), outcome.clone(), go_rx.clone());
                    async move {
                        steps.save("first", &1).await.expect("the first step is recorded");
                        if let Some(reached) = reached.lock().unwrap().take() {
                            let _ = reached.send(steps.clone());
                        }
                        let _ = go.wait_for(|go| *go).await;
                        let second = steps.save("second", &2).await;
                        *outcome.lock().unwrap() = Some(second.map_err(|err| err.to_string()));
                        StatusCode::CREATED
                    }
                }
            }),
        )
        .layer(IdempotencyLayer::from_shared(store.clone()));
    let request = Request::post("/steps")
        .header("idempotency-key", "\"lost-1\"")
        .body(AxumBody::from("{}"))
        .expect("request");
    let running = tokio::spawn({
        let router = router.clone();
        async move { send(&router, request).await }
    });
    let _steps = reached_rx.await.expect("the handler ran its first step");
    // An operator deletes the record: the run's claim is gone.
    let id = RecordId {
        scope: Scope::anonymous(),
        key: idem_core::IdempotencyKey::new("lost-1").expect("a key"),
    };
    assert!(store.delete(&id).await.expect("delete").is_some());
    go.send(true).expect("the handler waits");
    running.await.expect("the request");
    let second = outcome
        .lock()
        .unwrap()
        .clone()
        .expect("the handler tried its second step");
    let err = second.expect_err("a fenced run cannot record a step");
    assert!(err.contains("lost to another run"), "{err}");
}

/// A layer given durations past the policy's bounds (which `Policy::validate` refuses, but the
/// layer is built without it) still answers, and a copy still waits for the first request: the
/// times it stores stop at the year 9999 and its deadlines thirty years out, never a panic.
#[tokio::test]
async fn durations_past_the_bounds_never_panic_a_request() {
    let (store, dir) = sqlite().await;
    let layer = IdempotencyLayer::new(store)
        .with_ttl(Duration::MAX)
        .with_tombstone_ttl(Duration::MAX)
        .with_lease(Duration::MAX)
        .with_run_timeout(Duration::MAX)
        .with_store_timeout(Duration::MAX)
        .with_wait(Duration::MAX);
    let app = app(layer, dir);
    let first = send(&app.router, pay("far", "?ms=300"));
    let copy = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        send(&app.router, pay("far", "?ms=300")).await
    };
    let ((first, first_replayed, _), (copy, copy_replayed, _)) = tokio::join!(first, copy);
    assert_eq!((first, copy), (StatusCode::CREATED, StatusCode::CREATED));
    assert!(
        !first_replayed && copy_replayed,
        "the copy waited and got the first's answer"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

/// A layer in front of a service reached under `/api` refuses a path that climbs out of it, as
/// the gateway does for an upstream's prefix: `400 path-ambiguous` naming the path and the prefix,
/// whatever the method, keyed or not, on a route passed through too, before anything is claimed
/// or run. A `..` that stays inside is served, and replayed, as any path.
#[tokio::test]
async fn a_layer_under_a_prefix_refuses_a_path_that_climbs_out_of_it() {
    let (store, _dir) = counted_sqlite().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move || {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            async move { (StatusCode::CREATED, format!("run {run}")) }
        }
    };
    let routes = Routes::new().with("/webhooks/*", RouteRule::PassThrough).unwrap();
    let router = Router::new().fallback(handler).layer(
        IdempotencyLayer::from_shared(store.clone())
            .with_routes(routes)
            .with_path_prefix("/api/"),
    );
    let request = |method: &str, path: &str, key: Option<&str>| {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(key) = key {
            request = request.header("idempotency-key", format!("\"{key}\""));
        }
        request.body(AxumBody::from("{}")).expect("request")
    };

    let climbs = [
        "/../admin",
        "/%2e%2e/admin",
        "/a/..%2F..%2Fadmin",
        "/webhooks/../../admin",
    ];
    for path in climbs {
        for (method, key) in [("POST", Some("climb")), ("POST", None), ("GET", None)] {
            let (status, _, body) = send(&router, request(method, path, key)).await;
            let case = format!("{method} {path} (key {key:?})");
            assert_eq!(status, StatusCode::BAD_REQUEST, "{case}: {body}");
            assert_eq!(
                problem_type(&body).as_deref(),
                Some("urn:idem:problem:path-ambiguous"),
                "{case}: {body}"
            );
            assert!(
                body.contains(path) && body.contains("prefix /api,"),
                "{case}: the detail names the path and the prefix: {body}"
            );
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "no climbing path reached the service");
    assert_eq!(store.total(), 0, "nothing was claimed for a climbing path");

    let inside = || request("POST", "/a/../pay", Some("inside"));
    expect_created(
        &router,
        [
            ("a `..` that stays inside is served", inside(), false, "run 1"),
            ("and replayed", inside(), true, "run 1"),
        ],
    )
    .await;
}
