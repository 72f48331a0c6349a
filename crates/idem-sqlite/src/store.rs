//! [`SqliteStore`]: the `Store` primitives as SQLite transactions. Every write is one
//! `BEGIN IMMEDIATE` transaction, which takes the database's write lock before it reads, so
//! concurrent claims, in this process or another one, are serialised by SQLite itself.
//!
//! The statements are in `sql.rs`, rows are read in `decode.rs`, listing is `list.rs`'s, and the
//! connections (and the blocking threads they run on) are `conn.rs`'s: this module is the
//! operations.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use async_trait::async_trait;
use idem_core::store::Invalidations;
use idem_core::store::backend::{
    Existing, IN_FLIGHT, ReplayCounts, claim_purge_at, claim_state, ran_in_transaction, wait_for_change,
};
use idem_core::{
    Store, StoreError, UnixMillis,
    store::{
        Begin, BeginRequest, Checkpoint, ClaimState, Completion, FencingToken, ListQuery, Listed, Purged, Record,
        RecordId, Release, ScopeSalt, StoreIdentity, WaitOutcome,
    },
};
use rusqlite::{Connection, OptionalExtension, ToSql, Transaction, params};

use crate::conn::{Connections, db_error};
use crate::decode::{self, StoredRow};
use crate::deletions::{self, FileDeletions};
use crate::sql;
use crate::waiters::{self, Subscription};
use crate::{SqliteError, checkpoints, list, schema};

/// Polling for changes made by other processes, which cannot wake this one.
const POLL_FIRST: Duration = Duration::from_millis(5);
const POLL_MAX: Duration = Duration::from_millis(100);

/// An idempotency store in one SQLite file.
///
/// Any number of processes may open the same file: claims are atomic across them, and waiters are
/// woken at once by changes made in this process and within 100 ms by changes made elsewhere. The
/// file must be on a local file system (WAL mode needs shared memory between the processes).
///
/// Cloning is cheap and shares the connections.
#[derive(Clone)]
pub struct SqliteStore {
    conns: Arc<Connections>,
    /// The file's deletes, told to this process's replay caches.
    deletions: Arc<FileDeletions>,
    /// Replays answered from a replay cache, counted here and added to their records in batches.
    replays: Arc<ReplayCounts>,
}

/// How often the replays answered from a replay cache are added to their records.
const FLUSH_REPLAYS_EVERY: Duration = Duration::from_millis(500);

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore").field("path", &self.conns.path()).finish()
    }
}

impl SqliteStore {
    /// Opens the database at `path`, creating the file and the schema if they are absent.
    ///
    /// The directory must exist. `":memory:"` opens a private in-memory database (for tests; it
    /// is gone when the store is dropped, and no other store can see it).
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, SqliteError> {
        let conns = Arc::new(Connections::open(path.as_ref().to_owned()).await?);
        let deletions = deletions::of(conns.database());
        let store = Self {
            conns,
            deletions,
            replays: Arc::default(),
        };
        store.migrate().await?;
        store.follow_deletions().await;
        let conns = Arc::downgrade(&store.conns);
        ReplayCounts::flush_forever(
            Arc::clone(&store.replays),
            FLUSH_REPLAYS_EVERY,
            conns.clone(),
            move |counts| write_replays(conns.upgrade(), counts),
        );
        Ok(store)
    }

