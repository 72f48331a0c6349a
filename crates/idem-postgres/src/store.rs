//! [`PostgresStore`]: the `Store` primitives as PostgreSQL statements. A claim is one statement
//! that reads the record and, only if there is none, inserts it (`INSERT ... ON CONFLICT DO
//! NOTHING`, in the function `idem_claim_insert`, so that a replay is a plain read); taking over
//! or replacing a record that exists is decided again in a transaction that locks the row
//! (`SELECT ... FOR UPDATE NOWAIT`: a row another transaction holds is a run alive, never waited
//! for; nothing of the store queues on a row lock, see docs/design.md, "Where each store waits").
//! Every pooled connection bounds its statements on the server by the store timeout, and goes
//! back to the pool only when its operation ends (`lent.rs`). In a burst of replays, `begin`
//! reads first on connections many reads share (`read_first.rs`). Complete, release and renew are single compare-and-set
//! statements on the fencing token. Changes that end a claim `NOTIFY` in the same statement when
//! someone waits on the record (a waiter marks it first), so that waiters everywhere are woken on
//! commit, and commits nobody waits for do not queue on the lock every `NOTIFY` takes. A replay is
//! one read: its count is written later, in batches (`replays`). A record keeps its request's
//! origin, its latest run's trace id and recovery and its answer's status, written by the
//! statements that claim, take over and complete it; `list` reads them, newest first, in one
//! statement through the `created_at` index.
//!
//! The scope salt is the one row of `idem_scope_salt`, made by the first caller with
//! `INSERT ... ON CONFLICT DO NOTHING` and read by everyone else in a statement of its own.
//!
//! Checkpoints live in the record's row, in two arrays that line up (`checkpoint_names`,
//! `checkpoint_values`): writing one is a compare-and-set like the others, a takeover or a release
//! as unknown leaves them, and the statements that end the run or start a new one empty them
//! (deleting the row takes them with it).
//!
//! The statements are in `sql.rs` and rows are read in `decode.rs`: this module is the operations.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use async_trait::async_trait;
use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use idem_core::store::Invalidations;
use idem_core::store::backend::{
    Existing, ReplayCounts, claim_purge_at, claim_state, ran_in_transaction, wait_for_change,
};
use idem_core::{
    Store, StoreError, UnixMillis,
    store::{
        Begin, BeginRequest, Checkpoint, ClaimState, Completion, FencingToken, ListQuery, Listed, ListedState, Purged,
        Record, RecordId, Release, ScopeSalt, StoreIdentity, WaitOutcome,
    },
};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{NoTls, Row};

use crate::decode::{StoredRow, checkpoints_from_row, identity_from_row, listed_from_row, scope_salt_from_row};
use crate::error::{Failure, lock_not_available};
use crate::lent::{Bounds, Lent};
use crate::listener::{Listener, deleted_payload, payload};
use crate::read_first::Reads;
use crate::url::Settings;
use crate::{Access, PostgresError, Replication, privileges, replays, replication, schema, sql};

/// How many times `begin` tries again when the record it conflicted with is gone before it could
/// be read (deleted by a release or a purge in between). Each try is a new statement with a new
/// snapshot; running out means the key is being claimed and released in a tight loop.
const BEGIN_ATTEMPTS: usize = 32;

/// How long an operation waits for a free pooled connection.
const POOL_WAIT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long checking a returned connection may take.
const POOL_RECYCLE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a claim that found a run's lease ended, but its row locked by a transaction still
/// open (the run completing in its own transaction: alive), treats that lease as going on. The
/// copy waits (polling whether the claim changed), then tries the takeover again.
const LOCKED_RUN_LEASE: Duration = Duration::from_secs(1);

/// How long a replacement of a record past its retention, a renewal, a release or a delete waits
/// before it tries again when the row is locked (by a purge, a copy's mark or another claim, for
/// an instant).
const LOCKED_RETRY_PAUSE: Duration = Duration::from_millis(10);

/// An idempotency store in a PostgreSQL database, shared by every instance of a service.
///
/// Claims are atomic across instances; waiters are woken through `LISTEN`/`NOTIFY` (or by polling
/// with `notify=off`); purging runs one instance at a time. Cloning is cheap and shares the pool
/// and the listening connection, which are closed when the last clone is dropped.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    /// The server, for messages: `user@host:port/database`.
    target: Arc<str>,
    schema: Option<String>,
    pool_size: usize,
    poll_interval: Duration,
    /// `None` with `notify=off`.
    listener: Option<Listener>,
    /// Replays counted and not yet written to their rows.
    replays: Arc<ReplayCounts>,
    /// What a failover can lose, as read when the store connected.
    replication: Replication,
    /// Replays read on connections of their own, while replays are most of the traffic.
    reads: Reads,
    /// The server-side bound of the pool's statements (`Store::bound_operations`).
    bounds: Arc<Bounds>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("PostgresStore")
            .field("target", &inner.target)
            .field("schema", &inner.schema)
            .field("pool_size", &inner.pool_size)
            .field("notify", &inner.listener.is_some())
            .field(
                "listening",
                &inner.listener.as_ref().is_some_and(|l| l.registry().is_listening()),
            )
            .field("poll_interval", &inner.poll_interval)
            .field("replication", &inner.replication)
            .finish()
    }
}

