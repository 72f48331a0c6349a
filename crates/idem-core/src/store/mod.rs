//! The `Store` trait: the atomic primitives every backend provides. Stores decide nothing about the
//! protocol; they claim, complete, release, renew and delete records atomically and report what they hold.

pub mod backend;
pub mod clock;
pub mod invalidations;
mod listing;
mod observed;
pub(crate) mod replay_counts;

pub use clock::{RESYNC_EVERY, StoreClock};
pub use invalidations::{Invalidations, PUSHED_DELIVERY, RecordDigest};
pub use listing::{ListQuery, Listed, ListedState, Newest, path_is_under, path_reading};
pub use observed::{Observed, Observer, StoreOperation};

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use tokio::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use rand::RngCore;

use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::scope::{Scope, hex};
use crate::time::UnixMillis;
use crate::trace_context::RunTrace;

/// What a record is identified by: never the key alone.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RecordId {
    /// Who the caller is.
    pub scope: Scope,
    /// The caller's idempotency key.
    pub key: IdempotencyKey,
}

impl RecordId {
    /// The record of `key` in `scope`.
    pub fn new(scope: Scope, key: IdempotencyKey) -> Self {
        Self { scope, key }
    }

    /// The first 16 bytes of a SHA-256 of the scope (length-prefixed) and the key: short, stable
    /// across instances and versions, unambiguous, and it reveals neither.
    pub fn digest(&self) -> RecordDigest {
        use sha2::{Digest, Sha256};
        let (scope, key) = (self.scope.as_str(), self.key.as_str());
        let mut hasher = Sha256::new();
        hasher.update((scope.len() as u64).to_be_bytes());
        hasher.update(scope.as_bytes());
        hasher.update(key.as_bytes());
        let mut digest = [0; 16];
        digest.copy_from_slice(&hasher.finalize()[..16]);
        digest
    }
}

/// The random token of one claim on a record. Only the current token can complete, release or
/// renew the record (compare-and-set), so a holder that lost its lease cannot overwrite the new
/// holder's result.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FencingToken([u8; 16]);

/// The first bytes of the token of a claim whose run keeps every effect in its own transaction
/// and completes the record there ([`FencingToken::in_transaction`]).
const IN_TRANSACTION: [u8; 4] = *b"idTx";
/// What [`IN_TRANSACTION`] becomes in the token of such a claim that is itself a recovered run
/// ([`FencingToken::for_run`]).
const IN_TRANSACTION_RECOVERED: [u8; 4] = *b"idTr";

impl FencingToken {
    /// A new random token, from the thread's cryptographically secure generator (seeded from the
    /// system once, not a system call per token). Never one of an [in-transaction
    /// claim](Self::in_transaction).
    pub fn random() -> Self {
        let mut bytes = [0; 16];
        loop {
            rand::rng().fill_bytes(&mut bytes);
            if bytes[..4] != IN_TRANSACTION {
                return Self(bytes);
            }
        }
    }

    /// A new random token for a claim whose run keeps its every effect in the transaction that
    /// completes the record (a route with [`Policy::in_transaction`](crate::Policy)): its first
    /// four bytes say so, the other twelve are random. The claim carries its kind in its token,
    /// so that the run that takes it over after its holder died can tell that nothing of it
    /// stands unless it completed ([`crate::store::backend::ran_in_transaction`]).
    pub fn random_in_transaction() -> Self {
        let mut bytes = [0; 16];
        rand::rng().fill_bytes(&mut bytes[4..]);
        bytes[..4].copy_from_slice(&IN_TRANSACTION);
        Self(bytes)
    }

    /// True for the token of an in-transaction claim that is not a recovered run: if such a claim
    /// ends without completing, its run had no effect.
    pub fn in_transaction(&self) -> bool {
        self.0[..4] == IN_TRANSACTION
    }