    /// Reads the file's count of deletes now, and every [`deletions::DELETIONS_POLL_INTERVAL`] while the
    /// store lives and a replay cache listens, so that deletes made by other processes reach
    /// this one's caches.
    async fn follow_deletions(&self) {
        let poll = |conns: Arc<Connections>, file: Arc<FileDeletions>| async move {
            let count = conns.read(|conn| deletions::read_count(conn).map_err(db_error)).await;
            file.polled(count.ok());
        };
        poll(Arc::clone(&self.conns), Arc::clone(&self.deletions)).await;
        let (conns, file) = (Arc::downgrade(&self.conns), Arc::clone(&self.deletions));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(deletions::DELETIONS_POLL_INTERVAL).await;
                let Some(conns) = conns.upgrade() else { return };
                if file.invalidations().is_watched() {
                    poll(conns, Arc::clone(&file)).await;
                }
            }
        });
    }

    /// Opens the database named by a URL: `sqlite://relative/path.db`, `sqlite:///absolute/path.db`
    /// or `sqlite:path`.
    pub async fn from_url(url: &str) -> Result<Self, SqliteError> {
        Self::open(crate::url::path_of(url)?).await
    }

    /// Creates the schema if it is absent; does nothing if it is there. [`SqliteStore::open`] calls it.
    pub async fn migrate(&self) -> Result<(), SqliteError> {
        self.conns.setup(schema::migrate).await
    }

    /// The path of the database file, as given.
    pub fn path(&self) -> &Path {
        self.conns.path()
    }

    /// Where the claim `token` on the record stands.
    async fn read_claim_state(&self, id: &RecordId, token: FencingToken) -> Result<ClaimState, StoreError> {
        let owned = id.clone();
        let found = self
            .conns
            .read(move |conn| {
                conn.prepare_cached(sql::CLAIM_STATE)
                    .and_then(|mut stmt| {
                        let (scope, key) = (owned.scope.as_str(), owned.key.as_str());
                        stmt.query_row(params![scope, key, &token.as_bytes()[..]], |row| {
                            Ok((row.get::<_, String>(0)?, row.get::<_, bool>(1)?))
                        })
                        .optional()
                    })
                    .map_err(db_error)
            })
            .await?;
        Ok(found.map_or(ClaimState::Ended, |(state, is_token)| claim_state(&state, is_token)))
    }

    fn wake(&self, id: &RecordId) {
        waiters::wake(self.conns.database(), id);
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin, StoreError> {
        let id = request.id.clone();
        let owned = OwnedBegin {
            fingerprint: request.fingerprint.encode(),
            digest: *request.fingerprint.digest(),
            now: request.now,
            lease_until: request.lease_until,
            expires_at: request.expires_at,
            purge_at: request.purge_at,
            token: request.token,
            method: request.origin.method.clone(),
            path: request.origin.path.clone(),
            trace_id: request.origin.trace.map(|trace| trace.to_string()),
            identity: request.identity,
        };
        let (begun, changed_hands) = self.conns.write(move |tx| begin_in(tx, id, owned)).await?;
        if changed_hands {
            self.wake(request.id);
        }
        Ok(begun)
    }

    async fn complete(&self, id: &RecordId, token: FencingToken, completion: Completion) -> Result<(), StoreError> {
        let owned = id.clone();
        self.conns
            .write(move |tx| {
                let after_claim = params![
                    &completion.response[..],
                    completion.completed_at.as_i64(),
                    completion.expires_at.as_i64(),
                    completion.purge_at.as_i64(),
                    completion.status
                ];
                change_claim(tx, sql::COMPLETE, &owned, token, after_claim)
            })
            .await?;
        self.wake(id);
        Ok(())
    }

    async fn claim_state(&self, id: &RecordId, token: FencingToken) -> Result<ClaimState, StoreError> {
        let state = self.read_claim_state(id, token).await?;
        if state == ClaimState::Completed {
            // Completed by the handler's own transaction, on a connection of its own that wakes
            // nobody: waiters in this process learn it now rather than at their next poll.
            self.wake(id);
        }
        Ok(state)
    }

    fn completes_in_transactions(&self) -> bool {
        true
    }

    async fn release(&self, id: &RecordId, token: FencingToken, release: Release) -> Result<(), StoreError> {
        let owned = id.clone();
        self.conns
            .write(move |tx| match release {
                Release::Forget => change_claim(tx, sql::FORGET, &owned, token, params![]),
                Release::Unknown { expires_at, purge_at } => {
                    let after_claim = params![expires_at.as_i64(), purge_at.as_i64()];
                    change_claim(tx, sql::RELEASE_UNKNOWN, &owned, token, after_claim)
                }
            })
            .await?;
        self.wake(id);
        Ok(())
    }

    async fn renew(&self, id: &RecordId, token: FencingToken, lease_until: UnixMillis) -> Result<(), StoreError> {
        let id = id.clone();
        self.conns
            .write(move |tx| {
                let after_claim = params![lease_until.as_i64(), abandoned_purge_at(lease_until)];
                change_claim(tx, sql::RENEW, &id, token, after_claim)
            })
            .await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let id = id.clone();
        let record = self
            .conns
            .read(move |conn| find(conn, &id)?.map(|row| row.into_record(id)).transpose())
            .await?;
        Ok(record.map(|record| self.replays.with_pending(record)))
    }

    async fn checkpoint(&self, id: &RecordId, token: FencingToken, checkpoint: Checkpoint) -> Result<(), StoreError> {
        // Nobody waits on checkpoints: the claim does not change hands, so nobody is woken.
        let id = id.clone();
        self.conns
            .write(move |tx| checkpoint_in(tx, &id, token, &checkpoint))
            .await
    }

    async fn checkpoints(&self, id: &RecordId) -> Result<Vec<Checkpoint>, StoreError> {
        let id = id.clone();
        self.conns.read(move |conn| checkpoints_of(conn, &id)).await
    }

    async fn scope_salt(&self, candidate: ScopeSalt) -> Result<ScopeSalt, StoreError> {
        // A write even when the salt exists, so that the check and the insert are one step; it is
        // asked once per instance, not per request.
        self.conns.write(move |tx| scope_salt_in(tx, &candidate)).await
    }

    async fn identity(&self) -> Result<Option<StoreIdentity>, StoreError> {
        self.conns.read(identity_in).await
    }

    async fn delete(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let owned = id.clone();
        let deleted = self
            .conns
            .write(move |tx| {
                let (scope, key) = (owned.scope.as_str(), owned.key.as_str());
                // A row that cannot be read is deleted all the same (the inner error): only a
                // failure of a statement itself rolls back.
                let found = tx
                    .prepare_cached(sql::SELECT_RECORD)
                    .and_then(|mut stmt| {
                        stmt.query_row(params![scope, key], |row| Ok(StoredRow::from_row(row)))
                            .optional()
                    })
                    .map_err(db_error)?;
                // The write lock is held since BEGIN IMMEDIATE: the row read is the row changed.
                let in_flight = matches!(&found, Some(Ok(row)) if row.stored.state == IN_FLIGHT);
                let statement = if in_flight { sql::DELETE_IN_FLIGHT } else { sql::DELETE };
                tx.prepare_cached(statement)
                    .and_then(|mut stmt| stmt.execute(params![scope, key]))
                    .map_err(db_error)?;
                let count = match found {
                    Some(_) => Some(deletions::count_delete(tx).map_err(db_error)?),
                    None => None,
                };
                Ok(found.zip(count))
            })
            .await?;
        let Some((row, count)) = deleted else {
            return self.replays.deleted(id, Ok(None));
        };
        self.deletions.deleted(&id.digest(), count);
        self.wake(id);
        let record = row
            .map_err(db_error)
            .and_then(|row| row.into_record(id.clone()).map(Some));
        self.replays.deleted(id, record)
    }

    async fn wait(&self, id: &RecordId, token: FencingToken, deadline: Instant) -> Result<WaitOutcome, StoreError> {
        let subscription = Subscription::new(self.conns.database(), id);
        wait_for_change(Some(subscription.notify()), deadline, POLL_FIRST, POLL_MAX, || async {
            Ok(self.read_claim_state(id, token).await? == ClaimState::Current)
        })
        .await
    }

    async fn purge(&self, now: UnixMillis, batch: usize) -> Result<Purged, StoreError> {
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        self.conns
            .write(move |tx| {
                let now = now.as_i64();
                let deleted = tx
                    .prepare_cached(sql::PURGE_DELETE)
                    .and_then(|mut stmt| stmt.execute(params![now, limit]))
                    .map_err(db_error)?;
                let tombstoned = tx
                    .prepare_cached(sql::PURGE_TOMBSTONE)
                    .and_then(|mut stmt| stmt.execute(params![now, limit]))
                    .map_err(db_error)?;
                Ok(Purged {
                    deleted: deleted as u64,
                    tombstoned: tombstoned as u64,
                })
            })
            .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.conns
            .read(|conn| {
                conn.query_row(sql::PING, [], |row| row.get::<_, i64>(0))
                    .map(drop)
                    .map_err(db_error)
            })
            .await
    }

    async fn clock(&self) -> Result<UnixMillis, StoreError> {
        // The file is on a local file system (WAL needs shared memory), so every process using
        // it shares this machine's clock.
        Ok(UnixMillis::now())
    }

    fn clock_is_local(&self) -> bool {
        true
    }

    /// An operation's wait for this process's connection and for another process's lock on the
    /// file together last at most the longest limit given (see `conn.rs`).
    fn bound_operations(&self, limit: std::time::Duration) {
        self.conns.bound_by(limit);
    }

    fn invalidations(&self) -> Option<Arc<Invalidations>> {
        Some(Arc::clone(self.deletions.invalidations()))
    }

    fn count_replay(&self, id: &RecordId) {
        self.replays.count(id);
    }

    async fn list(&self, query: &ListQuery) -> Result<Vec<Listed>, StoreError> {
        // Replays counted in memory and not yet written are left out: the counts are statistics,
        // written within `FLUSH_REPLAYS_EVERY`.
        let query = query.clone();
        self.conns.read(move |conn| list::list(conn, &query)).await
    }
}