impl PostgresStore {
    /// Connects to the database named by a URL, creates or updates its schema, reads what a
    /// failover can lose ([`PostgresStore::replication`], logged as a warning when it can lose
    /// claims or answers), and (unless `notify=off`) opens the connection that listens for changes.
    ///
    /// The URL is `postgres://user[:password]@host[:port]/database[?options]` (`postgresql://`
    /// too). Besides the options of tokio-postgres (`connect_timeout`, `application_name`,
    /// `options`, ...) it takes:
    ///
    /// * `pool_size=N`: connections in the pool (default 16);
    /// * `notify=off`: wake waiters by polling only, for poolers without `LISTEN` such as
    ///   PgBouncer in transaction mode (default `on`);
    /// * `poll_interval=DUR`: the longest pause between two checks of a waiter, a humantime
    ///   duration (default `200ms`); a waiter first checks after a quarter of it, then backs off;
    /// * `schema=NAME`: keep the tables in this PostgreSQL schema (lower-case letters, digits and
    ///   `_`), created if missing; by default they go where the `search_path` says.
    ///
    /// TLS is not supported: use a URL without `sslmode=require`.
    pub async fn connect(url: &str) -> Result<Self, PostgresError> {
        let settings = Settings::parse(url)?;
        let target: Arc<str> = settings.target.clone().into();
        let manager = Manager::from_config(
            settings.config.clone(),
            NoTls,
            ManagerConfig {
                // Checks only that a connection is still open; no query per checkout. Nothing here
                // changes session state that a reset would have to undo.
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let connect_timeout = settings
            .config
            .get_connect_timeout()
            .copied()
            .unwrap_or(Duration::from_secs(10));
        let bounds = Arc::new(Bounds::default());
        let (on_create, on_recycle) = (Arc::clone(&bounds), Arc::clone(&bounds));
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(POOL_WAIT_TIMEOUT))
            // A few hosts may each be tried for `connect_timeout`.
            .create_timeout(Some(connect_timeout * 2))
            .recycle_timeout(Some(POOL_RECYCLE_TIMEOUT))
            .post_create(Hook::async_fn(move |client, _| {
                let settings = on_create.session_settings();
                Box::pin(async move {
                    if let Some(settings) = settings {
                        client.batch_execute(&settings).await.map_err(HookError::Backend)?;
                    }
                    Ok(())
                })
            }))
            .pre_recycle(Hook::sync_fn(move |_, metrics| on_recycle.check(metrics.created)))
            .build()
            .map_err(|err| PostgresError::Connect {
                target: settings.target.clone(),
                source: Box::new(err),
            })?;
        schema::prepare(&pool, &settings.target, settings.schema.as_deref()).await?;
        let replication = replication::read(&pool).await;
        replication.log(&settings.target);
        let listener = if settings.notify {
            let listener = Listener::start(settings.config.clone(), settings.target.clone())
                .await
                .map_err(|err| PostgresError::Listen {
                    target: settings.target.clone(),
                    source: Box::new(err),
                })?;
            Some(listener)
        } else {
            None
        };
        tracing::debug!(
            server = %settings.target,
            schema = settings.schema.as_deref().unwrap_or(""),
            notify = settings.notify,
            "PostgreSQL store connected"
        );
        let inner = Arc::new(Inner {
            pool,
            target,
            schema: settings.schema,
            pool_size: settings.pool_size,
            poll_interval: settings.poll_interval,
            listener,
            replays: Arc::default(),
            replication,
            reads: Reads::start(settings.read_first, settings.read_connections, &settings.config).await,
            bounds,
        });
        let pool = inner.pool.clone();
        ReplayCounts::flush_forever(
            inner.replays.clone(),
            replays::FLUSH_EVERY,
            Arc::downgrade(&inner),
            move |counts| {
                let pool = pool.clone();
                async move { replays::write(&pool, counts).await }
            },
        );
        Ok(Self { inner })
    }

    /// Creates the schema or applies the migrations it lacks; does nothing if it is up to date
    /// (then it only reads the schema's version: no DDL, no lock). Safe to run from many instances
    /// at once. [`PostgresStore::connect`] calls it.
    pub async fn migrate(&self) -> Result<(), PostgresError> {
        schema::prepare(&self.inner.pool, &self.inner.target, self.inner.schema.as_deref()).await
    }

    /// Checks that the connected role has every right `access` needs on the store's schema
    /// (`docs/stores.md`, "PostgreSQL roles"); [`PostgresError::MissingPrivileges`] names each
    /// right it lacks and its object.
    pub async fn check_access(&self, access: Access) -> Result<(), PostgresError> {
        let client = self.inner.pool.get().await.map_err(|err| PostgresError::Connect {
            target: self.inner.target.to_string(),
            source: Box::new(err),
        })?;
        privileges::check(&**client, &self.inner.target, self.inner.schema.as_deref(), access).await
    }

    /// The server, as `user@host:port/database` (never with a password), for messages.
    pub fn target(&self) -> &str {
        &self.inner.target
    }

    /// What a failover of the server can lose, as read when the store connected (with this
    /// store's own session settings: a `synchronous_commit` in the URL's `options` counts).
    /// [`PostgresStore::connect`] has logged it already.
    pub fn replication(&self) -> &Replication {
        &self.inner.replication
    }

    /// The PostgreSQL schema of the store's tables and functions (`idem_complete`), if the URL
    /// named one (`schema=`); else they are on the connection's `search_path`.
    pub fn schema(&self) -> Option<&str> {
        self.inner.schema.as_deref()
    }

    async fn client(&self, operation: &'static str) -> Result<Object, StoreError> {
        self.inner
            .pool
            .get()
            .await
            .map_err(|err| Failure::pool(operation, &self.inner.target, err, self.inner.pool_size))
    }

    /// Runs `work` on a pooled connection, which goes back to the pool when `work` ends, and is
    /// cancelled and closed if `work` is dropped before (see `lent.rs`).
    async fn with_client<T>(
        &self,
        operation: &'static str,
        work: impl AsyncFnOnce(&mut Object) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut lent = Lent::new(self.client(operation).await?);
        let result = work(&mut lent).await;
        lent.give_back();
        result
    }

    fn db(&self, operation: &'static str) -> impl Fn(tokio_postgres::Error) -> StoreError + Copy + '_ {
        move |err| Failure::db(operation, &self.inner.target, err)
    }

    /// As [`PostgresStore::db`], for a statement that does not wait for the record's row lock:
    /// finding it held is [`StoreError::Locked`].
    fn db_nowait(&self, operation: &'static str) -> impl Fn(tokio_postgres::Error) -> StoreError + Copy + '_ {
        move |err| {
            if lock_not_available(&err) {
                StoreError::Locked
            } else {
                Failure::db(operation, &self.inner.target, err)
            }
        }
    }

    /// The row `sql` (prepared, and cached on the connection) returns with `params`, if any, read
    /// on a pooled connection for `operation`.
    async fn query_opt(
        &self,
        operation: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, StoreError> {
        let db = self.db(operation);
        self.with_client(operation, async |client| {
            let stmt = client.prepare_cached(sql).await.map_err(db)?;
            client.query_opt(&stmt, params).await.map_err(db)
        })
        .await
    }

    /// Runs `sql`, a compare-and-set on the claim `token` of `id` (its scope, key and token are
    /// `$1` to `$3`, `after_claim` the parameters from `$4` on), on a pooled connection for
    /// `operation`, its failure mapped by `failed` ([`PostgresStore::db`], or
    /// [`PostgresStore::db_nowait`] for a statement that does not wait for the row lock): fenced if
    /// it changed nothing.
    async fn change_claim(
        &self,
        operation: &'static str,
        sql: &str,
        id: &RecordId,
        token: FencingToken,
        after_claim: &[&(dyn ToSql + Sync)],
        failed: impl Fn(tokio_postgres::Error) -> StoreError,
    ) -> Result<(), StoreError> {
        let db = self.db(operation);
        let (scope, key, token) = (id.scope.as_str(), id.key.as_str(), &token.as_bytes()[..]);
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&scope, &key, &token];
        params.extend_from_slice(after_claim);
        self.with_client(operation, async |client| {
            let stmt = client.prepare_cached(sql).await.map_err(db)?;
            let changed = client.execute(&stmt, &params).await.map_err(failed)?;
            fenced(usize::try_from(changed).unwrap_or(usize::MAX))
        })
        .await
    }

    /// Where the claim `token` on the record stands, read for `operation` (`claim_state`, or a
    /// waiter's check that the claim is still current).
    async fn read_claim_state(
        &self,
        operation: &'static str,
        id: &RecordId,
        token: FencingToken,
    ) -> Result<ClaimState, StoreError> {
        let db = self.db(operation);
        let row = self
            .query_opt(
                operation,
                sql::CLAIM_STATE,
                &[&id.scope.as_str(), &id.key.as_str(), &&token.as_bytes()[..]],
            )
            .await?;
        match row {
            None => Ok(ClaimState::Ended),
            Some(row) => Ok(claim_state(
                &row.try_get::<_, String>(0).map_err(db)?,
                row.try_get(1).map_err(db)?,
            )),
        }
    }

    /// A `begin` answered with the record as read: counted as a replay (`Replay`), or as it
    /// stands with the replays not yet written (`Leave`: in flight, another request's, expired).
    fn existing(&self, record: Record, action: Existing) -> Begin {
        Begin::Existing(if action == Existing::Replay {
            self.inner.replays.replayed(record)
        } else {
            self.inner.replays.with_pending(record)
        })
    }

    /// One try of `renew`: the row locked first without waiting ([`StoreError::Locked`]).
    /// One try of `release`: the row locked first without waiting ([`StoreError::Locked`]).
    async fn release_once(&self, id: &RecordId, token: FencingToken, release: Release) -> Result<(), StoreError> {
        let (notice, failed) = (payload(id), self.db_nowait("release"));
        match release {
            Release::Forget => {
                self.change_claim("release", sql::FORGET, id, token, &[&notice], failed)
                    .await
            }
            Release::Unknown { expires_at, purge_at } => {
                let after_claim: [&(dyn ToSql + Sync); 3] = [&purge_at.as_i64(), &notice, &expires_at.as_i64()];
                self.change_claim("release", sql::RELEASE_UNKNOWN, id, token, &after_claim, failed)
                    .await
            }
        }
    }

    /// One try of `delete`: the row locked as it is read, without waiting ([`StoreError::Locked`]).
    async fn delete_once(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let db = self.db("delete");
        self.with_client("delete", async |client| {
            let stmt = client.prepare_cached(sql::DELETE).await.map_err(db)?;
            let params: [&(dyn ToSql + Sync); 4] =
                [&id.scope.as_str(), &id.key.as_str(), &payload(id), &deleted_payload(id)];
            let row = client
                .query_opt(&stmt, &params)
                .await
                .map_err(self.db_nowait("delete"))?;
            let record = row
                .map(|row| StoredRow::from_row(&row, id)?.into_record(id.clone()))
                .transpose();
            self.inner.replays.deleted(id, record)
        })
        .await
    }

    async fn renew_once(&self, id: &RecordId, token: FencingToken, lease_until: UnixMillis) -> Result<(), StoreError> {
        let after_claim: [&(dyn ToSql + Sync); 2] = [&lease_until.as_i64(), &abandoned_purge_at(lease_until)];
        self.change_claim("renew", sql::RENEW, id, token, &after_claim, self.db_nowait("renew"))
            .await
    }

    /// `begin` on the pool: a new key's claim, or the record as it stands, in one statement
    /// (`CLAIM`); a takeover or a replacement decided again under the row's lock.
    async fn claim(&self, request: BeginRequest<'_>) -> Result<Begin, StoreError> {
        self.with_client("begin", async |client| self.claim_on(client, request).await)
            .await
    }

    async fn claim_on(&self, client: &mut Object, request: BeginRequest<'_>) -> Result<Begin, StoreError> {
        let db = self.db("begin");
        let id = request.id;
        let (scope, key) = (id.scope.as_str(), id.key.as_str());
        let fingerprint = request.fingerprint.encode();
        let digest = &request.fingerprint.digest()[..];
        let token = &request.token.as_bytes()[..];
        let now = request.now.as_i64();
        let lease_until = request.lease_until.as_i64();
        let purge_at = claim_purge_at(request.purge_at, request.lease_until).as_i64();
        let expires_at = request.expires_at.as_i64();
        let (method, path) = (request.origin.method.as_str(), request.origin.path.as_str());
        let trace_id = request.origin.trace.map(|trace| trace.to_string());
        let identity = request.identity.map(|identity| identity.as_bytes().to_vec());
        let notice = payload(id);
        // The new claim, as the insert (`CLAIM`, whose $13 is the identity the caller knows) and a
        // replacement (`REPLACE`, whose $13 is the notice to its waiters) write it: $1 to $12.
        let new_claim: [&(dyn ToSql + Sync); 12] = [
            &scope,
            &key,
            &fingerprint,
            &digest,
            &token,
            &lease_until,
            &now,
            &purge_at,
            &expires_at,
            &method,
            &path,
            &trace_id,
        ];
        let identity: &(dyn ToSql + Sync) = &identity;
        let claim_params = [&new_claim[..], &[identity]].concat();
        for _ in 0..BEGIN_ATTEMPTS {
            // A new key and a replay, the common cases, are this one statement. No transaction
            // around it: it is atomic by itself, and a replay changes nothing but a count.
            let claim = client.prepare_cached(sql::CLAIM).await.map_err(db)?;
            let row = client.query_one(&claim, &claim_params).await.map_err(db)?;
            if !row.try_get::<_, bool>(17).map_err(db)? {
                return Err(StoreError::IdentityChanged);
            }
            if row.try_get::<_, bool>(16).map_err(db)? {
                return Ok(Begin::Acquired { recovered: false });
            }
            if row.try_get::<_, Option<String>>(0).map_err(db)?.is_none() {
                // Committed (or deleted) while the insert waited: look again.
                continue;
            }
            let read = row;
            let row = StoredRow::from_row(&read, id)?;
            let action = row.stored.on_begin(row.digest.as_slice() == digest, now);
            if matches!(action, Existing::Replay | Existing::Leave) {
                return Ok(self.existing(row.into_record(id.clone())?, action));
            }
            // A claim on a record that exists: decided again under the row's lock. Read
            // committed is enough, as every statement sees what was committed before it, and
            // the lock keeps the row still. The lock is never waited for: a pooled connection
            // queued behind a run's open transaction would be one fewer for every other key.
            let tx = client.transaction().await.map_err(db)?;
            let select = tx.prepare_cached(sql::SELECT_FOR_UPDATE).await.map_err(db)?;
            let locked = match tx.query_opt(&select, &[&scope, &key]).await {
                Ok(locked) => locked,
                Err(err) if lock_not_available(&err) => {
                    tx.rollback().await.map_err(db)?;
                    let record = StoredRow::from_row(&read, id)?.into_record(id.clone())?;
                    match locked_run(record, request.now) {
                        Some(record) => return Ok(self.existing(record, Existing::Leave)),
                        None => {
                            tokio::time::sleep(LOCKED_RETRY_PAUSE).await;
                            continue;
                        }
                    }
                }
                Err(err) => return Err(db(err)),
            };
            let Some(row) = locked else {
                // Deleted between the two statements: try again from the insert.
                tx.rollback().await.map_err(db)?;
                continue;
            };
            let row = StoredRow::from_row(&row, id)?;
            let action = row.stored.on_begin(row.digest.as_slice() == digest, now);
            let begun = if action == Existing::Replace {
                let replace = tx.prepare_cached(sql::REPLACE).await.map_err(db)?;
                tx.query(&replace, &[&new_claim[..], &[&notice]].concat())
                    .await
                    .map_err(db)?;
                Begin::Acquired { recovered: false }
            } else {
                if action == Existing::TakeOver {
                    let recovered = if ran_in_transaction(&row.stored) {
                        let has_checkpoints = tx.prepare_cached(sql::HAS_CHECKPOINTS).await.map_err(db)?;
                        let found = tx.query_one(&has_checkpoints, &[&scope, &key]).await.map_err(db)?;
                        found.try_get::<_, bool>(0).map_err(db)?
                    } else {
                        true
                    };
                    let token = request.token.for_run(recovered);
                    let token = &token.as_bytes()[..];
                    let take_over = tx.prepare_cached(sql::TAKE_OVER).await.map_err(db)?;
                    tx.query(
                        &take_over,
                        &[
                            &scope,
                            &key,
                            &token,
                            &lease_until,
                            &purge_at,
                            &notice,
                            &expires_at,
                            &trace_id,
                            &recovered,
                        ],
                    )
                    .await
                    .map_err(db)?;
                    Begin::Acquired { recovered }
                } else {
                    // A corrupt row fails here, before anything is changed.
                    self.existing(row.into_record(id.clone())?, action)
                }
            };
            tx.commit().await.map_err(db)?;
            return Ok(begun);
        }
        Err(StoreError::unavailable(Failure::new(
            "begin",
            &self.inner.target,
            format!("the record kept disappearing between claiming and reading it ({BEGIN_ATTEMPTS} attempts)"),
            None,
        )))
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin, StoreError> {
        let reads = &self.inner.reads;
        if let Some(row) = reads.read(request.id.scope.as_str(), request.id.key.as_str()).await {
            let row = StoredRow::from_row(&row, request.id)?;
            let action = row.stored.on_begin(
                row.digest.as_slice() == &request.fingerprint.digest()[..],
                request.now.as_i64(),
            );
            // A takeover or a replacement is left to the claim, decided again under the row's lock.
            if matches!(action, Existing::Replay | Existing::Leave) {
                reads.saw(true);
                return Ok(self.existing(row.into_record(request.id.clone())?, action));
            }
        }
        let begun = self.claim(request).await;
        if let Ok(begun) = &begun {
            reads.saw(matches!(begun, Begin::Existing(_)));
        }
        begun
    }

    async fn complete(&self, id: &RecordId, token: FencingToken, completion: Completion) -> Result<(), StoreError> {
        let response: &[u8] = &completion.response;
        let after_claim: [&(dyn ToSql + Sync); 6] = [
            &response,
            &completion.completed_at.as_i64(),
            &completion.expires_at.as_i64(),
            &completion.purge_at.as_i64(),
            &payload(id),
            &i32::from(completion.status),
        ];
        self.change_claim("complete", sql::COMPLETE, id, token, &after_claim, self.db("complete"))
            .await
    }

    async fn claim_state(&self, id: &RecordId, token: FencingToken) -> Result<ClaimState, StoreError> {
        self.read_claim_state("claim_state", id, token).await
    }

    fn completes_in_transactions(&self) -> bool {
        true
    }

    /// Every pooled connection opened from now on sets `statement_timeout`, `lock_timeout` and
    /// `idle_in_transaction_session_timeout` to the longest limit given; those opened before are
    /// closed as they come back to the pool.
    fn bound_operations(&self, limit: Duration) {
        self.inner.bounds.raise(limit);
    }

    async fn release(&self, id: &RecordId, token: FencingToken, release: Release) -> Result<(), StoreError> {
        unless_held(|| self.release_once(id, token, release)).await
    }

    /// A row locked for an instant (a copy's mark on it, another claim deciding under its lock)
    /// is tried again, [`LOCKED_RETRY_PAUSE`] apart and on a connection taken anew each time, as
    /// a release is: a renewal missed is a third of the lease lost, and three in a row lose the
    /// claim to a copy while its run is alive. A lock still held after [`LOCKED_ATTEMPTS`] is the
    /// run's own transaction completing the record, and is reported ([`StoreError::Locked`]).
    async fn renew(&self, id: &RecordId, token: FencingToken, lease_until: UnixMillis) -> Result<(), StoreError> {
        unless_held(|| self.renew_once(id, token, lease_until)).await
    }

    /// One compare-and-set statement: a holder that lost its claim changes nothing.
    async fn checkpoint(&self, id: &RecordId, token: FencingToken, checkpoint: Checkpoint) -> Result<(), StoreError> {
        let value: &[u8] = &checkpoint.value;
        let after_claim: [&(dyn ToSql + Sync); 2] = [&checkpoint.name.as_str(), &value];
        self.change_claim(
            "checkpoint",
            sql::CHECKPOINT,
            id,
            token,
            &after_claim,
            self.db("checkpoint"),
        )
        .await
    }

    async fn checkpoints(&self, id: &RecordId) -> Result<Vec<Checkpoint>, StoreError> {
        let row = self
            .query_opt("checkpoints", sql::CHECKPOINTS, &[&id.scope.as_str(), &id.key.as_str()])
            .await?;
        row.map_or_else(|| Ok(Vec::new()), |row| checkpoints_from_row(&row, id))
    }

    /// Two statements without a transaction around them: the insert waits for a concurrent one to
    /// commit (or roll back) and then does nothing (or makes the salt), and the select, with a
    /// snapshot of its own, reads what was committed.
    async fn scope_salt(&self, candidate: ScopeSalt) -> Result<ScopeSalt, StoreError> {
        let db = self.db("scope_salt");
        self.with_client("scope_salt", async |client| {
            let insert = client.prepare_cached(sql::SCOPE_SALT_INSERT).await.map_err(db)?;
            let identity = &candidate.identity.as_bytes()[..];
            let made = client
                .query_opt(
                    &insert,
                    &[&&candidate.salt[..], &candidate.created_at.as_i64(), &identity],
                )
                .await
                .map_err(db)?;
            if let Some(salt) = made.as_ref().map(scope_salt_from_row).transpose()?.flatten() {
                return Ok(salt);
            }
            let select = client.prepare_cached(sql::SCOPE_SALT_SELECT).await.map_err(db)?;
            for _ in 0..2 {
                match client.query_opt(&select, &[]).await.map_err(db)? {
                    Some(row) => match scope_salt_from_row(&row)? {
                        Some(salt) => return Ok(salt),
                        // Made by an instance of a version before identities: given the candidate's.
                        None => {
                            let identify = client.prepare_cached(sql::SCOPE_SALT_IDENTIFY).await.map_err(db)?;
                            client.execute(&identify, &[&identity]).await.map_err(db)?;
                        }
                    },
                    // Nothing deletes the row: only someone emptying the table by hand in between.
                    None => break,
                }
            }
            Err(StoreError::unavailable(Failure::new(
                "scope_salt",
                &self.inner.target,
                "the scope salt was deleted while it was being read (idem_scope_salt must never be emptied)".to_owned(),
                None,
            )))
        })
        .await
    }

    async fn identity(&self) -> Result<Option<StoreIdentity>, StoreError> {
        match self.query_opt("identity", sql::IDENTITY, &[]).await? {
            Some(row) => identity_from_row(&row, 0),
            None => Ok(None),
        }
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let row = self
            .query_opt("get", sql::SELECT, &[&id.scope.as_str(), &id.key.as_str()])
            .await?;
        let record = row
            .map(|row| StoredRow::from_row(&row, id)?.into_record(id.clone()))
            .transpose()?;
        Ok(record.map(|record| self.inner.replays.with_pending(record)))
    }

    /// One statement: the row is gone when it is read, so a row that cannot be read is deleted
    /// all the same. A row locked for an instant is tried again, as a release is.
    async fn delete(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        unless_held(|| self.delete_once(id)).await
    }

    async fn wait(&self, id: &RecordId, token: FencingToken, deadline: Instant) -> Result<WaitOutcome, StoreError> {
        let subscription = self
            .inner
            .listener
            .as_ref()
            .map(|listener| listener.registry().subscribe(payload(id)));
        // Polling backs off from a quarter of the interval up to it. With notifications it is only
        // a safety net; with `notify=off` it is how changes are seen. The subscription is taken
        // before each check (the listening connection has been listening since before it, or, if
        // it is reconnecting, wakes every waiter once it listens again).
        let mut locked = false;
        if subscription.is_some() {
            let db = self.db("wait");
            let marked = self
                .with_client("wait", async |client| {
                    let stmt = client.prepare_cached(sql::WAIT_ON).await.map_err(db)?;
                    client
                        .execute(&stmt, &[&id.scope.as_str(), &id.key.as_str(), &&token.as_bytes()[..]])
                        .await
                        .map_err(db)
                })
                .await?;
            // Not marked: the claim ended, or its row is locked (its run completing in its own
            // transaction), which the mark does not wait for. Then its end is seen by polling
            // only, at the slow end of the backoff: such a run lasts as long as its transaction.
            if marked == 0 {
                if self.read_claim_state("wait", id, token).await? != ClaimState::Current {
                    return Ok(WaitOutcome::Changed);
                }
                locked = true;
            }
        }
        let max_poll = self.inner.poll_interval;
        let first_poll = if locked { max_poll } else { max_poll / 4 };
        let notify = subscription.as_ref().map(|s| s.notify());
        wait_for_change(notify, deadline, first_poll, max_poll, || async {
            Ok(self.read_claim_state("wait", id, token).await? == ClaimState::Current)
        })
        .await
    }

    async fn purge(&self, now: UnixMillis, batch: usize) -> Result<Purged, StoreError> {
        let db = self.db("purge");
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let now = now.as_i64();
        self.with_client("purge", async |client| {
            let tx = client.transaction().await.map_err(db)?;
            let lock = tx.prepare_cached(sql::PURGE_LOCK).await.map_err(db)?;
            let locked: bool = tx
                .query_one(&lock, &[&sql::PURGE_LOCK_CLASS])
                .await
                .map_err(db)?
                .try_get(0)
                .map_err(db)?;
            if !locked {
                // Another instance is purging this schema right now.
                tx.rollback().await.map_err(db)?;
                return Ok(Purged::default());
            }
            let delete = tx.prepare_cached(sql::PURGE_DELETE).await.map_err(db)?;
            let deleted = tx.execute(&delete, &[&now, &limit]).await.map_err(db)?;
            let tombstone = tx.prepare_cached(sql::PURGE_TOMBSTONE).await.map_err(db)?;
            let tombstoned = tx.execute(&tombstone, &[&now, &limit]).await.map_err(db)?;
            tx.commit().await.map_err(db)?;
            Ok(Purged { deleted, tombstoned })
        })
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let db = self.db("ping");
        self.with_client("ping", async |client| {
            let stmt = client.prepare_cached(sql::PING).await.map_err(db)?;
            client.query_one(&stmt, &[]).await.map(drop).map_err(db)
        })
        .await
    }

    async fn clock(&self) -> Result<UnixMillis, StoreError> {
        let db = self.db("clock");
        self.with_client("clock", async |client| {
            let stmt = client.prepare_cached(sql::CLOCK).await.map_err(db)?;
            let millis: i64 = client.query_one(&stmt, &[]).await.map_err(db)?.get(0);
            u64::try_from(millis)
                .map(UnixMillis)
                .map_err(|_| StoreError::Corrupt(format!("the server's clock reads {millis} ms since 1970")))
        })
        .await
    }

    /// The deletes announced on the `LISTEN` connection; none without one (`notify=false`),
    /// so no replay cache is kept then.
    fn invalidations(&self) -> Option<Arc<Invalidations>> {
        let listener = self.inner.listener.as_ref()?;
        Some(Arc::clone(listener.registry().invalidations()))
    }

    fn count_replay(&self, id: &RecordId) {
        self.inner.replays.count(id);
    }

    /// One statement, through the `created_at` index; a row that does not read is skipped, with
    /// a warning. Replay counts are the rows' (an operator lists from a process of their own, which
    /// counted none).
    async fn list(&self, query: &ListQuery) -> Result<Vec<Listed>, StoreError> {
        let db = self.db("list");
        self.with_client("list", async |client| {
            let since = query.since.map(UnixMillis::as_i64);
            let state = query.state.map(ListedState::as_str);
            let limit = i64::try_from(query.limit).unwrap_or(i64::MAX);
            let route = query.route_reading();
            // Typed, so that it is sent as an unnamed statement (one round trip), which the server
            // plans with these values.
            let rows = client
                .query_typed(
                    sql::LIST,
                    &[
                        (&query.now.as_i64(), Type::INT8),
                        (&since, Type::INT8),
                        (&query.recovered, Type::BOOL),
                        (&route, Type::TEXT),
                        (&state, Type::TEXT),
                        (&limit, Type::INT8),
                    ],
                )
                .await
                .map_err(db)?;
            Ok(rows
                .iter()
                .filter_map(|row| match listed_from_row(row, query.now) {
                    Ok(listed) => Some(listed),
                    Err(reason) => {
                        tracing::warn!(server = %self.inner.target, %reason, "skipped a record that does not read in a listing");
                        None
                    }
                })
                .collect())
        })
        .await
    }
}

/// A run in flight whose lease ended, found with its row locked by a transaction still open (its
/// handler's own, completing it): a lock held is a run alive, so it is not taken over. Its lease
/// is read as going on for [`LOCKED_RUN_LEASE`] more, so that the copy waits that long (woken
/// at once if the claim changes) before it tries again. `None` for a record not in flight (a
/// row locked for an instant by another claim or a purge): the claim is tried again.
fn locked_run(mut record: Record, now: UnixMillis) -> Option<Record> {
    match &mut record.state {
        idem_core::store::RecordState::InFlight { lease_until, .. } => {
            *lease_until = (*lease_until).max(now.plus(LOCKED_RUN_LEASE));
            Some(record)
        }
        _ => None,
    }
}

fn abandoned_purge_at(lease_until: UnixMillis) -> i64 {
    idem_core::store::backend::abandoned_purge_at(lease_until).as_i64()
}

/// How many times a renewal, a release or a delete that found the record's row locked tries,
/// [`LOCKED_RETRY_PAUSE`] apart, before it reports [`StoreError::Locked`]: another claim's or a
/// purge's lock lasts an instant; a run's own transaction, completing the record, lasts as long
/// as the run.
const LOCKED_ATTEMPTS: usize = 5;

/// `attempt` until it does not find the record's row locked, at most [`LOCKED_ATTEMPTS`] times,
/// [`LOCKED_RETRY_PAUSE`] apart; each try takes a pooled connection anew.
async fn unless_held<T, F>(mut attempt: impl FnMut() -> F) -> Result<T, StoreError>
where
    F: Future<Output = Result<T, StoreError>>,
{
    for _ in 1..LOCKED_ATTEMPTS {
        match attempt().await {
            Err(StoreError::Locked) => tokio::time::sleep(LOCKED_RETRY_PAUSE).await,
            done => return done,
        }
    }
    attempt().await
}

/// A compare-and-set that changed nothing lost its claim.
fn fenced(changed: usize) -> Result<(), StoreError> {
    if changed == 0 { Err(StoreError::Fenced) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::describe;
    use crate::sql::{
        CHECKPOINT, CHECKPOINTS, LIST, PURGE_DELETE, PURGE_TOMBSTONE, SCOPE_SALT_INSERT, SELECT, SELECT_FOR_UPDATE,
    };

    /// The plans of the lookups, of purging, of making the scope salt and of listing on a table of
    /// 20 000 records, 100 of them due: indexes, never a scan of the whole table. Runs against the test
    /// server (`IDEM_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookups_and_purging_use_the_indexes() {
        let base = std::env::var("IDEM_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        // Named like the integration tests' schemas, whose clean-up drops it if this test fails.
        let secs = UnixMillis::now().0 / 1000;
        let schema = format!("idem_test_{secs}_plans{}", std::process::id());
        let separator = if base.contains('?') { '&' } else { '?' };
        let store = PostgresStore::connect(&format!("{base}{separator}schema={schema}&notify=off"))
            .await
            .unwrap_or_else(|err| {
                panic!(
                    "{}; start PostgreSQL with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`",
                    describe(&err)
                )
            });
        let client = store.client("test").await.unwrap();
        client
            .batch_execute(
                "INSERT INTO idem_records (scope, key, state, fingerprint, digest, response, created_at,
                     completed_at, expires_at, purge_at)
                 SELECT 'scope-' || (i % 100), 'key-' || i, 'completed', '\\x00', '\\x00',
                     CASE WHEN i % 10 = 0 THEN NULL ELSE '\\x01'::bytea END, i, i, 1000000 + i, 2000000 + i
                 FROM generate_series(1, 20000) AS i;
                 ANALYZE idem_records;",
            )
            .await
            .unwrap();
        let plan = |sql: &'static str, params: Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>>| {
            let client = &client;
            async move {
                let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
                    .iter()
                    .map(|p| &**p as &(dyn tokio_postgres::types::ToSql + Sync))
                    .collect();
                let rows = client.query(&format!("EXPLAIN {sql}"), &params).await.unwrap();
                rows.iter()
                    .map(|row| row.get::<_, String>(0))
                    .collect::<Vec<_>>()
                    .join("\n")
            }
        };
        let lookup = plan(SELECT, vec![Box::new("scope-7"), Box::new("key-7")]).await;
        assert!(lookup.contains("Index Scan using idem_records_pkey"), "{lookup}");
        let locking = plan(SELECT_FOR_UPDATE, vec![Box::new("scope-7"), Box::new("key-7")]).await;
        assert!(locking.contains("Index Scan using idem_records_pkey"), "{locking}");
        let deleting = plan(PURGE_DELETE, vec![Box::new(2_000_100_i64), Box::new(1000_i64)]).await;
        assert!(deleting.contains("Tid Scan"), "{deleting}");
        assert!(deleting.contains("idem_records_purge_at"), "{deleting}");
        let checkpoint = plan(
            CHECKPOINT,
            vec![
                Box::new("scope-7"),
                Box::new("key-7"),
                Box::new(vec![0_u8; 16]),
                Box::new("charged"),
                Box::new(b"ch_1".to_vec()),
            ],
        )
        .await;
        assert!(checkpoint.contains("idem_records_pkey"), "{checkpoint}");
        let checkpoints = plan(CHECKPOINTS, vec![Box::new("scope-7"), Box::new("key-7")]).await;
        assert!(
            checkpoints.contains("Index Scan using idem_records_pkey"),
            "{checkpoints}"
        );
        let salting = plan(
            SCOPE_SALT_INSERT,
            vec![
                Box::new(vec![0_u8; 32]),
                Box::new(UnixMillis::now().as_i64()),
                Box::new(vec![0_u8; 16]),
            ],
        )
        .await;
        assert!(salting.contains("idem_records_purge_at"), "{salting}");
        let tombstoning = plan(PURGE_TOMBSTONE, vec![Box::new(1_000_100_i64), Box::new(1000_i64)]).await;
        assert!(tombstoning.contains("Tid Scan"), "{tombstoning}");
        assert!(tombstoning.contains("idem_records_expires_at"), "{tombstoning}");
        // The newest 50, of every record or of the completed ones since a time: read from the
        // newest end of the `created_at` index, not sorted out of the whole table.
        let listing = |since: Option<i64>, state: Option<&'static str>| {
            plan(
                LIST,
                vec![
                    Box::new(1_000_100_i64),
                    Box::new(since),
                    Box::new(false),
                    Box::new(None::<String>),
                    Box::new(state),
                    Box::new(50_i64),
                ],
            )
        };
        let newest = listing(None, None).await;
        assert!(
            newest.contains("Index Scan Backward using idem_records_created_at"),
            "{newest}"
        );
        let since = listing(Some(19_000), Some("completed")).await;
        assert!(since.contains("Index Cond: (created_at >="), "{since}");
        for plan in [
            &newest,
            &since,
            &lookup,
            &locking,
            &checkpoint,
            &checkpoints,
            &deleting,
            &salting,
            &tombstoning,
        ] {
            assert!(!plan.contains("Seq Scan"), "{plan}");
        }
        client
            .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .await
            .unwrap();
    }
}