    /// The token a claim made with this one holds: itself, unless the claim is a recovered run,
    /// whose token can no longer say "nothing of this run stands" (an effect of the run before it
    /// may), so an in-transaction token loses its mark. The store and the protocol both derive
    /// it, from the request's token and whether the claim is recovered.
    pub fn for_run(self, recovered: bool) -> Self {
        if recovered && self.in_transaction() {
            let mut bytes = self.0;
            bytes[..4].copy_from_slice(&IN_TRANSACTION_RECOVERED);
            Self(bytes)
        } else {
            self
        }
    }

    /// Rebuilds a token from its stored bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The token's bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FencingToken({})", hex(&self.0[..6]))
    }
}

/// A request to claim a record.
#[derive(Debug, Clone, Copy)]
pub struct BeginRequest<'a> {
    /// The record.
    pub id: &'a RecordId,
    /// The fingerprint of the request that claims it.
    pub fingerprint: &'a Fingerprint,
    /// The current time.
    pub now: UnixMillis,
    /// When the claim's lease ends unless renewed.
    pub lease_until: UnixMillis,
    /// Until when the key may be run again (taken over, marked recovered) if this claim ends
    /// without an answer: the route's `ttl` from the claim. Past it such a key is expired.
    pub expires_at: UnixMillis,
    /// When the record is deleted if this claim ends without an answer (its lease ended too): the
    /// longer of the route's `ttl` and `tombstone-ttl` from the claim.
    pub purge_at: UnixMillis,
    /// A fresh token for the claim.
    pub token: FencingToken,
    /// What the record keeps about the request: written by a new claim, its trace id by a
    /// takeover too (the run that answers is the one to find).
    pub origin: &'a Origin,
    /// The store's identity as the caller knows it (from [`Store::scope_salt`]), under whose salt
    /// the record's scope was hashed. The store checks it in the same atomic step as the claim
    /// and refuses with [`StoreError::IdentityChanged`], changing nothing, if it holds another
    /// identity or none (its data was lost: flushed, restarted empty, failed over to an empty
    /// node, migrated anew). A store may answer a replay it reads without writing anything (a
    /// read before the claim) without the check: the record it returns is its own. `None` skips
    /// the check: for tools and tests of the primitives; the protocol always sets it.
    pub identity: Option<StoreIdentity>,
}

/// The most bytes of a request's path a record keeps; a longer path is cut at a character
/// boundary and ends with `…`.
pub const MAX_ORIGIN_PATH: usize = 1024;

/// What a record keeps about the request that made it, for the operator who reads the store
/// (`idem list`, `idem inspect`): no decision of the protocol depends on it. Empty in a record
/// written before records kept it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Origin {
    /// The request's method, as sent.
    pub method: String,
    /// The request's path as servers may read it ([`path_reading`]: escapes decoded, dot
    /// segments resolved; no query, which may carry secrets), at most [`MAX_ORIGIN_PATH`] bytes.
    /// The spelling as sent is in the record's fingerprint.
    pub path: String,
    /// Where the run that holds or answered the record sits in its trace ([`RunTrace`]): known
    /// if its request carried a `traceparent`, or idem exported a span for it.
    pub trace: Option<RunTrace>,
}

impl Origin {
    /// The origin of a request with this method, path (as sent: it is read with
    /// [`path_reading`] and cut to [`MAX_ORIGIN_PATH`] bytes) and run trace.
    pub fn new(method: &str, path: &str, trace: Option<RunTrace>) -> Self {
        let path = path_reading(path);
        let path = if path.len() <= MAX_ORIGIN_PATH {
            path
        } else {
            let mut end = MAX_ORIGIN_PATH - '…'.len_utf8();
            while !path.is_char_boundary(end) {
                end -= 1;
            }
            format!("{}…", &path[..end])
        };
        Self {
            method: method.to_owned(),
            path,
            trace,
        }
    }
}

