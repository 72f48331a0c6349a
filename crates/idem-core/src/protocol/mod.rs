//! The protocol, decided in one place: which requests are keyed, and for a keyed request whether
//! to run it, replay it, wait for it or refuse it; then what becomes of its record.
//!
//! Data flows one way, one phase per module:
//!
//! | phase | module | decides |
//! |---|---|---|
//! | admission | `admission.rs` | [`Protocol::admit_path`]: a path that climbs out of the service's prefix? then [`Protocol::admit`]: protected method? key valid? scope? keyless policy? |
//! | begin | `begin.rs` | [`Protocol::begin`]: the atomic claim, waiting for a copy in flight, the store failing |
//! | judgement | `judge.rs` | `judge`: a pure function of (record, fingerprint, now) — replay, mismatch, expired, wait |
//! | the run | `lease.rs` | [`Protocol::drive`]: the lease renewed beside the work, the run timeout, the answer stored or held |
//! | settle | `settle.rs` | [`Protocol::settle`]: how the run ended decides the record and the client's answer |
//! | in transaction | `in_transaction.rs` | [`InTransaction`]: the answer completed in the handler's own transaction, then [`Protocol::confirm`]ed |
//! | bounded store calls | `bounded.rs` | every store operation limited by `store_timeout` (a leaf: imports nothing back) |
//!
//! Every row of the outcome table is mapped to the function that decides it in `docs/design.md`.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::Response;

use crate::key::IdempotencyKey;
use crate::policy::Policy;
use crate::replay_cache::{ReplayCache, ReplayCacheConfig};
use crate::scope::Scope;
use crate::seal::Keyring;
use crate::store::clock::StoreClock;
use crate::store::{FencingToken, Purged, RecordId, Store, StoreError};
use crate::time::{Clock, UnixMillis};
use crate::trace_context::RunTrace;

mod admission;
mod begin;
mod bounded;
mod in_transaction;
mod judge;
mod lease;
mod settle;

pub use admission::{Admission, Keyed};
pub(crate) use bounded::StoreTimedOut;
pub use in_transaction::{CompleteInError, CompletedInTransaction, InTransaction};
pub use lease::{MAX_PENDING_BYTES, PendingAnswer, RunTimedOut, Unstored};
pub use settle::{Keep, NoAnswer, Reply, RunEnd, Settlement, body_incomplete, internal_error, no_answer_problem};

pub use crate::content_coding::AcceptEncoding;
pub use crate::credential::{CredentialScopes, ScopeHashing};
pub use crate::scope::Caller;
use lease::Pending;

/// What happened to a keyed request, as logged and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A new key: the handler ran.
    New,
    /// The stored answer was replayed.
    Replayed,
    /// The request waited for a copy in flight, then got its answer.
    Waited,
    /// The key was used for a different request.
    Mismatch,
    /// A copy was still in flight after the wait.
    InFlight,
    /// The key has expired.
    Expired,
    /// The key was taken over from a crashed holder, or after an unknown outcome; the handler ran.
    Recovered,
    /// The store failed.
    StoreError,
    /// The key header was invalid.
    Invalid,
    /// A required key was missing.
    Missing,
    /// The body was over the limit.
    TooLarge,
    /// The body broke off before it was complete.
    BodyIncomplete,
    /// The caller's scope could not be told (a repeated scope header).
    ScopeInvalid,
    /// A caller without an identity, under `--anonymous reject`.
    CredentialMissing,
    /// The request's path reads as two paths under different protecting rules, or climbs out of
    /// the service's path prefix.
    PathAmbiguous,
    /// A bug: something in the request's path panicked.
    Internal,
    /// The run passed the run timeout and was given up.
    RunTimedOut,
    /// The stored answer could not be read (sealed under a key not configured, or damaged), or the
    /// store holds data about the key that it cannot read (a corrupt record).
    Unreadable,
}

impl Outcome {
    /// Every outcome, in declaration order: the values of the `outcome` label, for the rules and
    /// dashboards that match on them.
    pub const ALL: [Self; 18] = [
        Self::New,
        Self::Replayed,
        Self::Waited,
        Self::Mismatch,
        Self::InFlight,
        Self::Expired,
        Self::Recovered,
        Self::StoreError,
        Self::Invalid,
        Self::Missing,
        Self::TooLarge,
        Self::BodyIncomplete,
        Self::ScopeInvalid,
        Self::CredentialMissing,
        Self::PathAmbiguous,
        Self::Internal,
        Self::RunTimedOut,
        Self::Unreadable,
    ];