/// Adds `counts` to their records in one transaction; returns them all if it failed (or the store
/// is gone), to try again.
async fn write_replays(conns: Option<Arc<Connections>>, counts: HashMap<RecordId, u64>) -> HashMap<RecordId, u64> {
    let Some(conns) = conns else {
        return HashMap::new();
    };
    let written = Arc::new(counts);
    let batch = Arc::clone(&written);
    let result = conns
        .write(move |tx| {
            let mut stmt = tx.prepare_cached(sql::ADD_REPLAYS).map_err(db_error)?;
            for (id, n) in batch.iter() {
                let n = i64::try_from(*n).unwrap_or(i64::MAX);
                stmt.execute(params![id.scope.as_str(), id.key.as_str(), n])
                    .map_err(db_error)?;
            }
            Ok(())
        })
        .await;
    match result {
        Ok(()) => HashMap::new(),
        Err(err) => {
            tracing::warn!(error = %err, records = written.len(), "could not write replay counts; trying again");
            Arc::try_unwrap(written).unwrap_or_else(|shared| (*shared).clone())
        }
    }
}

/// A compare-and-set that changed nothing lost its claim.
fn fenced(changed: usize) -> Result<(), StoreError> {
    if changed == 0 { Err(StoreError::Fenced) } else { Ok(()) }
}