/// The result of [`Store::begin`].
// Not boxed: a begin happens once per request, and the existing record carries heap data anyway.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Begin {
    /// The caller now holds the record and must run the request.
    Acquired {
        /// True if the record was taken over from a holder whose lease expired, or was released
        /// with an unknown outcome: the request may have had effects already.
        recovered: bool,
    },
    /// Someone else holds or held the record; this is what the store holds.
    Existing(Record),
}

/// One record, as the store holds it.
#[derive(Debug, Clone)]
pub struct Record {
    /// The record's identity.
    pub id: RecordId,
    /// The fingerprint of the request that created it.
    pub fingerprint: Fingerprint,
    /// When it was first claimed.
    pub created_at: UnixMillis,
    /// How many times its stored answer was replayed.
    pub replays: u64,
    /// Where it is in its life.
    pub state: RecordState,
    /// The request that made it, and the trace of its latest run.
    pub origin: Origin,
    /// Whether its latest run was a recovered one (it took the key over from a run whose outcome
    /// is unknown, and carried `Idempotency-Recovered: true`).
    pub recovered: bool,
    /// The status of the stored answer, once completed (`None` in a record completed before
    /// records kept it, or in a record not completed).
    pub status: Option<u16>,
}

/// The state machine of a record.
#[derive(Debug, Clone)]
pub enum RecordState {
    /// A handler is running under a lease.
    InFlight {
        /// The current claim.
        token: FencingToken,
        /// When the lease ends unless renewed.
        lease_until: UnixMillis,
        /// Until when the claim may be taken over once its lease ended; past it the key is
        /// expired. `None` for a claim made before records kept it: taken over until `purge_at`.
        expires_at: Option<UnixMillis>,
    },
    /// The handler finished and its answer was stored.
    Completed {
        /// The encoded [`crate::StoredResponse`]; `None` once purged to a tombstone.
        response: Option<Bytes>,
        /// When the handler finished.
        completed_at: UnixMillis,
        /// Until when the answer is replayable.
        expires_at: UnixMillis,
        /// When the record (or its tombstone) is deleted.
        purge_at: UnixMillis,
    },
    /// Released after the request was sent but no answer came back (or deleted by an operator
    /// while in flight): whether it had effects is unknown. Until `expires_at` the next claim with
    /// the same fingerprint takes it over, marked recovered; from then until `purge_at` it is a
    /// tombstone, as a completed record is.
    Unknown {
        /// Until when the same request may run again, marked recovered (the route's `ttl` from
        /// the release).
        expires_at: UnixMillis,
        /// When the record is deleted.
        purge_at: UnixMillis,
    },
}

/// What [`Store::complete`] stores.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The encoded [`crate::StoredResponse`].
    pub response: Bytes,
    /// The answer's status, kept beside it in plain (the answer itself may be sealed).
    pub status: u16,
    /// When the handler finished.
    pub completed_at: UnixMillis,
    /// Until when the answer is replayable.
    pub expires_at: UnixMillis,
    /// When the record (or its tombstone) is deleted.
    pub purge_at: UnixMillis,
}

/// A step a handler recorded under its claim (`charge_created` with the provider's charge id), so
/// that a run taking the record over can resume after it instead of repeating it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The step's name.
    pub name: String,
    /// What the step produced, serialised by the handler.
    pub value: Bytes,
}

/// What makes a store the same store: 16 random bytes made with its [`ScopeSalt`] and written
/// beside it. A store that lost its data (and so its salt) makes a new salt with a new identity,
/// so an instance that knew the old one finds out at its next claim ([`BeginRequest::identity`]),
/// or within [`IDENTITY_CHECK`](crate::replay_cache::IDENTITY_CHECK) if it only answers from
/// its replay cache, and reads the salt again before it answers.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoreIdentity([u8; 16]);

impl StoreIdentity {
    /// A new random identity, from a cryptographically secure generator.
    pub fn random() -> Self {
        let mut bytes = [0; 16];
        rand::rng().fill_bytes(&mut bytes);
        Self(bytes)
    }

    /// Rebuilds an identity from its stored bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The identity's bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Its 32 lowercase hex digits (how the Redis store keeps it).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for StoreIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoreIdentity({})", hex(&self.0[..4]))
    }
}

