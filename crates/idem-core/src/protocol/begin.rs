//! Begin: the atomic claim of a keyed request's record, and what is done when the record exists —
//! judged (`judge.rs`), waited on, or answered — or when the store fails.

use std::sync::Arc;
use std::time::Duration;

use super::admission::KeySource;
use super::judge::{Judgement, judge};
use super::lease::Gauged;
use super::{Claim, Decision, Keyed, Outcome, Protocol, StoreTimedOut, deadline_after};
use crate::content_coding::AcceptEncoding;
use crate::credential::CredentialScopes;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::metric_names;
use crate::problem::{Problem, ProblemKind};
use crate::replay_cache::{Generation, Lookup, ReplayCache};
use crate::scope::{Caller, Scope, hex};
use crate::spans::traced;
use crate::store::StoreOperation;
use crate::store::{
    Begin, BeginRequest, FencingToken, Origin, Record, RecordId, RecordState, Release, Store, StoreError, StoreIdentity,
};
use crate::time::UnixMillis;

/// How many times one request reads the store's salt again after a claim found the store changed
/// before it is answered `503`: once is enough unless the store loses its data again meanwhile.
const MAX_RELOADS: u32 = 2;

impl Protocol {
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
        let request = keyed.request;
        // Read when the store is first asked for a claim: a replay from the cache needs none.
        let mut origin: Option<Arc<Origin>> = None;
        // Every claim carries the identity of the store whose salt hashed its scope; read once,
        // and again when a claim finds the store changed.
        let mut hashing = match self.credential_scopes().await {
            Ok(hashing) => hashing,
            Err(err) => {
                let scope = Scope::from_stored("cred-mac:(the store's salt could not be read)");
                return self.store_failed(&err, RecordId { scope, key });
            }
        };
        let (scope, mut earlier) = self.scope_of(&keyed.caller, &hashing);
        let mut id = RecordId { scope, key };
        let mut reloads = 0;
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
            let cached = match self.answer_from_replay_cache(&id, fingerprint, now, waited, &keyed.accept) {
                Ok(decision) => return decision,
                Err(generation) => generation,
            };
            let token = self.new_token();
            let record = match self
                .claim_or_read(
                    &id,
                    fingerprint,
                    origin.get_or_insert_with(|| request.origin()),
                    now,
                    (token, hashing.identity()),
                    provisional,
                )
                .await
            {
                // The store lost its data since its salt was read (or another instance read a new
                // one first): nothing was claimed. The salt is read again, this instance's replay
                // caches emptied, and the request decided anew under the scope the salt now gives.
                Err(StoreError::IdentityChanged) if reloads < MAX_RELOADS => {
                    reloads += 1;
                    hashing = match self.reload_scopes(&hashing).await {
                        Ok(hashing) => hashing,
                        Err(err) => return self.store_failed(&err, id),
                    };
                    let (scope, again) = self.scope_of(&keyed.caller, &hashing);
                    (id.scope, earlier) = (scope, again);
                    continue;
                }
                Err(err) => return self.store_failed(&err, id),
                // A key new in this scope may have been run under the caller's scope of before a
                // change of hashing: decided on that record if there is one.
                Ok(Begin::Acquired { recovered }) if !earlier.is_empty() => {
                    let token = token.for_run(recovered);
                    // Boxed: rare (a scope of before a change of hashing), and large.
                    match Box::pin(self.adopt_earlier(&id, token, &std::mem::take(&mut earlier), now)).await {
                        Ok(None) => return Decision::Run(self.claimed(id, token, recovered, provisional)),
                        Ok(Some(adopted)) => {
                            id = adopted;
                            continue;
                        }
                        Err(err) => return self.store_failed(&err, id),
                    }
                }
                Ok(Begin::Acquired { recovered }) => {
                    let token = token.for_run(recovered);
                    return Decision::Run(self.claimed(id, token, recovered, provisional));
                }
                Ok(Begin::Existing(record)) => record,
            };
            if let Some((cache, generation)) = cached {
                cache.keep(&record, now, generation);
            }
            let (holder, lease_until) = match judge(
                &record,
                fingerprint,
                now,
                waited,
                self.inner.keyring.as_deref(),
                &keyed.accept,
            ) {
                Judgement::Answer(response, outcome) => {
                    return Decision::Respond {
                        response,
                        outcome,
                        id,
                        answered_by: record.origin.trace,
                    };
                }
                Judgement::Wait { holder, lease_until } => (holder, lease_until),
            };
            let deadline = *deadline.get_or_insert_with(|| deadline_after(policy.wait));
            if tokio::time::Instant::now() >= deadline {
                let secs = policy.retry_after.as_secs().max(1);
                let detail = format!(
                    "a request with this key is still being processed; retry in {secs} s (with the same key) to receive its answer"
                );
                let problem = Problem::new(ProblemKind::KeyInFlight, detail).retry_after(policy.retry_after);
                return respond(problem, Outcome::InFlight, id);
            }
            // Wake at the latest when the holder's lease runs out, to take over from a crashed holder.
            let until = deadline.min(deadline_after(
                lease_until.since(now).saturating_add(Duration::from_millis(5)),
            ));
            waited = true;
            let limit = policy.store_timeout;
            let _waiting = Gauged::new(metric_names::WAITERS);
            let waiting = async {
                tokio::time::timeout_at(
                    until.checked_add(limit).unwrap_or_else(|| deadline_after(limit)),
                    self.inner.store.wait(&id, holder, until),
                )
                .await
                .unwrap_or_else(|_| Err(StoreError::unavailable(StoreTimedOut(limit))))
            };
            if let Err(err) = traced(StoreOperation::Wait, waiting).await {
                return self.store_failed(&err, id);
            }
        }
    }

    /// The answer to a replay from the replay cache, if it holds the key's completed record; else
    /// what to keep the store's record under (nothing without a cache).
    fn answer_from_replay_cache<'c>(
        &'c self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        now: UnixMillis,
        waited: bool,
        accept: &AcceptEncoding,
    ) -> Result<Decision, ToKeep<'c>> {
        let Some(cache) = self.inner.replay_cache.as_ref() else {
            return Err(None);
        };
        let record = match cache.lookup(id, now) {
            Lookup::Hit(record) => record,
            Lookup::Miss(generation) => return Err(Some((&**cache, generation))),
        };
        // Judged as the store's record would be: a completed, unexpired record is answered
        // (replayed, or refused for another body), never waited on.
        match judge(&record, fingerprint, now, waited, self.inner.keyring.as_deref(), accept) {
            Judgement::Answer(response, outcome) => {
                // Counted as the store counts a `begin` that finds the record: every answer to
                // the same request (an unreadable sealed one too), not a refusal of another.
                if outcome != Outcome::Mismatch {
                    self.inner.store.count_replay(id);
                }
                metrics::counter!(metric_names::REPLAY_CACHE_ANSWERS_TOTAL).increment(1);
                Ok(Decision::Respond {
                    response,
                    outcome,
                    id: id.clone(),
                    answered_by: record.origin.trace,
                })
            }
            Judgement::Wait { .. } => Err(None),
        }
    }

    /// The token of a new claim: an in-transaction one on a route whose handlers complete in their
    /// own transaction, if the store can take such completions.
    fn new_token(&self) -> FencingToken {
        if self.inner.policy.in_transaction && self.inner.store.completes_in_transactions() {
            FencingToken::random_in_transaction()
        } else {
            FencingToken::random()
        }
    }

    /// True if this protocol's claims are completed in their handlers' own transactions.
    pub fn in_transaction(&self) -> bool {
        self.inner.policy.in_transaction && self.inner.store.completes_in_transactions()
    }

    fn claimed(&self, id: RecordId, token: FencingToken, recovered: bool, provisional: Option<Duration>) -> Claim {
        Claim {
            id,
            token,
            recovered,
            provisional,
            run_deadline: deadline_after(self.inner.policy.run_timeout),
            stepped: Arc::default(),
        }
    }

    /// The scope of `caller` under `hashing`, and the scopes its records may have been stored
    /// under before a change of how credentials are hashed (none for other sources).
    fn scope_of(&self, caller: &Caller, hashing: &CredentialScopes) -> (Scope, Vec<Scope>) {
        match caller {
            Caller::Scope(scope) => (scope.clone(), Vec::new()),
            Caller::Credential(credential) => {
                let policy = &self.inner.policy;
                let retention = policy.ttl + policy.tombstone_ttl;
                let earlier = hashing.earlier(credential.as_bytes(), self.now(), retention);
                (hashing.scope(credential.as_bytes()), earlier)
            }
        }
    }

    /// How credential scopes are hashed in this store, and its identity: its salt is read (made,
    /// the first time ever) at the first call, and kept; a failed read is tried again at the next.
    pub async fn credential_scopes(&self) -> Result<Arc<CredentialScopes>, StoreError> {
        let credentials = &self.inner.credentials;
        if let Some(loaded) = credentials.current() {
            return Ok(loaded);
        }
        // Boxed: loading is a large future, run once per process; inline, every request's
        // `begin` would carry (and move) room for it.
        Box::pin(credentials.reload(None, self.load_scopes())).await
    }

    /// The hashing under the salt the store holds now, after a claim under `stale` found the store
    /// changed: read once for every request that found it at the same time. Every replay cache of
    /// this instance in front of the store is emptied first, so that nothing the store no longer
    /// holds is answered from memory once the new salt is in use.
    async fn reload_scopes(&self, stale: &Arc<CredentialScopes>) -> Result<Arc<CredentialScopes>, StoreError> {
        if let Some(invalidations) = self.inner.store.invalidations() {
            invalidations.flush();
        }
        let reloaded = Box::pin(self.inner.credentials.reload(Some(stale), self.load_scopes())).await?;
        if reloaded.identity() != stale.identity() {
            tracing::warn!(
                "the store is not the one this instance knew (its data was lost, flushed or replaced): its scope salt was read again and the replay cache emptied"
            );
        }
        Ok(reloaded)
    }

    /// Reads the store's salt (making it if the store has none), bounded by `store_timeout`. The
    /// salt carries the store's identity: the replay cache takes it as a read of its own, so that
    /// it answers from the first replays after start, not only once its own first read is back.
    async fn load_scopes(&self) -> Result<CredentialScopes, StoreError> {
        let credentials = &self.inner.credentials;
        let loaded = self
            .bounded(
                StoreOperation::ScopeSalt,
                CredentialScopes::load(&*self.inner.store, &credentials.secrets, self.now()),
            )
            .await?;
        if let Some(cache) = &self.inner.replay_cache {
            cache.identity_read(Some(loaded.identity()));
        }
        Ok(loaded)
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
            tokio::spawn(give_up_claim(store.clone(), id.clone(), token, limit, Release::Forget));
            err
        };
        for scope in earlier {
            let older = RecordId {
                scope: scope.clone(),
                key: id.key.clone(),
            };
            let found = self
                .bounded(StoreOperation::Get, store.get(&older))
                .await
                .map_err(give_up)?;
            if found.is_some_and(|record| is_live(&record, now)) {
                self.bounded(StoreOperation::Release, store.release(id, token, Release::Forget))
                    .await
                    .map_err(give_up)?;
                tracing::info!(scope = %older.scope, key = %older.key, "the key was first used before a change of how credential scopes are hashed; its record is used");
                return Ok(Some(older));
            }
        }
        Ok(None)
    }

    /// The answer to a request the store failed: `503 store-unavailable` with `Retry-After` (or
    /// the request passed through, under `fail-open`) if it could not be reached or answer in
    /// time; `500 answer-unreadable`, never passed through, if it holds data it cannot read.
    fn store_failed(&self, err: &StoreError, id: RecordId) -> Decision {
        tracing::error!(scope = %id.scope, key = %id.key, error = %err, "idempotency store failed");
        if let StoreError::Corrupt(_) = err {
            // The store answered, and what it holds cannot be read: retrying cannot help, and the
            // record may stand for a run that happened, so this never fails open.
            let detail = "the idempotency store holds data about this key that cannot be read, so the request was \
                not processed; it will not be while that data stands, so retrying does not help (the service's \
                operator has the details in its log)";
            return respond(
                Problem::new(ProblemKind::AnswerUnreadable, detail),
                Outcome::Unreadable,
                id,
            );
        }
        if self.inner.policy.fail_open {
            return Decision::PassThrough { id };
        }
        let detail = if matches!(err, StoreError::Locked) {
            "the idempotency store is locked by a transaction still open (a request completing in its own transaction), so the request was not processed; retry with the same key"
        } else {
            "the idempotency store cannot be reached, so the request was not processed; retry with the same key"
        };
        let problem = Problem::new(ProblemKind::StoreUnavailable, detail).retry_after(self.inner.policy.retry_after);
        respond(problem, Outcome::StoreError, id)
    }

    /// One `begin` in the store, under the token and the store identity given, run to its end
    /// whatever becomes of this request: if it does not answer within `store_timeout`, the request
    /// is told the store failed, and a claim that the store makes later is released at once
    /// (nothing was sent).
    async fn claim_or_read(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        origin: &Arc<Origin>,
        now: UnixMillis,
        (token, identity): (FencingToken, StoreIdentity),
        provisional: Option<Duration>,
    ) -> Result<Begin, StoreError> {
        let store = self.inner.store.clone();
        let (owned_id, owned_fingerprint, owned_origin) = (id.clone(), fingerprint.clone(), Arc::clone(origin));
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
                origin: &owned_origin,
                identity: Some(identity),
            };
            let begun = traced(StoreOperation::Begin, store.begin(request)).await;
            (begun, owned_id, store)
        });
        let limit = self.inner.policy.store_timeout;
        // How a claim nobody will run under is given up: forgotten if it was a new claim, but
        // left unknown if it may have taken over a run that may have had effects (a takeover whose
        // reply was lost, or that no replica acknowledged) — forgetting it would let the next run
        // go unflagged.
        let unknown = Release::Unknown { expires_at, purge_at };
        match tokio::time::timeout(limit, begin.as_mut()).await {
            // The store may have made the claim and lost only its reply (a connection reset after
            // the command ran, a write no replica acknowledged): nothing will run under it, so it
            // is given up rather than left to answer 409 until its lease ends. Whether it was a
            // takeover is not known: it is left unknown.
            Ok((Err(err @ StoreError::Unavailable(_)), id, store)) => {
                give_up_claims(store, id, held_tokens(token, None), limit, unknown);
                Err(err)
            }
            Ok((begun, _, _)) => begun,
            Err(_) => {
                tokio::spawn(async move {
                    let (begun, id, store) = begin.await;
                    let (recovered, release) = match begun {
                        Ok(Begin::Acquired { recovered: false }) => (Some(false), Release::Forget),
                        Ok(Begin::Acquired { recovered: true }) => (Some(true), unknown),
                        Err(StoreError::Unavailable(_)) => (None, unknown),
                        _ => return,
                    };
                    give_up_claims(store, id, held_tokens(token, recovered), limit, release);
                });
                Err(StoreError::unavailable(StoreTimedOut(limit)))
            }
        }
    }
}