/// Runs `sql`, a compare-and-set on the claim `token` of `id` (its scope, key and token are `?1`
/// to `?3`, `after_claim` the parameters from `?4` on), in `tx`: fenced if it changed nothing.
fn change_claim(
    tx: &Transaction<'_>,
    sql: &str,
    id: &RecordId,
    token: FencingToken,
    after_claim: &[&dyn ToSql],
) -> Result<(), StoreError> {
    let (scope, key, token) = (id.scope.as_str(), id.key.as_str(), &token.as_bytes()[..]);
    let mut params: Vec<&dyn ToSql> = vec![&scope, &key, &token];
    params.extend_from_slice(after_claim);
    let changed = tx
        .prepare_cached(sql)
        .and_then(|mut stmt| stmt.execute(&*params))
        .map_err(db_error)?;
    fenced(changed)
}

fn abandoned_purge_at(lease_until: UnixMillis) -> i64 {
    idem_core::store::backend::abandoned_purge_at(lease_until).as_i64()
}

/// The record's row, if there is one.
fn find(conn: &Connection, id: &RecordId) -> Result<Option<StoredRow>, StoreError> {
    conn.prepare_cached(sql::SELECT_RECORD)
        .and_then(|mut stmt| {
            stmt.query_row(params![id.scope.as_str(), id.key.as_str()], StoredRow::from_row)
                .optional()
        })
        .map_err(db_error)
}

