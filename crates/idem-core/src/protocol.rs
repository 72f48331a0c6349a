//! The protocol, decided in one place: which requests are keyed, and for a keyed request whether
//! to run it, replay it, wait for it or refuse it; then how its answer is kept.
//!
//! Data flows one way: [`Protocol::admit`] → (fingerprint) → [`Protocol::begin`] →
//! run the handler → [`Protocol::settle`] (the after-the-handler half, in `settle.rs`) →
//! [`Protocol::finish`] / [`Protocol::release`].

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Response};

use crate::coding::AcceptEncoding;
use crate::credential::{CredentialScopes, ScopeHashing};
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyError};
use crate::metric_names;
use crate::policy::{AnonymousPolicy, MissingKeyPolicy, Policy};
use crate::problem::{Problem, ProblemKind};
use crate::response::StoredResponse;
use crate::run::{Gauged, Pending, StoreTimedOut};
use crate::scope::{Caller, Scope, ScopeSource, hex};
use crate::seal::Keyring;
use crate::store::{
    Begin, BeginRequest, Checkpoint, FencingToken, Purged, Record, RecordId, RecordState, Release, Store, StoreError,
};
use crate::store_clock::StoreClock;
use crate::time::{Clock, UnixMillis};

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
    /// The request's path reads as two paths under different protecting rules.
    PathAmbiguous,
    /// A bug: something in the request's path panicked.
    Internal,
    /// The run passed the run timeout and was given up.
    RunTimedOut,
    /// The stored answer could not be read (sealed under a key not configured, or damaged).
    Unreadable,
}

impl Outcome {
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

/// How a request enters the protocol.
#[derive(Debug)]
pub enum Admission {
    /// Not subject to the protocol: pass it on, adding `headers` to the answer.
    PassThrough {
        /// Headers for the answer (`Deprecation`/`Sunset` in a grace period).
        headers: HeaderMap,
    },
    /// Keyed: buffer the body (up to `max_body`), fingerprint it and call [`Protocol::begin`].
    Keyed(Keyed),
    /// Refused before anything ran.
    Refuse(Problem, Outcome),
}

/// A request that the protocol applies to.
#[derive(Debug, Clone)]
pub struct Keyed {
    caller: Caller,
    key: KeySource,
    /// What this request's client accepts: a replay is decoded for it when needed.
    accept: AcceptEncoding,
}

#[derive(Debug, Clone)]
enum KeySource {
    Client(IdempotencyKey),
    /// A keyless request under `fingerprint:<window>`: the key is derived from the fingerprint.
    Provisional(Duration),
}

impl Keyed {
    /// The caller's scope, if known before [`Protocol::begin`]: a credential's is hashed there,
    /// with the store's salt.
    pub fn scope(&self) -> Option<&Scope> {
        self.caller.scope()
    }

    /// The client's key; `None` for a provisional key derived from the fingerprint.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        match &self.key {
            KeySource::Client(key) => Some(key),
            KeySource::Provisional(_) => None,
        }
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
}

impl fmt::Debug for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Protocol")
            .field("store", &self.inner.store)
            .field("policy", &self.inner.policy)
            .field("clock", &self.inner.clock)
            .finish()
    }
}

impl Protocol {
    /// The protocol over `store` with `policy`, on the store's clock ([`StoreClock`]).
    pub fn new(store: Arc<dyn Store>, policy: Policy) -> Self {
        let clock = StoreClock::new(store.clone());
        Self::with_clock(store, policy, clock)
    }