/// The store-wide secret that keys the hash of credential scopes (see [`Store::scope_salt`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ScopeSalt {
    /// 32 random bytes, made once per store.
    pub salt: [u8; 32],
    /// The store's identity, made with the salt (or, for a salt made before salts had one, by
    /// the first [`Store::scope_salt`] after the upgrade) and never changed after.
    pub identity: StoreIdentity,
    /// When the store made it.
    pub created_at: UnixMillis,
    /// The latest `purge_at` among the records the store held when it made the salt: records
    /// written before there was a salt (their credential scopes hashed without it) may live until
    /// then. `None` if the store held none.
    pub older_records_until: Option<UnixMillis>,
}

impl ScopeSalt {
    /// A new random salt made at `now`, as a candidate for [`Store::scope_salt`].
    pub fn random(now: UnixMillis) -> Self {
        let mut salt = [0; 32];
        rand::rng().fill_bytes(&mut salt);
        Self {
            salt,
            identity: StoreIdentity::random(),
            created_at: now,
            older_records_until: None,
        }
    }
}

impl fmt::Debug for ScopeSalt {
    /// Never prints the salt itself.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScopeSalt")
            .field("identity", &self.identity)
            .field("created_at", &self.created_at)
            .field("older_records_until", &self.older_records_until)
            .finish_non_exhaustive()
    }
}

/// How [`Store::release`] leaves a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Nothing happened (or nothing worth keeping): the record is deleted and the key may run again.
    Forget,
    /// The request may have had effects: keep the record as [`RecordState::Unknown`], so that
    /// the next run before `expires_at` is marked recovered and one after it is told the key
    /// expired, until `purge_at`.
    Unknown {
        /// Until when the same request may run again, marked recovered.
        expires_at: UnixMillis,
        /// When the record is deleted.
        purge_at: UnixMillis,
    },
}

/// Where one claim on a record stands ([`Store::claim_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimState {
    /// The claim is current: the record is in flight under it.
    Current,
    /// The record was completed under this claim (by the run's own transaction, or by a
    /// [`Store::complete`] whose reply was lost).
    Completed,
    /// The claim ended otherwise: released, taken over, deleted, or the record is gone.
    Ended,
}

/// How [`Store::wait`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOutcome {
    /// The claim with the given token is no longer current (completed, released or taken over).
    Changed,
    /// The deadline passed first.
    TimedOut,
}

/// What one [`Store::purge`] batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    /// Records deleted, tombstones included.
    pub deleted: u64,
    /// Completed records whose answer was dropped, leaving a tombstone.
    pub tombstoned: u64,
}

impl Purged {
    /// The number of records touched.
    pub fn total(&self) -> u64 {
        self.deleted + self.tombstoned
    }
}

/// A store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached or failed to answer.
    #[error("the store is unavailable: {0}")]
    Unavailable(#[source] Box<dyn StdError + Send + Sync>),
    /// The token is not the record's current claim (the lease was lost or the record is gone).
    #[error("the claim on this record was lost (fencing token is no longer current)")]
    Fenced,
    /// The store holds data it cannot read.
    #[error("the store holds a corrupt record: {0}")]
    Corrupt(String),
    /// The claim was refused, nothing changed: the store is not the one the caller knew (its
    /// identity is another, or it has none: its data was lost). The caller reads the salt again
    /// ([`Store::scope_salt`]) before it claims anything more.
    #[error(
        "the store is not the one this instance knew (its data was lost, flushed or replaced): its salt is read again"
    )]
    IdentityChanged,
    /// Nothing was changed, and nothing waited: the record is locked by a transaction still open
    /// (a handler completing the record in its own transaction, which a lock held shows alive).
    /// Only a store whose records a caller's transaction can lock says so: PostgreSQL, for what
    /// must not wait on a run (a renewal, a release, an operator's delete), and SQLite, whose one
    /// lock is the whole file's, for any operation past a short busy wait. Where the claim stands
    /// is read once the transaction has ended ([`Store::claim_state`]).
    #[error(
        "the record is locked by a transaction still open (a run completing in its own transaction, or another writer of the store); nothing was changed"
    )]
    Locked,
}

