//! Every wait of the store is bounded where it happens. A record's row locked by a transaction
//! still open (a handler completing the record in its own transaction, held here by a plain
//! connection of the test) is never queued on by the store's own statements; a statement that
//! does wait is bounded on the server by the store timeout; and an operation its caller gave up
//! never leaves its connection busy in the pool.

use std::time::Duration;

use idem_core::store::{Begin, FencingToken, RecordId, RecordState, WaitOutcome};
use idem_core::testkit::{DAY, LEASE, acquire, begin, completion, fingerprint, fresh_id, unknown_at};
use idem_core::{Fingerprint, Store, StoreError, UnixMillis};
use idem_postgres::PostgresStore;
use idem_test_support::postgres_store::{TestSchema, raw_client};
use idem_test_support::{chain, servers};
use tokio::time::timeout;

/// The statements of the store's connections (named `application_name`) that wait on a lock.
async fn waiting_on_locks(schema: &TestSchema, application_name: &str) -> Vec<String> {
    raw_client(&schema.url(""))
        .await
        .query(
            "SELECT query FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
            &[&application_name],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// A store on a schema of its own (connected with `options`), a record it claimed, and a
/// transaction of the test's own that holds the record's row ([`TestSchema::hold_row`]).
struct LockedClaim {
    schema: TestSchema,
    store: PostgresStore,
    id: RecordId,
    fp: Fingerprint,
    now: UnixMillis,
    token: FencingToken,
    holder: tokio_postgres::Client,
}

impl LockedClaim {
    /// `bound`: [`Store::bound_operations`] before anything is claimed.
    async fn new(options: &str, bound: Option<Duration>) -> Self {
        let schema = TestSchema::new();
        let store = schema.connect(options).await;
        if let Some(limit) = bound {
            store.bound_operations(limit);
        }
        let (id, fp, now) = (fresh_id(), fingerprint("{}"), UnixMillis::now());
        let token = acquire(&store, &id, &fp, now).await;
        let holder = schema.hold_row(&id, "FOR NO KEY UPDATE").await;
        Self {
            schema,
            store,
            id,
            fp,
            now,
            token,
            holder,
        }
    }

    /// Ends the transaction that held the row; the run then completes as usual.
    async fn let_go_and_complete(self) {
        self.holder.batch_execute("ROLLBACK").await.unwrap();
        let done = completion(b"ok", self.now, DAY, 7 * DAY);
        self.store.complete(&self.id, self.token, done).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_a_claim_waits_on_its_runs_open_transaction() {
    let claim = LockedClaim::new("", None).await;
    let (store, id, fp, now, token) = (&claim.store, &claim.id, &claim.fp, claim.now, claim.token);
    let limit = Duration::from_secs(3);

    // Past the lease, a copy does not take a run over whose transaction holds the row: it reads
    // the run as going on, and waits.
    let later = now.plus(LEASE + Duration::from_secs(1));
    let (copy, _) = timeout(limit, begin(store, id, fp, later))
        .await
        .expect("the copy's claim waited on the lock");
    let Begin::Existing(record) = copy else {
        panic!("a run alive was taken over: {copy:?}")
    };
    let RecordState::InFlight { lease_until, .. } = record.state else {
        panic!("{record:?}")
    };
    assert!(lease_until > later, "read as going on: {lease_until} at {later}");
    // The run's own renewal, its release and an operator's delete change nothing and wait for
    // nothing: they report the lock.
    let renewed = timeout(limit, store.renew(id, token, later.plus(LEASE)))
        .await
        .expect("renew waited");
    assert!(matches!(renewed, Err(StoreError::Locked)), "{renewed:?}");
    let released = timeout(limit, store.release(id, token, unknown_at(later)))
        .await
        .expect("release waited");
    assert!(matches!(released, Err(StoreError::Locked)), "{released:?}");
    let deleted = timeout(limit, store.delete(id)).await.expect("delete waited");
    assert!(matches!(deleted, Err(StoreError::Locked)), "{deleted:?}");
    // A waiter polls; it does not queue on the lock.
    let deadline = tokio::time::Instant::now() + Duration::from_millis(600);
    let waited = timeout(limit, store.wait(id, token, deadline))
        .await
        .expect("wait queued on the lock");
    assert!(matches!(waited, Ok(WaitOutcome::TimedOut)), "{waited:?}");
    let record = store.get(id).await.unwrap().expect("nothing was deleted");
    assert!(
        matches!(record.state, RecordState::InFlight { .. }),
        "nothing changed: {record:?}"
    );

    // Once the transaction ends, the run is the store's as before.
    claim.holder.batch_execute("ROLLBACK").await.unwrap();
    store.renew(id, token, later.plus(LEASE)).await.unwrap();
    store
        .complete(id, token, completion(b"ok", later, DAY, 7 * DAY))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_given_up_leaves_no_busy_connection_in_the_pool() {
    let application_name = format!("abandoned_{}", servers::unique_name("pool"));
    let claim = LockedClaim::new(&format!("pool_size=1&application_name={application_name}"), None).await;
    let (store, id, token, now) = (&claim.store, &claim.id, claim.token, claim.now);
    // Completing waits for the lock (bounded by nothing yet): its caller gives up.
    let given_up = timeout(
        Duration::from_millis(300),
        store.complete(id, token, completion(b"ok", now, DAY, 7 * DAY)),
    )
    .await;
    assert!(given_up.is_err(), "it waited for the lock: {given_up:?}");
    // The pool's one connection is not handed to the next operation still busy.
    let pinged = timeout(Duration::from_secs(3), store.ping()).await;
    assert!(
        matches!(pinged, Ok(Ok(()))),
        "the next operation queued behind abandoned work: {pinged:?}"
    );
    // And the abandoned statement was cancelled on the server.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let waiting = waiting_on_locks(&claim.schema, &application_name).await;
        if waiting.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still waiting on the server: {waiting:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    claim.let_go_and_complete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_that_waits_is_bounded_on_the_server_by_the_store_timeout() {
    let claim = LockedClaim::new("", Some(Duration::from_millis(500))).await;
    let (store, id, token, now) = (&claim.store, &claim.id, claim.token, claim.now);
    // Nobody gives up on the client: the server does.
    let completed = timeout(
        Duration::from_secs(10),
        store.complete(id, token, completion(b"ok", now, DAY, 7 * DAY)),
    )
    .await
    .expect("the statement waited past the store timeout");
    match completed {
        // Both are the bound: whichever the server counts out first.
        Err(StoreError::Unavailable(err)) => {
            let why = chain(&*err);
            assert!(
                why.contains("lock timeout") || why.contains("statement timeout"),
                "{why}"
            );
        }
        other => panic!("{other:?}"),
    }
    claim.let_go_and_complete().await;
}

/// A copy's mark (`waiters + 1`) locks the row for an instant, one statement and its commit; a
/// crowd of copies does so all the time. The run's renewal that meets such a lock tries again
/// rather than miss a third of its lease: three misses in a row lose a live run to a copy.
/// Five rounds, the lock let go 10 ms after the renewal starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_passes_a_lock_held_for_an_instant() {
    let schema = TestSchema::new();
    let store = schema.connect("").await;
    let (id, fp, now) = (fresh_id(), fingerprint("{}"), UnixMillis::now());
    let token = acquire(&store, &id, &fp, now).await;
    let mut missed = 0;
    for round in 1..=5 {
        let holder = schema.hold_row(&id, "FOR NO KEY UPDATE").await;
        let letting_go = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            holder.batch_execute("ROLLBACK").await.unwrap();
        });
        match store
            .renew(&id, token, now.plus(LEASE + Duration::from_secs(round)))
            .await
        {
            Ok(()) => {}
            Err(StoreError::Locked) => missed += 1,
            Err(err) => panic!("{err:?}"),
        }
        letting_go.await.unwrap();
    }
    assert_eq!(missed, 0, "renewals missed for a lock held an instant");
}