    /// The protocol with an injected clock (tests of leases and retention).
    pub fn with_clock(store: Arc<dyn Store>, policy: Policy, clock: Arc<dyn Clock>) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                policy,
                clock,
                keyring: None,
                credentials: Arc::default(),
                pending: Arc::default(),
            }),
        }
    }

    /// The same protocol (store, clock, keys, scope hashing and held answers) under another
    /// policy: a route's.
    pub fn with_policy(&self, policy: Policy) -> Self {
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

    /// Decides from the request head whether the protocol applies.
    pub fn admit(&self, parts: &Parts) -> Admission {
        let policy = &self.inner.policy;
        if !policy.applies_to(&parts.method) {
            return Admission::PassThrough {
                headers: HeaderMap::new(),
            };
        }
        let key = match IdempotencyKey::from_headers(parts.headers.get_all(&policy.key_header)) {
            Ok(Some(key)) => KeySource::Client(key),
            Ok(None) => match self.admit_keyless() {
                Ok(window) => KeySource::Provisional(window),
                Err(admission) => return admission,
            },
            Err(err) => return Admission::Refuse(self.invalid_key(&err), Outcome::Invalid),
        };
        // The scope is needed only once the request is keyed: a keyless request passes through
        // whatever its headers say.
        let caller = match policy.scope.caller_of(parts) {
            Ok(caller) => caller,
            Err(err) => {
                let detail = format!("{err}: the caller's scope is taken from it. The request was not processed.");
                return Admission::Refuse(Problem::new(ProblemKind::ScopeInvalid, detail), Outcome::ScopeInvalid);
            }
        };
        if matches!(key, KeySource::Provisional(_)) && caller.is_anonymous() {
            // A provisional key is (scope, fingerprint): in the anonymous scope it would hand one
            // person's answer to another who happens to post the same body. Passed through as
            // under `allow`, the request is at worst run twice, as it would be without idem.
            tracing::debug!(
                "keyless request from an anonymous caller passed through: no provisional key spans two callers"
            );
            return Admission::PassThrough {
                headers: HeaderMap::new(),
            };
        }
        if caller.is_anonymous() && policy.anonymous == AnonymousPolicy::Reject {
            let detail = format!(
                "this endpoint keeps stored answers per caller and this request names none ({}); send it with your credential. The request was not processed.",
                self.identity()
            );
            return Admission::Refuse(
                Problem::new(ProblemKind::CredentialMissing, detail),
                Outcome::CredentialMissing,
            );
        }
        Admission::Keyed(Keyed {
            caller,
            key,
            accept: AcceptEncoding::from_headers(&parts.headers),
        })
    }

    /// What identifies a caller under this policy, for messages.
    fn identity(&self) -> String {
        match &self.inner.policy.scope {
            ScopeSource::Credential => "no Authorization header".to_owned(),
            ScopeSource::Header(name) => format!("no {name} header"),
            ScopeSource::Extension => "no scope from the application's authentication".to_owned(),
            ScopeSource::None => "every caller shares one scope".to_owned(),
        }
    }

    fn invalid_key(&self, err: &KeyError) -> Problem {
        Problem::new(
            ProblemKind::KeyInvalid,
            format!("{err}. The request was not processed."),
        )
    }

    /// A keyless request: the provisional window under `fingerprint:<window>`, else how it is
    /// passed through or refused.
    fn admit_keyless(&self) -> Result<Duration, Admission> {
        let header = &self.inner.policy.key_header;
        let required = || {
            let detail = format!(
                "this endpoint requires an {header} header; send a unique key (a UUIDv7 is a good choice) and reuse it on every retry of the same request"
            );
            Err(Admission::Refuse(
                Problem::new(ProblemKind::KeyMissing, detail),
                Outcome::Missing,
            ))
        };
        match self.inner.policy.missing_key {
            MissingKeyPolicy::Allow => Err(Admission::PassThrough {
                headers: HeaderMap::new(),
            }),
            MissingKeyPolicy::Require => required(),
            MissingKeyPolicy::Grace { until } if self.now() >= until => required(),
            MissingKeyPolicy::Grace { until } => {
                tracing::warn!(sunset = %until, "keyless request accepted during the grace period; keys become required at the sunset");
                let mut headers = HeaderMap::new();
                headers.insert("deprecation", HeaderValue::from_static("true"));
                let sunset = httpdate::fmt_http_date(until.to_system_time());
                headers.insert(
                    "sunset",
                    HeaderValue::from_str(&sunset).expect("an HTTP date is a valid header value"),
                );
                Err(Admission::PassThrough { headers })
            }
            MissingKeyPolicy::Fingerprint { window } => Ok(window),
        }
    }

    /// Claims the record for a keyed request, or decides the answer without running the handler.
    ///
    /// A copy that finds the key in flight waits (woken by the store) for up to `wait`, then gets
    /// the stored answer, or `409 key-in-flight` with `Retry-After`.
    pub async fn begin(&self, keyed: Keyed, fingerprint: &Fingerprint) -> Decision {
        let policy = &self.inner.policy;
        let (key, provisional) = match keyed.key {
            KeySource::Client(key) => (key, None),
            KeySource::Provisional(window) => {
                let derived = format!("fp:{}", hex(fingerprint.digest()));
                (
                    IdempotencyKey::new(&derived).expect("a hex digest is a valid key"),
                    Some(window),
                )
            }
        };
        let (scope, mut earlier) = match self.scope_of(keyed.caller).await {
            Ok(scopes) => scopes,
            Err(err) => {
                let scope = Scope::from_stored("cred-mac:(the store's salt could not be read)");
                return self.store_failed(&err, RecordId { scope, key });
            }
        };
        let mut id = RecordId { scope, key };
        if provisional.is_none()
            && let Some(created) = id.key.timestamp(policy.expire_by_key_time)
            && self.now().since(created) > policy.ttl
        {
            let detail = format!(
                "this key was created at {created}, longer ago than the {} for which answers are kept; it has expired. Send the request again with a new key.",
                humantime::format_duration(policy.ttl)
            );
            return respond(Problem::new(ProblemKind::KeyExpired, detail), Outcome::Expired, id);
        }

        let mut deadline = None;
        let mut waited = false;
        loop {
            let now = self.now();
            let token = FencingToken::random();
            let record = match self.claim_or_read(&id, fingerprint, now, token, provisional).await {
                Err(err) => return self.store_failed(&err, id),
                // A key new in this scope may have been run under the caller's scope of before a
                // change of hashing: decided on that record if there is one.
                Ok(Begin::Acquired { recovered }) if !earlier.is_empty() => {
                    match self.adopt_earlier(&id, token, &std::mem::take(&mut earlier), now).await {
                        Ok(None) => return Decision::Run(self.claimed(id, token, recovered, provisional)),
                        Ok(Some(adopted)) => {
                            id = adopted;
                            continue;
                        }
                        Err(err) => return self.store_failed(&err, id),
                    }
                }
                Ok(Begin::Acquired { recovered }) => {
                    return Decision::Run(self.claimed(id, token, recovered, provisional));
                }
                Ok(Begin::Existing(record)) => record,
            };
            let (holder, lease_until) = match self.judge(&record, fingerprint, now, waited, &keyed.accept) {
                Judgement::Answer(response, outcome) => return Decision::Respond { response, outcome, id },
                Judgement::Wait { holder, lease_until } => (holder, lease_until),
            };
            let deadline = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + policy.wait);
            if tokio::time::Instant::now() >= deadline {
                let secs = policy.retry_after.as_secs().max(1);
                let detail = format!(
                    "a request with this key is still being processed; retry in {secs} s (with the same key) to receive its answer"
                );
                let problem = Problem::new(ProblemKind::KeyInFlight, detail).retry_after(policy.retry_after);
                return respond(problem, Outcome::InFlight, id);
            }
            // Wake at the latest when the holder's lease runs out, to take over from a crashed holder.
            let until = deadline.min(tokio::time::Instant::now() + lease_until.since(now) + Duration::from_millis(5));
            waited = true;
            let limit = policy.store_timeout;
            let _waiting = Gauged::new(metric_names::WAITERS);
            let waiting = tokio::time::timeout_at(until + limit, self.inner.store.wait(&id, holder, until));
            if let Err(err) = waiting
                .await
                .unwrap_or_else(|_| Err(StoreError::unavailable(StoreTimedOut(limit))))
            {
                return self.store_failed(&err, id);
            }
        }
    }

    fn claimed(&self, id: RecordId, token: FencingToken, recovered: bool, provisional: Option<Duration>) -> Claim {
        Claim {
            id,
            token,
            recovered,
            provisional,
            run_deadline: tokio::time::Instant::now() + self.inner.policy.run_timeout,
            stepped: Arc::default(),
        }
    }

    /// The scope of `caller`, and the scopes its records may have been stored under before a
    /// change of how credentials are hashed (none for other sources).
    async fn scope_of(&self, caller: Caller) -> Result<(Scope, Vec<Scope>), StoreError> {
        match caller {
            Caller::Scope(scope) => Ok((scope, Vec::new())),
            Caller::Credential(credential) => {
                let scopes = self.credential_scopes().await?;
                let policy = &self.inner.policy;
                let retention = policy.ttl + policy.tombstone_ttl;
                let earlier = scopes.earlier(credential.as_bytes(), self.now(), retention);
                Ok((scopes.scope(credential.as_bytes()), earlier))
            }
        }
    }

    /// How credential scopes are hashed in this store: its salt is read (made, the first time
    /// ever) at the first call, and kept; a failed read is tried again at the next.
    pub async fn credential_scopes(&self) -> Result<&CredentialScopes, StoreError> {
        let credentials = &self.inner.credentials;
        credentials
            .loaded
            .get_or_try_init(|| {
                self.bounded(CredentialScopes::load(
                    &*self.inner.store,
                    &credentials.secrets,
                    self.now(),
                ))
            })
            .await
    }

    /// Gives up the new claim `token` on `id` if the key has a live record under one of the
    /// `earlier` scopes, and returns that record's id, for the request to be decided on it;
    /// `None` (the claim stands) if it has none. A record is never run under two scopes: if the
    /// claim cannot be given up, the request fails (`503`) and the claim is released later.
    async fn adopt_earlier(
        &self,
        id: &RecordId,
        token: FencingToken,
        earlier: &[Scope],
        now: UnixMillis,
    ) -> Result<Option<RecordId>, StoreError> {
        let store = &self.inner.store;
        let give_up = |err: StoreError| {
            let limit = self.inner.policy.store_timeout;
            tokio::spawn(give_up_claim(store.clone(), id.clone(), token, limit));
            err
        };
        for scope in earlier {
            let older = RecordId {
                scope: scope.clone(),
                key: id.key.clone(),
            };
            let found = self.bounded(store.get(&older)).await.map_err(give_up)?;
            if found.is_some_and(|record| is_live(&record, now)) {
                self.bounded(store.release(id, token, Release::Forget))
                    .await
                    .map_err(give_up)?;
                tracing::info!(scope = %older.scope, key = %older.key, "the key was first used before a change of how credential scopes are hashed; its record is used");
                return Ok(Some(older));
            }
        }
        Ok(None)
    }

    fn judge(
        &self,
        record: &Record,
        fingerprint: &Fingerprint,
        now: UnixMillis,
        waited: bool,
        accept: &AcceptEncoding,
    ) -> Judgement {
        if let Some(used_at) = expired_at(record, now) {
            let detail = format!(
                "this key was used at {used_at} and its answer is no longer kept; it has expired. Send the request again with a new key."
            );
            return Judgement::problem(Problem::new(ProblemKind::KeyExpired, detail), Outcome::Expired);
        }
        if record.fingerprint.digest() != fingerprint.digest() {
            let first = &record.fingerprint;
            let differences = first.differences(fingerprint);
            let detail = format!(
                "this key was first used for {} {}; this request differs in its {}. Use a new key for a new request, or resend the original request unchanged.",
                first.method(),
                first.path(),
                differences.describe()
            );
            return Judgement::problem(Problem::new(ProblemKind::KeyMismatch, detail), Outcome::Mismatch);
        }
        match &record.state {
            RecordState::Completed {
                response: Some(bytes), ..
            } => match crate::seal::open_answer(self.inner.keyring.as_deref(), &record.id, bytes) {
                Ok(stored) => {
                    let outcome = if waited { Outcome::Waited } else { Outcome::Replayed };
                    Judgement::Answer(stored.to_replay(accept), outcome)
                }
                Err(err) => {
                    // Never run again: the request took effect, only its answer is lost to us.
                    tracing::error!(scope = %record.id.scope, key = %record.id.key, error = %err, "the stored answer cannot be read");
                    let detail = "this key's request was processed, but its stored answer cannot be read (an operator can tell why from the logs); it will not be processed again";
                    Judgement::problem(Problem::new(ProblemKind::AnswerUnreadable, detail), Outcome::Unreadable)
                }
            },
            RecordState::InFlight { token, lease_until, .. } => Judgement::Wait {
                holder: *token,
                lease_until: *lease_until,
            },
            // The store only returns these when it did not claim the record, which for a matching
            // fingerprint means another caller claimed it in between: look again shortly.
            RecordState::Completed { response: None, .. } | RecordState::Unknown { .. } => Judgement::Wait {
                holder: FencingToken::random(),
                lease_until: now,
            },
        }
    }

    fn store_failed(&self, err: &StoreError, id: RecordId) -> Decision {
        tracing::error!(scope = %id.scope, key = %id.key, error = %err, "idempotency store failed");
        if self.inner.policy.fail_open {
            return Decision::PassThrough { id };
        }
        let detail =
            "the idempotency store cannot be reached, so the request was not processed; retry with the same key";
        let problem = Problem::new(ProblemKind::StoreUnavailable, detail).retry_after(self.inner.policy.retry_after);
        respond(problem, Outcome::StoreError, id)
    }

    /// The stored form of an answer (`body: None`: compact).
    pub(crate) fn capture(&self, id: &RecordId, head: &http::response::Parts, body: Option<Bytes>) -> Bytes {
        let stored = StoredResponse::capture(head.status, &head.headers, &self.inner.policy.stored_headers, body);
        let encoded = stored.encode();
        match &self.inner.keyring {
            Some(keyring) => keyring.seal(id, &encoded),
            None => encoded.into(),
        }
    }

    /// One `begin` in the store, run to its end whatever becomes of this request: if it does not
    /// answer within `store_timeout`, the request is told the store failed, and a claim that the
    /// store makes later is released at once (nothing was sent).
    async fn claim_or_read(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        now: UnixMillis,
        token: FencingToken,
        provisional: Option<Duration>,
    ) -> Result<Begin, StoreError> {
        let store = self.inner.store.clone();
        let (owned_id, owned_fingerprint) = (id.clone(), fingerprint.clone());
        let lease_until = now.plus(self.inner.policy.lease);
        let (expires_at, purge_at) = self.inner.policy.retention(now, provisional);
        // Owned, so that it can be left to finish in the background if the store is too slow;
        // polled here otherwise, without a task of its own.
        let mut begin = Box::pin(async move {
            let request = BeginRequest {
                id: &owned_id,
                fingerprint: &owned_fingerprint,
                now,
                lease_until,
                expires_at,
                purge_at,
                token,
            };
            let begun = store.begin(request).await;
            (begun, owned_id, store)
        });
        let limit = self.inner.policy.store_timeout;
        match tokio::time::timeout(limit, begin.as_mut()).await {
            // The store may have made the claim and lost only its reply (a connection reset after
            // the command ran): nothing will run under it, so it is given up rather than left to
            // answer 409 until its lease ends and then run marked recovered.
            Ok((Err(err @ StoreError::Unavailable(_)), id, store)) => {
                tokio::spawn(give_up_claim(store, id, token, limit));
                Err(err)
            }
            Ok((begun, _, _)) => begun,
            Err(_) => {
                tokio::spawn(async move {
                    if let (Ok(Begin::Acquired { .. }) | Err(StoreError::Unavailable(_)), id, store) = begin.await {
                        give_up_claim(store, id, token, limit).await;
                    }
                });
                Err(StoreError::unavailable(StoreTimedOut(limit)))
            }
        }
    }

    /// Extends the claim's lease by another `lease` from now.
    pub async fn renew(&self, claim: &Claim) -> Result<(), StoreError> {
        let lease_until = self.now().plus(self.inner.policy.lease);
        self.bounded(self.inner.store.renew(&claim.id, claim.token, lease_until))
            .await
    }

    /// Records a step of the run under `claim`, so that a run taking the record over can resume
    /// after it. [`StoreError::Fenced`] if the claim was lost: the run must stop.
    pub async fn checkpoint(&self, claim: &Claim, checkpoint: Checkpoint) -> Result<(), StoreError> {
        // Marked before the store answers: a checkpoint whose reply was lost may stand.
        claim.stepped.store(true, Ordering::Release);
        self.bounded(self.inner.store.checkpoint(&claim.id, claim.token, checkpoint))
            .await
    }

    /// The steps recorded by the runs of this record before `claim`: none for a new claim (no
    /// store operation), those of the crashed or given-up run for a recovered one.
    pub async fn checkpoints(&self, claim: &Claim) -> Result<Vec<Checkpoint>, StoreError> {
        if !claim.recovered {
            return Ok(Vec::new());
        }
        self.bounded(self.inner.store.checkpoints(&claim.id)).await
    }

    /// How often a running claim renews its lease: a third of it, so two renewals can fail first.
    pub fn renew_every(&self) -> Duration {
        // Never zero, which no timer accepts: a policy that was not validated must not panic here.
        (self.inner.policy.lease / 3).max(Duration::from_millis(1))
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

/// Releases the claim `token` may hold on `id`, made by a `begin` whose request was answered
/// `503` (its reply was lost, or came too late): a few tries, each bounded by `limit`, stopping as
/// soon as the store says the claim is gone or was never made (`Fenced`).
async fn give_up_claim(store: Arc<dyn Store>, id: RecordId, token: FencingToken, limit: Duration) {
    for pause in [
        Duration::ZERO,
        Duration::from_millis(200),
        Duration::from_secs(1),
        Duration::from_secs(5),
    ] {
        tokio::time::sleep(pause).await;
        match tokio::time::timeout(limit, store.release(&id, token, Release::Forget)).await {
            Ok(Ok(())) => {
                tracing::info!(scope = %id.scope, key = %id.key, "released a claim whose begin was answered 503");
                return;
            }
            Ok(Err(StoreError::Fenced)) => return,
            Ok(Err(_)) | Err(_) => {}
        }
    }
    tracing::warn!(scope = %id.scope, key = %id.key, "could not release a claim whose begin was answered 503; it is taken over when its lease ends");
}

/// Whether a record still stands for its key: anything but one past its `purge_at`, which a claim
/// would treat as absent.
fn is_live(record: &Record, now: UnixMillis) -> bool {
    match record.state {
        RecordState::InFlight { .. } => true,
        RecordState::Completed { purge_at, .. } | RecordState::Unknown { purge_at, .. } => now < purge_at,
    }
}

/// When the key of `record` was used, if it has expired at `now`: an answer past its ttl (or
/// dropped to a tombstone), an unknown outcome past its ttl, or a claim whose holder vanished
/// (its lease ended) past its ttl. None of them runs again.
fn expired_at(record: &Record, now: UnixMillis) -> Option<UnixMillis> {
    match &record.state {
        RecordState::Completed {
            response,
            expires_at,
            completed_at,
            ..
        } => (now >= *expires_at || response.is_none()).then_some(*completed_at),
        RecordState::Unknown { expires_at, .. } => (now >= *expires_at).then_some(record.created_at),
        RecordState::InFlight {
            lease_until,
            expires_at: Some(expires_at),
            ..
        } => (now >= *lease_until && now >= *expires_at).then_some(record.created_at),
        RecordState::InFlight { expires_at: None, .. } => None,
    }
}

enum Judgement {
    Answer(Response<Bytes>, Outcome),
    Wait {
        holder: FencingToken,
        lease_until: UnixMillis,
    },
}

impl Judgement {
    fn problem(problem: Problem, outcome: Outcome) -> Self {
        Self::Answer(problem.to_response(), outcome)
    }
}

fn respond(problem: Problem, outcome: Outcome, id: RecordId) -> Decision {
    Decision::Respond {
        response: problem.to_response(),
        outcome,
        id,
    }
}