    /// The name used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::Replayed => "replayed",
            Self::Waited => "waited",
            Self::Mismatch => "mismatch",
            Self::InFlight => "in-flight",
            Self::Expired => "expired",
            Self::Recovered => "recovered",
            Self::StoreError => "store-error",
            Self::Invalid => "invalid",
            Self::Missing => "missing",
            Self::TooLarge => "too-large",
            Self::BodyIncomplete => "body-incomplete",
            Self::ScopeInvalid => "scope-invalid",
            Self::CredentialMissing => "credential-missing",
            Self::PathAmbiguous => "path-ambiguous",
            Self::Internal => "internal-error",
            Self::RunTimedOut => "run-timeout",
            Self::Unreadable => "answer-unreadable",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to do with a keyed request.
#[derive(Debug)]
pub enum Decision {
    /// Run the handler under this claim, then [`Protocol::settle`] how it ended.
    Run(Claim),
    /// Answer with this (a replay or a problem); the handler does not run.
    Respond {
        /// The answer.
        response: Response<Bytes>,
        /// What happened.
        outcome: Outcome,
        /// The record, for logs.
        id: RecordId,
        /// The trace of the run that made the record the answer was decided on (none for an
        /// answer that needed no record): a replay's span links to it.
        answered_by: Option<RunTrace>,
    },
    /// The store is down and the policy is fail-open: run the handler without protection.
    PassThrough {
        /// The record that could not be claimed, for logs.
        id: RecordId,
    },
}

/// A claim on a record: the right, and the duty, to run the request and settle the record.
#[derive(Debug, Clone)]
pub struct Claim {
    id: RecordId,
    token: FencingToken,
    recovered: bool,
    provisional: Option<Duration>,
    /// When the run is given up (`run_timeout` after the claim).
    run_deadline: tokio::time::Instant,
    /// Set once the run recorded a checkpoint: it has had an effect, so a release keeps the
    /// record (and its checkpoints) for the retry to resume from. Shared by the claim's clones.
    stepped: Arc<AtomicBool>,
}

/// What the layer tells the handler about the keyed request it runs, in the request extensions
/// (the gateway passes `recovered` on as [`IDEMPOTENCY_RECOVERED`](crate::IDEMPOTENCY_RECOVERED)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyInfo {
    /// The caller's scope.
    pub scope: Scope,
    /// The key (for a keyless request under `fingerprint:<window>`, the derived provisional key).
    pub key: IdempotencyKey,
    /// True if an earlier run of this key may have had effects (its holder crashed, or its outcome
    /// is unknown): check before acting again.
    pub recovered: bool,
}

impl Claim {
    /// The record.
    pub fn id(&self) -> &RecordId {
        &self.id
    }

    /// The claim's fencing token.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// True if an earlier run of this key may have had effects (a crashed holder, an unknown
    /// outcome): the handler should check before acting again.
    pub fn recovered(&self) -> bool {
        self.recovered
    }

    /// The window of a provisional key (`fingerprint:<window>`), `None` for a client's key.
    pub(crate) fn provisional(&self) -> Option<Duration> {
        self.provisional
    }

    /// When the run is given up.
    pub(crate) fn run_deadline(&self) -> tokio::time::Instant {
        self.run_deadline
    }

    /// True once this run recorded a checkpoint.
    pub(crate) fn stepped(&self) -> bool {
        self.stepped.load(Ordering::Acquire)
    }

    /// What the handler is told about its request.
    pub fn info(&self) -> IdempotencyInfo {
        IdempotencyInfo {
            scope: self.id.scope.clone(),
            key: self.id.key.clone(),
            recovered: self.recovered,
        }
    }

    /// How the request is logged once it runs.
    pub fn outcome(&self) -> Outcome {
        if self.recovered {
            Outcome::Recovered
        } else {
            Outcome::New
        }
    }
}

/// The protocol engine shared by the tower layer and the gateway.
#[derive(Clone)]
pub struct Protocol {
    inner: Arc<Inner>,
}

#[derive(Clone)]
pub(crate) struct Inner {
    store: Arc<dyn Store>,
    policy: Policy,
    clock: Arc<dyn Clock>,
    /// Seals stored answers, and opens sealed ones (`None`: answers are stored as they are, and
    /// a sealed one cannot be read).
    keyring: Option<Arc<Keyring>>,
    /// How credential scopes are hashed, loaded from the store at the first credential.
    credentials: Arc<ScopeHashing>,
    /// Answers held while the store refuses them.
    pub(crate) pending: Arc<Pending>,
    /// Completed answers kept in memory, shared by every protocol derived from this one (`None`:
    /// every replay reads the store).
    replay_cache: Option<Arc<ReplayCache>>,
    /// The path prefix the service is reached under (`/api`), without a trailing `/`; `None` at
    /// the root. Admission refuses a path that climbs out of it ([`Protocol::admit_path`]).
    path_prefix: Option<Arc<str>>,
}

