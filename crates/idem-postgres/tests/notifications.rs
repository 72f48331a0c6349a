//! Waiters are woken through PostgreSQL `LISTEN`/`NOTIFY`, across stores (two pools, so that the
//! wake-up has to travel through the server), and again after the server dropped every
//! connection. The stores poll only every 15 s here (`poll_interval=60s` backs off from a quarter
//! of it), so a waiter that wakes within 2 s was woken by a notification; a control case shows
//! that a store with `notify=off` does not.

use std::time::Duration;

use idem_core::testkit::{DAY, LEASE, acquire, begin, completion, fingerprint, fresh_id};
use idem_core::{
    Store, UnixMillis,
    store::{Begin, FencingToken, RecordId, Release, WaitOutcome},
};
use idem_postgres::PostgresStore;
use idem_test_support::postgres_store::{TestSchema, base_url};
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};

const SLOW_POLL: &str = "poll_interval=60s";
/// Well below the first poll of a store with [`SLOW_POLL`] (15 s).
const NOTIFIED_WITHIN: Duration = Duration::from_secs(2);

/// Starts waiting on `token` in a task, and checks that the waiter is still waiting after 100 ms.
async fn start_waiting(waiter: &PostgresStore, id: &RecordId, token: FencingToken) -> JoinHandle<WaitOutcome> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let (waiter, id) = (waiter.clone(), id.clone());
    let task = tokio::spawn(async move { waiter.wait(&id, token, deadline).await.expect("wait") });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!task.is_finished(), "the waiter waits while the claim is held");
    task
}

/// A fresh record claimed by `holder` now, and `waiter` waiting on it ([`start_waiting`]).
async fn claimed_and_waited_on(
    holder: &PostgresStore,
    waiter: &PostgresStore,
) -> (RecordId, FencingToken, JoinHandle<WaitOutcome>) {
    let id = fresh_id();
    let token = acquire(holder, &id, &fingerprint("a"), UnixMillis::now()).await;
    let task = start_waiting(waiter, &id, token).await;
    (id, token, task)
}

/// Completes `id` as the holder of `token`.
async fn complete(holder: &PostgresStore, id: &RecordId, token: FencingToken) {
    let now = UnixMillis::now();
    holder
        .complete(id, token, completion(b"done", now, DAY, 7 * DAY))
        .await
        .expect("complete");
}

/// Asserts that the waiter returns `Changed` well before its store would poll.
async fn assert_notified(task: JoinHandle<WaitOutcome>, what: &str) {
    let started = Instant::now();
    let outcome = timeout(Duration::from_secs(10), task)
        .await
        .unwrap_or_else(|_| panic!("{what}: the waiter was not woken within 10 s"))
        .expect("task");
    assert_eq!(outcome, WaitOutcome::Changed, "{what}");
    assert!(
        started.elapsed() < NOTIFIED_WITHIN,
        "{what}: woken only after {:?}, which polling could explain",
        started.elapsed()
    );
}

/// A fresh record claimed by `holder` and waited on by `waiter`, then completed: asserts that the
/// waiter is woken by the notification (`what`, in the failure message).
async fn assert_completion_notified(holder: &PostgresStore, waiter: &PostgresStore, what: &str) {
    let (id, token, task) = claimed_and_waited_on(holder, waiter).await;
    complete(holder, &id, token).await;
    assert_notified(task, what).await;
}