impl StoreError {
    /// Wraps a driver error as [`StoreError::Unavailable`].
    pub fn unavailable(err: impl StdError + Send + Sync + 'static) -> Self {
        Self::Unavailable(Box::new(err))
    }
}

/// A backend that holds idempotency records, shared by every instance of a service.
///
/// Every operation is one atomic step in the store. There is deliberately no default method:
/// a "read, then write" default would hide exactly the race the store exists to prevent.
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug + 'static {
    /// Claims the record with `request.token`, atomically, if nobody holds it:
    /// * no record, or one past its `purge_at` (an in-flight one only once its lease ended too): a
    ///   new claim (`recovered: false`);
    /// * an in-flight record whose lease ended before `now`, or an unknown-outcome record, with the
    ///   same fingerprint digest, before its `expires_at` (always, for a record that has none):
    ///   taken over, with the request's `expires_at` and `purge_at`: `recovered: true`, unless
    ///   nothing of the claim before can stand (an in-transaction claim without checkpoints:
    ///   [`backend::ran_in_transaction`]). The claim holds the request's token
    ///   [`for_run`](FencingToken::for_run)`(recovered)`;
    /// * otherwise nothing changes and the record is returned. If it is completed, not expired and
    ///   has the same fingerprint digest, the replay is counted, and the record returned with it.
    ///   A store may write counts a moment later, in batches, so that a replay is a read: its own
    ///   reads then show them at once, other instances' a moment later.
    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin, StoreError>;

    /// Stores the answer if `token` is still the current claim; [`StoreError::Fenced`] otherwise.
    async fn complete(&self, id: &RecordId, token: FencingToken, completion: Completion) -> Result<(), StoreError>;

    /// Where the claim `token` on the record stands. A completed record remembers the claim that
    /// completed it (until it is purged), so that a run whose answer was stored by its own
    /// transaction, or whose `complete` lost its reply, can tell it was stored.
    async fn claim_state(&self, id: &RecordId, token: FencingToken) -> Result<ClaimState, StoreError>;

    /// True if the store can complete a record inside the caller's own database transaction
    /// (PostgreSQL and SQLite): only then does a route with
    /// [`Policy::in_transaction`](crate::Policy) make in-transaction claims.
    fn completes_in_transactions(&self) -> bool;

    /// Gives the record up if `token` is still the current claim; [`StoreError::Fenced`] otherwise.
    async fn release(&self, id: &RecordId, token: FencingToken, release: Release) -> Result<(), StoreError>;

    /// Extends the lease if `token` is still the current claim; [`StoreError::Fenced`] otherwise.
    async fn renew(&self, id: &RecordId, token: FencingToken, lease_until: UnixMillis) -> Result<(), StoreError>;

    /// Reads a record without changing it.
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError>;

    /// Records `checkpoint` in the record if `token` is its current claim (in flight under that
    /// token), replacing an earlier checkpoint of the same name; [`StoreError::Fenced`] otherwise,
    /// so a holder that lost its claim cannot write one.
    ///
    /// Checkpoints outlive their run when the record is taken over or released as unknown (the
    /// next run resumes from them), and go with the run's end otherwise: when the record completes,
    /// is forgotten or deleted, or passes its `purge_at`. A new claim never sees an earlier
    /// record's checkpoints.
    async fn checkpoint(&self, id: &RecordId, token: FencingToken, checkpoint: Checkpoint) -> Result<(), StoreError>;

    /// The checkpoints of the record (in flight or unknown), in the order they were first written;
    /// none for a record without any, or no record.
    async fn checkpoints(&self, id: &RecordId) -> Result<Vec<Checkpoint>, StoreError>;

    /// The store's [`ScopeSalt`], made from `candidate` if the store has none yet: atomically, so
    /// that instances asking at once all get the same one, and for good (it never changes, and
    /// retention never removes it). When it is made, the store fills in
    /// [`ScopeSalt::older_records_until`] from the records it holds; `candidate`'s is ignored.
    ///
    /// Asked once per instance, and again when a claim finds another identity
    /// ([`StoreError::IdentityChanged`]): never per request. A salt made before salts had an
    /// [identity](ScopeSalt::identity) is given `candidate`'s, atomically, by the first call
    /// after the upgrade.
    async fn scope_salt(&self, candidate: ScopeSalt) -> Result<ScopeSalt, StoreError>;

    /// The store's identity as it stands, without making a salt: `None` if the store has no salt
    /// (new, or its data was lost). Read every
    /// [`IDENTITY_CHECK`](crate::replay_cache::IDENTITY_CHECK) by each replay cache, which empties
    /// itself when it changes.
    async fn identity(&self) -> Result<Option<StoreIdentity>, StoreError>;

    /// An operator's tool: forgets the record, atomically, and returns it as it was (as
    /// [`Store::get`] would have read it the moment before); `None` if there was none. What it
    /// does depends on the record's state:
    /// * completed (answer or tombstone) or unknown: deleted, and the key is free for a new claim;
    /// * in flight: the key is *not* freed, since the run may have had effects. The holder is
    ///   fenced (its renew, complete, checkpoint and release fail with [`StoreError::Fenced`]),
    ///   the record becomes [`RecordState::Unknown`] with the claim's `expires_at` and `purge_at`
    ///   (a claim made before records kept an `expires_at` gets its `purge_at` for both:
    ///   [`ABANDONED_CLAIM_RETENTION`] after its lease), its checkpoints are dropped, and its
    ///   waiters are woken: the same request then runs again marked recovered (or is told the key
    ///   expired, past `expires_at`). Deleting it once more frees the key.
    ///
    /// A record the store cannot read is deleted all the same (an operator must be able to clear
    /// it) and reported as [`StoreError::Corrupt`].
    ///
    /// [`ABANDONED_CLAIM_RETENTION`]: crate::store::backend::ABANDONED_CLAIM_RETENTION
    async fn delete(&self, id: &RecordId) -> Result<Option<Record>, StoreError>;

    /// Waits until the claim `token` on the record is no longer current, or until `deadline`.
    /// Subscribes to changes before it checks, so that a change in between is not lost.
    async fn wait(&self, id: &RecordId, token: FencingToken, deadline: Instant) -> Result<WaitOutcome, StoreError>;

    /// One batch of retention work: deletes up to `batch` records past their `purge_at` and drops
    /// the answers of up to `batch` completed records past their `expires_at`. Safe to run from
    /// many instances at once.
    async fn purge(&self, now: UnixMillis, batch: usize) -> Result<Purged, StoreError>;

    /// Checks that the store answers (for readiness probes).
    async fn ping(&self) -> Result<(), StoreError>;

    /// The store's own time: leases, expiry and tombstones are judged on it, so instances whose
    /// clocks are skewed still agree ([`StoreClock`] follows it). The server's
    /// clock for PostgreSQL and Redis; the machine's for SQLite, whose file is local.
    async fn clock(&self) -> Result<UnixMillis, StoreError>;

    /// Whether [`Store::clock`] is this machine's own clock (SQLite, whose file is local). Then
    /// [`StoreClock`] reads that clock at every use rather than carry a measurement of it forward,
    /// so that every process sharing the store sees a step of it at the same moment.
    fn clock_is_local(&self) -> bool {
        false
    }

    /// The longest the caller waits for any one operation (the policy's `store_timeout`, given by
    /// every [`Protocol`](crate::protocol::Protocol) made over the store): a store that can bound
    /// its own waits where they happen (on the server: PostgreSQL's `statement_timeout` and
    /// `lock_timeout`; SQLite's busy wait) bounds them by the longest it was given, so that no
    /// operation outlives its caller. A store whose operations cannot wait on others' (Redis)
    /// ignores it.
    fn bound_operations(&self, limit: std::time::Duration) {
        let _ = limit;
    }

    /// How this store tells this instance's [replay caches](crate::replay_cache) that a record
    /// was deleted, by any instance or by an operator: every [`Store::delete`] announces it on
    /// the store's notification channel, and the store reports the channel's losses. `None` for a
    /// store that cannot announce deletes: no replay cache is kept in front of it.
    fn invalidations(&self) -> Option<Arc<Invalidations>>;

    /// Counts a replay of `id` answered from a replay cache, as [`Store::begin`] counts one it
    /// answers (possibly in a later batch).
    fn count_replay(&self, id: &RecordId);

    /// The records that `query` asks for, newest first (by `created_at`, then scope and key), at
    /// most `query.limit`, without their answers: an operator's question, never the protocol's.
    /// A store uses its indexes where it has them; one without (Redis) scans its keys in bounded
    /// batches, node by node, holding no more than `query.limit` records at a time.
    async fn list(&self, query: &ListQuery) -> Result<Vec<Listed>, StoreError>;
}