impl fmt::Debug for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Protocol")
            .field("store", &self.inner.store)
            .field("policy", &self.inner.policy)
            .field("clock", &self.inner.clock)
            .field("path_prefix", &self.inner.path_prefix)
            .finish()
    }
}

impl Protocol {
    /// The protocol over `store` with `policy`, on the store's clock ([`StoreClock`]).
    pub fn new(store: Arc<dyn Store>, policy: Policy) -> Self {
        let clock = StoreClock::new(store.clone());
        Self::with_clock(store, policy, clock)
    }

    /// The protocol with an injected clock (tests of leases and retention). It keeps a replay
    /// cache of the default size ([`ReplayCacheConfig::DEFAULT`]) if the store can invalidate one.
    pub fn with_clock(store: Arc<dyn Store>, policy: Policy, clock: Arc<dyn Clock>) -> Self {
        store.bound_operations(policy.store_timeout);
        let replay_cache = ReplayCache::for_store(&store, ReplayCacheConfig::DEFAULT);
        Self {
            inner: Arc::new(Inner {
                store,
                policy,
                clock,
                keyring: None,
                credentials: Arc::default(),
                pending: Arc::default(),
                replay_cache,
                path_prefix: None,
            }),
        }
    }

    /// The same protocol, answering replays from `cache` (made with [`ReplayCache::for_store`]
    /// on this protocol's store, and shared by every protocol that should share its entries), or
    /// always from the store (`None`).
    pub fn with_replay_cache(&self, cache: Option<Arc<ReplayCache>>) -> Self {
        self.derived(|inner| inner.replay_cache = cache)
    }

    /// The replay cache in use, if any.
    pub fn replay_cache(&self) -> Option<&Arc<ReplayCache>> {
        self.inner.replay_cache.as_ref()
    }

    /// The same protocol (store, clock, keys, scope hashing and held answers) under another
    /// policy: a route's.
    pub fn with_policy(&self, policy: Policy) -> Self {
        self.inner.store.bound_operations(policy.store_timeout);
        self.derived(|inner| inner.policy = policy)
    }

    /// The same protocol, sealing the answers it stores with `keyring`'s first key and opening
    /// sealed ones with any of its keys.
    pub fn with_keyring(&self, keyring: Option<Arc<Keyring>>) -> Self {
        self.derived(|inner| inner.keyring = keyring)
    }

    /// The same protocol, hashing credential scopes as `hashing` does (its secrets, and the
    /// store's salt, read once for every protocol that shares it).
    pub fn with_scope_hashing(&self, hashing: Arc<ScopeHashing>) -> Self {
        self.derived(|inner| inner.credentials = hashing)
    }

    /// The same protocol for a service reached under the path `prefix` (`/api`: a gateway whose
    /// upstream is `http://host/api/`, an application mounted under `/api`): admission then
    /// refuses a path that climbs out of it ([`admit_path`](Self::admit_path)). A trailing `/` is
    /// not part of it; an empty prefix, or `/`, is the root, where nothing can be climbed out of.
    /// Every route's protocol derived from this one shares it: the prefix is where the whole
    /// service sits, not a route's setting.
    pub fn with_path_prefix(&self, prefix: &str) -> Self {
        let prefix = prefix.trim_end_matches('/');
        self.derived(|inner| inner.path_prefix = (!prefix.is_empty()).then(|| prefix.into()))
    }

    /// This protocol (its store, clock and held answers among the rest) with one thing changed.
    fn derived(&self, change: impl FnOnce(&mut Inner)) -> Self {
        let mut inner = (*self.inner).clone();
        change(&mut inner);
        Self { inner: Arc::new(inner) }
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.inner.policy
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    pub(crate) fn now(&self) -> UnixMillis {
        self.inner.clock.now()
    }

    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Runs retention work in batches of `batch` until nothing is left; returns the totals.
    pub async fn purge(&self, batch: usize) -> Result<Purged, StoreError> {
        let mut total = Purged::default();
        loop {
            let purged = self.inner.store.purge(self.now(), batch).await?;
            total.deleted += purged.deleted;
            total.tombstoned += purged.tombstoned;
            if purged.deleted < batch as u64 && purged.tombstoned < batch as u64 {
                return Ok(total);
            }
        }
    }
}

/// `after` from now on the runtime's clock: a deadline, never a panic. A sum past what the clock
/// holds (a policy beyond [`Policy::MAX_TIMEOUT`], which [`Policy::validate`] refuses but a layer
/// built without it may hold) is thirty years from now instead, as good as never.
pub(crate) fn deadline_after(after: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(after)
        .unwrap_or_else(|| now + Duration::from_secs(30 * 365 * 86_400))
}