/// Where to keep what the store says of a record the replay cache did not answer: the cache and its
/// generation before the store was asked (`None`: no cache).
type ToKeep<'c> = Option<(&'c ReplayCache, Generation)>;

/// The tokens a claim requested with `token` may hold: the one for its kind of run, or, if it is
/// not known whether the claim was made or recovered (`None`), each that it could be.
fn held_tokens(token: FencingToken, recovered: Option<bool>) -> Vec<FencingToken> {
    match recovered {
        Some(recovered) => vec![token.for_run(recovered)],
        None if token.for_run(true) == token => vec![token],
        None => vec![token, token.for_run(true)],
    }
}

/// Gives up, in the background, the claim that one of `tokens` may hold ([`give_up_claim`]).
fn give_up_claims(store: Arc<dyn Store>, id: RecordId, tokens: Vec<FencingToken>, limit: Duration, release: Release) {
    for token in tokens {
        tokio::spawn(give_up_claim(store.clone(), id.clone(), token, limit, release));
    }
}

/// Releases (as `release` says) the claim `token` may hold on `id`, made by a `begin` whose
/// request was answered `503` (its reply was lost, or came too late): a few tries, each bounded by
/// `limit`, stopping as soon as the store says the claim is gone or was never made (`Fenced`).
async fn give_up_claim(store: Arc<dyn Store>, id: RecordId, token: FencingToken, limit: Duration, release: Release) {
    for pause in [
        Duration::ZERO,
        Duration::from_millis(200),
        Duration::from_secs(1),
        Duration::from_secs(5),
    ] {
        tokio::time::sleep(pause).await;
        match tokio::time::timeout(limit, store.release(&id, token, release)).await {
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

fn respond(problem: Problem, outcome: Outcome, id: RecordId) -> Decision {
    Decision::Respond {
        response: problem.to_response(),
        outcome,
        id,
        answered_by: None,
    }
}