/// `begin` inside its transaction; also says whether a record changed hands, which wakes waiters.
fn begin_in(tx: &Transaction<'_>, id: RecordId, request: OwnedBegin) -> Result<(Begin, bool), StoreError> {
    let OwnedBegin {
        fingerprint,
        digest,
        now,
        lease_until,
        expires_at,
        purge_at,
        token,
        method,
        path,
        trace_id,
        identity,
    } = request;
    // Checked in the claim's own write transaction: no other process can make or replace the
    // salt between the check and the claim.
    if identity.is_some() && identity_in(tx)? != identity {
        return Err(StoreError::IdentityChanged);
    }
    let (scope, key) = (id.scope.as_str(), id.key.as_str());
    let purge_at = claim_purge_at(purge_at, lease_until).as_i64();
    let expires_at = expires_at.as_i64();
    // The new claim, as the insert and a replacement write it.
    let (claim_token, claim_lease_until, created_at) = (token.as_bytes(), lease_until.as_i64(), now.as_i64());
    let new_claim = params![
        scope,
        key,
        fingerprint,
        &digest[..],
        &claim_token[..],
        claim_lease_until,
        created_at,
        purge_at,
        expires_at,
        method,
        path,
        trace_id
    ];
    let inserted = tx
        .prepare_cached(sql::CLAIM)
        .and_then(|mut stmt| stmt.query_row(new_claim, |_| Ok(())).optional())
        .map_err(db_error)?;
    if inserted.is_some() {
        return Ok((Begin::Acquired { recovered: false }, false));
    }
    // The write lock is held since BEGIN IMMEDIATE: the conflicting row is committed and visible.
    let row = find(tx, &id)?
        .ok_or_else(|| StoreError::Corrupt(format!("record {scope} {key} conflicted on insert but cannot be read")))?;
    let now = now.as_i64();
    let action = row.stored.on_begin(row.digest.as_slice() == digest.as_slice(), now);
    if action == Existing::Replace {
        tx.prepare_cached(sql::REPLACE)
            .and_then(|mut stmt| stmt.execute(new_claim))
            .map_err(db_error)?;
        return Ok((Begin::Acquired { recovered: false }, true));
    }
    if action == Existing::TakeOver {
        let recovered = if ran_in_transaction(&row.stored) {
            tx.prepare_cached(sql::HAS_CHECKPOINTS)
                .and_then(|mut stmt| stmt.query_row(params![scope, key], |row| row.get::<_, bool>(0)))
                .map_err(db_error)?
        } else {
            true
        };
        let token = token.for_run(recovered);
        tx.prepare_cached(sql::TAKE_OVER)
            .and_then(|mut stmt| {
                stmt.execute(params![
                    scope,
                    key,
                    &token.as_bytes()[..],
                    lease_until.as_i64(),
                    purge_at,
                    expires_at,
                    trace_id,
                    recovered
                ])
            })
            .map_err(db_error)?;
        return Ok((Begin::Acquired { recovered }, true));
    }
    let replayed = action == Existing::Replay;
    if replayed {
        tx.prepare_cached(sql::COUNT_REPLAY)
            .and_then(|mut stmt| stmt.execute(params![scope, key]))
            .map_err(db_error)?;
    }
    // A corrupt row fails here, which rolls the increment back.
    let mut record = row.into_record(id)?;
    if replayed {
        record.replays += 1;
    }
    Ok((Begin::Existing(record), false))
}

/// A [`BeginRequest`] that can move to the blocking thread, its origin as stored (the trace id
/// as its hex digits).
struct OwnedBegin {
    fingerprint: Vec<u8>,
    digest: [u8; 32],
    now: UnixMillis,
    lease_until: UnixMillis,
    expires_at: UnixMillis,
    purge_at: UnixMillis,
    token: FencingToken,
    method: String,
    path: String,
    trace_id: Option<String>,
    identity: Option<StoreIdentity>,
}

/// `checkpoint` inside its transaction: reads the list of the claim `token`, records `checkpoint`
/// in it and writes it back; [`StoreError::Fenced`] if `token` is not the record's current claim.
fn checkpoint_in(
    tx: &Transaction<'_>,
    id: &RecordId,
    token: FencingToken,
    checkpoint: &Checkpoint,
) -> Result<(), StoreError> {
    let (scope, key, token) = (id.scope.as_str(), id.key.as_str(), &token.as_bytes()[..]);
    let held: Option<Option<Vec<u8>>> = tx
        .prepare_cached(sql::CHECKPOINTS_OF_CLAIM)
        .and_then(|mut stmt| stmt.query_row(params![scope, key, token], |row| row.get(0)).optional())
        .map_err(db_error)?;
    let Some(list) = held else {
        return Err(StoreError::Fenced);
    };
    let list = checkpoints::with(list.as_deref(), checkpoint)?;
    // The write lock is held since BEGIN IMMEDIATE: the claim read above is still current.
    let changed = tx
        .prepare_cached(sql::SET_CHECKPOINTS)
        .and_then(|mut stmt| stmt.execute(params![scope, key, list]))
        .map_err(db_error)?;
    fenced(changed)
}