#[async_trait]
impl<S: Store + ?Sized> Store for Arc<S> {
    async fn begin(&self, request: BeginRequest<'_>) -> Result<Begin, StoreError> {
        (**self).begin(request).await
    }
    async fn complete(&self, id: &RecordId, token: FencingToken, completion: Completion) -> Result<(), StoreError> {
        (**self).complete(id, token, completion).await
    }
    async fn claim_state(&self, id: &RecordId, token: FencingToken) -> Result<ClaimState, StoreError> {
        (**self).claim_state(id, token).await
    }
    fn completes_in_transactions(&self) -> bool {
        (**self).completes_in_transactions()
    }
    async fn release(&self, id: &RecordId, token: FencingToken, release: Release) -> Result<(), StoreError> {
        (**self).release(id, token, release).await
    }
    async fn renew(&self, id: &RecordId, token: FencingToken, lease_until: UnixMillis) -> Result<(), StoreError> {
        (**self).renew(id, token, lease_until).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        (**self).get(id).await
    }
    async fn checkpoint(&self, id: &RecordId, token: FencingToken, checkpoint: Checkpoint) -> Result<(), StoreError> {
        (**self).checkpoint(id, token, checkpoint).await
    }
    async fn checkpoints(&self, id: &RecordId) -> Result<Vec<Checkpoint>, StoreError> {
        (**self).checkpoints(id).await
    }
    async fn scope_salt(&self, candidate: ScopeSalt) -> Result<ScopeSalt, StoreError> {
        (**self).scope_salt(candidate).await
    }
    async fn identity(&self) -> Result<Option<StoreIdentity>, StoreError> {
        (**self).identity().await
    }
    async fn delete(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        (**self).delete(id).await
    }
    async fn wait(&self, id: &RecordId, token: FencingToken, deadline: Instant) -> Result<WaitOutcome, StoreError> {
        (**self).wait(id, token, deadline).await
    }
    async fn purge(&self, now: UnixMillis, batch: usize) -> Result<Purged, StoreError> {
        (**self).purge(now, batch).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        (**self).ping().await
    }
    async fn clock(&self) -> Result<UnixMillis, StoreError> {
        (**self).clock().await
    }
    fn clock_is_local(&self) -> bool {
        (**self).clock_is_local()
    }
    fn bound_operations(&self, limit: std::time::Duration) {
        (**self).bound_operations(limit);
    }
    fn invalidations(&self) -> Option<Arc<Invalidations>> {
        (**self).invalidations()
    }
    fn count_replay(&self, id: &RecordId) {
        (**self).count_replay(id);
    }
    async fn list(&self, query: &ListQuery) -> Result<Vec<Listed>, StoreError> {
        (**self).list(query).await
    }
}