/// An `application_name` of its own, to find a store's connections by.
fn fresh_application_name() -> String {
    format!("idem_test_{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_wakes_a_waiter_on_another_store() {
    let schema = TestSchema::new();
    let (holder, waiter) = (schema.connect(SLOW_POLL).await, schema.connect(SLOW_POLL).await);
    assert_completion_notified(&holder, &waiter, "complete").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_store_does_not_wake_at_once() {
    let schema = TestSchema::new();
    let holder = schema.connect(SLOW_POLL).await;
    let waiter = schema.connect(&format!("notify=off&{SLOW_POLL}")).await;
    let (id, token, task) = claimed_and_waited_on(&holder, &waiter).await;
    complete(&holder, &id, token).await;
    tokio::time::sleep(NOTIFIED_WITHIN).await;
    assert!(
        !task.is_finished(),
        "a store with notify=off noticed the change within {NOTIFIED_WITHIN:?}, so the notification tests prove nothing"
    );
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_and_takeover_wake_waiters() {
    let schema = TestSchema::new();
    let (holder, waiter) = (schema.connect(SLOW_POLL).await, schema.connect(SLOW_POLL).await);
    let fp = fingerprint("a");

    let (id, token, task) = claimed_and_waited_on(&holder, &waiter).await;
    holder.release(&id, token, Release::Forget).await.expect("release");
    assert_notified(task, "release (forget)").await;

    let (id, token, task) = claimed_and_waited_on(&holder, &waiter).await;
    let now = UnixMillis::now();
    let unknown = Release::Unknown {
        expires_at: now.plus(DAY),
        purge_at: now.plus(DAY),
    };
    holder.release(&id, token, unknown).await.expect("release");
    assert_notified(task, "release (unknown)").await;

    // A claim whose lease ended long ago, taken over by a retry on the other store.
    let (id, then) = (fresh_id(), UnixMillis::now().minus(LEASE * 2));
    let token = acquire(&holder, &id, &fp, then).await;
    let task = start_waiting(&waiter, &id, token).await;
    let (taken, _) = begin(&waiter, &id, &fp, UnixMillis::now()).await;
    assert!(matches!(taken, Begin::Acquired { recovered: true }), "{taken:?}");
    assert_notified(task, "takeover").await;
}

/// Kills every connection of both stores (as a server restart would), then checks that they
/// work again without being reopened, and that the listening connection came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_recover_when_the_server_drops_their_connections() {
    let schema = TestSchema::new();
    let app = fresh_application_name();
    let options = format!("{SLOW_POLL}&application_name={app}");
    let (holder, waiter) = (schema.connect(&options).await, schema.connect(&options).await);
    holder.ping().await.expect("ping");
    waiter.ping().await.expect("ping");

    let admin = schema.client().await;
    let listening = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'";
    let count = |sql: &'static str| {
        let (admin, app) = (&admin, app.clone());
        async move { admin.query_one(sql, &[&app]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(count(listening).await, 2, "each store has one listening connection");
    let killed =
        count("SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity WHERE application_name = $1").await;
    assert!(killed >= 4, "killed {killed} connections");

    // The pool notices closed connections when it hands them out; give the drivers a moment to
    // read the server's goodbye.
    tokio::time::sleep(Duration::from_millis(500)).await;
    holder.ping().await.expect("the holder's pool reconnects");
    waiter.ping().await.expect("the waiter's pool reconnects");
    let started = Instant::now();
    while count(listening).await < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the listening connections did not come back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    assert_completion_notified(&holder, &waiter, "complete after reconnecting").await;
}

/// A waiter that is already waiting when the listening connection drops is woken once it is
/// back, even though the change it waits for was notified while nobody listened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_made_while_not_listening_are_not_lost() {
    let schema = TestSchema::new();
    let app = fresh_application_name();
    let holder = schema.connect(SLOW_POLL).await;
    let waiter = schema.connect(&format!("{SLOW_POLL}&application_name={app}")).await;
    let (id, token, task) = claimed_and_waited_on(&holder, &waiter).await;

    // Only the listening connection: the waiter's pool connections stay, so its checks work.
    terminate_listener(&schema.client().await, &app).await;
    complete(&holder, &id, token).await;
    assert_notified(task, "complete while the listener was down").await;
}

/// Terminates the `LISTEN` connection of the store whose `application_name` is `app` (its pool's
/// connections stay).
async fn terminate_listener(admin: &tokio_postgres::Client, app: &str) {
    let killed: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity
             WHERE application_name = $1 AND query LIKE 'LISTEN%'",
            &[&app],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(killed, 1, "the listening connection");
}

/// The payload the store notifies for a record: 32 hex digits of a SHA-256 of its scope and key.
fn payload(id: &RecordId) -> String {
    use sha2::{Digest, Sha256};
    let (scope, key) = (id.scope.as_str(), id.key.as_str());
    let mut hasher = Sha256::new();
    hasher.update((scope.len() as u64).to_be_bytes());
    hasher.update(scope.as_bytes());
    hasher.update(key.as_bytes());
    hasher.finalize()[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// A change that ends a claim notifies only if someone waits on the record: every `NOTIFY` takes
/// a lock that serialises the commits of all notifying transactions in the database, so claims
/// nobody waits for must not queue on it. (A delete, an operator's rare act, always announces
/// itself to the replay caches, with a payload of its own: `deleted:` and the digest.) Counted on a connection of its own that listens: the
/// waited-on change is committed last, and notifications arrive in commit order, so every one
/// before it has arrived by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_changes_someone_waits_on_notify() {
    let (listening, mut connection) = tokio_postgres::connect(&base_url(), tokio_postgres::NoTls)
        .await
        .expect("connect (start PostgreSQL: bash .ci/services)");
    let (heard, mut notifications) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(message) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            if let Ok(tokio_postgres::AsyncMessage::Notification(notification)) = message {
                let _ = heard.send(notification.payload().to_owned());
            }
        }
    });
    listening.batch_execute("LISTEN idem_records").await.unwrap();

    let schema = TestSchema::new();
    let (holder, waiter) = (schema.connect(SLOW_POLL).await, schema.connect(SLOW_POLL).await);
    let (fp, now) = (fingerprint("a"), UnixMillis::now());
    let mut unwatched = std::collections::HashSet::new();
    for end in ["complete", "forget", "unknown", "delete"] {
        let id = fresh_id();
        let token = acquire(&holder, &id, &fp, now).await;
        match end {
            "complete" => {
                holder
                    .complete(&id, token, completion(b"done", now, DAY, 7 * DAY))
                    .await
            }
            "forget" => holder.release(&id, token, Release::Forget).await,
            "unknown" => {
                let release = Release::Unknown {
                    expires_at: now.plus(DAY),
                    purge_at: now.plus(DAY),
                };
                holder.release(&id, token, release).await
            }
            _ => holder.delete(&id).await.map(drop),
        }
        .expect(end);
        unwatched.insert(payload(&id));
    }

    let (watched, token, task) = claimed_and_waited_on(&holder, &waiter).await;
    complete(&holder, &watched, token).await;
    assert_notified(task, "complete").await;
    loop {
        let payload = timeout(Duration::from_secs(10), notifications.recv())
            .await
            .expect("the waited-on completion was notified")
            .expect("the listening connection");
        assert!(!unwatched.contains(&payload), "a change nobody waited on notified");
        if payload == self::payload(&watched) {
            break;
        }
    }
}

/// The `LISTEN` connection terminated by the server and a delete made before it is back: the
/// replay cache does not keep the deleted answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_while_not_listening_is_not_missed_by_the_replay_cache() {
    let schema = TestSchema::new();
    let app = fresh_application_name();
    let here = schema.connect(&format!("application_name={app}")).await;
    let there = schema.connect("").await;
    let admin = schema.client().await;
    let cut = async move { terminate_listener(&admin, &app).await };
    idem_core::testkit::a_delete_while_the_channel_is_down_is_not_missed(
        std::sync::Arc::new(here),
        std::sync::Arc::new(there),
        cut,
    )
    .await;
}