/// The checkpoints of the record: none without a record, and none for a completed one (whose run is
/// over; `complete` clears them, this only guards against a row written otherwise).
fn checkpoints_of(conn: &Connection, id: &RecordId) -> Result<Vec<Checkpoint>, StoreError> {
    let list: Option<Option<Vec<u8>>> = conn
        .prepare_cached(sql::CHECKPOINTS)
        .and_then(|mut stmt| {
            stmt.query_row(params![id.scope.as_str(), id.key.as_str()], |row| row.get(0))
                .optional()
        })
        .map_err(db_error)?;
    checkpoints::decode(list.flatten().as_deref())
}

/// `scope_salt` inside its transaction: stores `candidate` unless the store has a salt already,
/// then reads whichever salt is there. The write lock is held since BEGIN IMMEDIATE, so concurrent
/// callers, in this process or another one, all read the salt the first of them stored, and the
/// records measured for `older_records_until` are exactly those held when it was made (`max` is
/// read off the `purge_at` index, not by a scan).
fn scope_salt_in(tx: &Transaction<'_>, candidate: &ScopeSalt) -> Result<ScopeSalt, StoreError> {
    let identity = &candidate.identity.as_bytes()[..];
    tx.prepare_cached(sql::SCOPE_SALT_INSERT)
        .and_then(|mut stmt| stmt.execute(params![&candidate.salt[..], candidate.created_at.as_i64(), identity]))
        .map_err(db_error)?;
    tx.prepare_cached(sql::SCOPE_SALT_IDENTIFY)
        .and_then(|mut stmt| stmt.execute(params![identity]))
        .map_err(db_error)?;
    let (salt, created_at, older_records_until, identity) = tx
        .prepare_cached(sql::SCOPE_SALT_SELECT)
        .and_then(|mut stmt| stmt.query_row([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?))))
        .map_err(db_error)?;
    decode::scope_salt(salt, created_at, older_records_until, identity)
}

/// The store's identity as it stands in `conn` (`None`: no salt).
fn identity_in(conn: &Connection) -> Result<Option<StoreIdentity>, StoreError> {
    let identity: Option<Option<Vec<u8>>> = conn
        .prepare_cached(sql::IDENTITY)
        .and_then(|mut stmt| stmt.query_row([], |row| row.get(0)).optional())
        .map_err(db_error)?;
    decode::store_identity(identity.flatten())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use idem_core::Fingerprint;

    /// The record of `key` in the shared scope.
    fn shared_id(key: &str) -> RecordId {
        RecordId {
            scope: idem_core::Scope::shared(),
            key: idem_core::IdempotencyKey::new(key).unwrap(),
        }
    }

    fn plan(conn: &Connection, sql: &str) -> String {
        plan_with(conn, sql, params![0, 10])
    }

    fn plan_with(conn: &Connection, sql: &str, params: &[&dyn rusqlite::ToSql]) -> String {
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let rows = stmt.query_map(params, |row| row.get::<_, String>(3)).unwrap();
        rows.map(Result::unwrap).collect::<Vec<_>>().join("; ")
    }

    #[tokio::test]
    async fn purging_uses_the_indexes() {
        let store = SqliteStore::open(":memory:").await.unwrap();
        let conn = store.conns.writer();
        let deleting = plan(&conn, "SELECT rowid FROM idem_records WHERE purge_at <= ?1 LIMIT ?2");
        assert!(
            deleting.contains("USING COVERING INDEX idem_records_purge_at"),
            "{deleting}"
        );
        let tombstoning = plan(
            &conn,
            "SELECT rowid FROM idem_records WHERE response IS NOT NULL AND expires_at <= ?1 LIMIT ?2",
        );
        assert!(
            tombstoning.contains("USING INDEX idem_records_expires_at"),
            "{tombstoning}"
        );
    }

    /// Listing walks the `created_at` index newest first and stops at the limit: it sorts only
    /// records created in the same millisecond (by scope and key), never the table.
    #[tokio::test]
    async fn listing_walks_the_created_at_index() {
        let store = SqliteStore::open(":memory:").await.unwrap();
        let conn = store.conns.writer();
        let path: Option<&[u8]> = Some(b"/payments");
        let listing = plan_with(
            &conn,
            sql::LIST,
            params![0, i64::MIN, Some("completed"), true, path, 10],
        );
        assert!(
            listing.contains("USING INDEX idem_records_created_at (created_at>?)"),
            "{listing}"
        );
        assert!(
            listing.contains("TEMP B-TREE FOR LAST 2 TERMS OF ORDER BY"),
            "{listing}"
        );
    }

    #[tokio::test]
    async fn changes_wake_subscribers_of_every_store_object_on_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("idem.db");
        let (holder, watcher) = (
            SqliteStore::open(&path).await.unwrap(),
            SqliteStore::open(&path).await.unwrap(),
        );
        let id = shared_id("wake");
        let fingerprint = Fingerprint::of(
            &http::Method::POST,
            &"/pay".parse().unwrap(),
            &http::HeaderMap::new(),
            b"body",
        );
        let token = FencingToken::random();
        let now = UnixMillis(1_000);
        let request = BeginRequest {
            id: &id,
            fingerprint: &fingerprint,
            now,
            lease_until: now,
            expires_at: UnixMillis(100_000),
            purge_at: UnixMillis(1_000_000),
            token,
            origin: &idem_core::store::Origin::default(),
            identity: None,
        };
        holder.begin(request).await.unwrap();

        let subscription = Subscription::new(watcher.conns.database(), &id);
        let mut notified = std::pin::pin!(subscription.notify().notified());
        notified.as_mut().enable();
        // Taking over an expired lease changes the holder: waiters on the old token must look.
        let takeover = BeginRequest {
            token: FencingToken::random(),
            now: UnixMillis(2_000),
            lease_until: UnixMillis(3_000),
            ..request
        };
        assert!(matches!(
            holder.begin(takeover).await.unwrap(),
            Begin::Acquired { recovered: true }
        ));
        tokio::time::timeout(Duration::from_secs(1), notified)
            .await
            .expect("the takeover woke the subscriber, no polling involved");

        let mut notified = std::pin::pin!(subscription.notify().notified());
        notified.as_mut().enable();
        let completion = Completion {
            response: Bytes::from_static(b"answer"),
            status: 200,
            completed_at: UnixMillis(2_500),
            expires_at: UnixMillis(10_000),
            purge_at: UnixMillis(20_000),
        };
        holder.complete(&id, takeover.token, completion).await.unwrap();
        tokio::time::timeout(Duration::from_secs(1), notified)
            .await
            .expect("complete woke the subscriber, no polling involved");
    }

    #[tokio::test]
    async fn a_corrupt_record_is_deleted_all_the_same() {
        let store = SqliteStore::open(":memory:").await.unwrap();
        let id = shared_id("corrupt");
        store
            .conns
            .writer()
            .execute(
                "INSERT INTO idem_records (scope, key, state, fingerprint, digest, created_at, purge_at)
                 VALUES (?1, ?2, 'completed', x'00', x'00', 0, 9999999999999)",
                params![id.scope.as_str(), id.key.as_str()],
            )
            .unwrap();
        assert!(matches!(store.get(&id).await, Err(StoreError::Corrupt(_))));
        let deleted = store.delete(&id).await;
        assert!(matches!(deleted, Err(StoreError::Corrupt(_))), "{deleted:?}");
        assert!(
            store.get(&id).await.unwrap().is_none(),
            "an operator can clear a record the store cannot read"
        );
    }

    #[tokio::test]
    async fn a_scope_salt_of_the_wrong_length_is_corrupt() {
        let store = SqliteStore::open(":memory:").await.unwrap();
        store
            .conns
            .writer()
            .execute(
                "INSERT INTO idem_scope_salt (id, salt, created_at) VALUES (1, zeroblob(16), 0)",
                [],
            )
            .unwrap();
        let salt = store.scope_salt(ScopeSalt::random(UnixMillis(1_000))).await;
        assert!(matches!(salt, Err(StoreError::Corrupt(_))), "{salt:?}");
    }

    #[tokio::test]
    async fn waiters_leave_no_registry_entries() {
        let store = SqliteStore::open(":memory:").await.unwrap();
        let id = shared_id("registry");
        let deadline = Instant::now() + Duration::from_millis(20);
        let (a, b) = tokio::join!(
            store.wait(&id, FencingToken::random(), deadline),
            store.wait(&id, FencingToken::random(), deadline)
        );
        assert_eq!((a.unwrap(), b.unwrap()), (WaitOutcome::Changed, WaitOutcome::Changed));
        let key = (Arc::clone(store.conns.database()), id);
        assert!(!waiters::is_registered(&key));
    }
}
