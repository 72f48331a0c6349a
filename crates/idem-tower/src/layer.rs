//! [`IdempotencyLayer`]: the builder that configures the protocol and wraps services.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    Clock, HeaderAllowList, Keyring, MissingKeyPolicy, Policy, Routes, ScopeSecrets, ScopeSource, Store,
    protocol::{Protocol, ScopeHashing},
    replay_cache::{ReplayCache, ReplayCacheConfig},
    store::StoreClock,
};
use tokio_util::task::TaskTracker;
use tower_layer::Layer;

use crate::routing::Routing;
use crate::service::IdempotencyService;

/// Applies the idempotency protocol to a service.
///
/// Built from a store, then configured with `with_*` methods, each consuming and returning the layer.
/// Each setting's default is the one of [`Policy::default`], documented on its field.
#[derive(Clone, Debug)]
pub struct IdempotencyLayer {
    store: Arc<dyn Store>,
    policy: Policy,
    routes: Routes,
    keyring: Option<Arc<Keyring>>,
    /// Shared by every protocol this layer makes, so that the store's salt is read once.
    scope_hashing: Arc<ScopeHashing>,
    clock: Arc<dyn Clock>,
    response_timeout: Option<Duration>,
    tasks: TaskTracker,
    /// Completed answers kept in memory, shared by every service this layer makes.
    replay_cache: Option<Arc<ReplayCache>>,
    /// The path prefix the service is reached under (empty: the root).
    path_prefix: String,
}

impl IdempotencyLayer {
    /// A layer over `store` with the default policy of the design.
    pub fn new(store: impl Store) -> Self {
        Self::from_shared(Arc::new(store))
    }

    /// A layer over a store that is already shared.
    pub fn from_shared(store: Arc<dyn Store>) -> Self {
        Self {
            clock: StoreClock::new(store.clone()),
            replay_cache: ReplayCache::for_store(&store, ReplayCacheConfig::DEFAULT),
            store,
            policy: Policy::default(),
            routes: Routes::new(),
            keyring: None,
            scope_hashing: Arc::default(),
            response_timeout: None,
            tasks: TaskTracker::new(),
            path_prefix: String::new(),
        }
    }

    /// Sizes the replay cache, or turns it off ([`ReplayCacheConfig::OFF`]). On by default
    /// ([`ReplayCacheConfig::DEFAULT`]: 10 000 answers, 32 MiB): a replay of an answer this
    /// instance has read before is answered from memory, judged exactly as the store's record
    /// would be, until the record's `expires_at`; a delete anywhere reaches it through the
    /// store's notification channel at once, and each entry is read again from the store once it
    /// is `max_age` old ([`idem_core::replay_cache`]).
    pub fn with_replay_cache(mut self, config: ReplayCacheConfig) -> Self {
        self.replay_cache = ReplayCache::for_store(&self.store, config);
        self
    }

    /// Declares that the handlers complete their records in their own database transaction and
    /// have no effect outside it, or only effects idempotent by the key
    /// ([`Policy::in_transaction`]). On a store that completes in transactions (PostgreSQL,
    /// SQLite) every keyed handler finds an [`InTransaction`](crate::InTransaction) in its
    /// request's extensions, declared or not, to hand to the store's `complete_in` with its
    /// transaction and its answer. Declared, a run that ends without completing had no effect: its
    /// key runs again unflagged, as does a key whose holder died before its commit. Undeclared,
    /// such keys run again flagged recovered, as for any handler. On Redis this changes nothing.
    pub fn with_in_transaction(mut self, in_transaction: bool) -> Self {
        self.policy.in_transaction = in_transaction;
        self
    }

    /// Replaces the whole policy.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Rules by path: the first route matching a request's path gives its policy or lets it pass
    /// untouched; paths no route matches get this layer's policy. The gateway's `[[route]]`
    /// tables are the same [`Routes`].
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use idem_core::{MissingKeyPolicy, Policy, RouteRule, Routes};
    /// use idem_sqlite::SqliteStore;
    /// use idem_tower::IdempotencyLayer;
    ///
    /// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
    /// let policy = Policy::default();
    /// let routes = Routes::new()
    ///     .with("/webhooks/*", RouteRule::PassThrough)?
    ///     .with("/payments", RouteRule::Protect(Policy { missing_key: MissingKeyPolicy::Require, ..policy.clone() }))?
    ///     .with("/exports/{id}", RouteRule::Protect(Policy { ttl: Duration::from_secs(600), ..policy.clone() }))?;
    /// let layer = IdempotencyLayer::new(SqliteStore::open("idem.db").await?)
    ///     .with_policy(policy)
    ///     .with_routes(routes);
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_routes(mut self, routes: Routes) -> Self {
        self.routes = routes;
        self
    }

    /// The path prefix the wrapped service is reached under (`/api`; default none, the root),
    /// as when the layer sits in front of a server that serves it under `/api`, or a gateway
    /// passes paths on under an upstream's prefix. A request whose path climbs out of it
    /// (`/../admin`, in any spelling of `..`) is refused with `400 path-ambiguous` before its
    /// route is picked, whatever its method: see
    /// [`Protocol::admit_path`](idem_core::protocol::Protocol::admit_path).
    pub fn with_path_prefix(mut self, prefix: &str) -> Self {
        prefix.clone_into(&mut self.path_prefix);
        self
    }

    /// How long an answer is replayable.
    ///
    /// The builder takes any duration, as every `with_` method here does: one past
    /// [`Policy::MAX_RETENTION`] (a ttl, a tombstone) or [`Policy::MAX_TIMEOUT`] (a lease, a wait,
    /// a timeout) fails [`Policy::validate`], which the gateway calls at start; a layer built with
    /// one anyway clamps rather than panic in a request: the times it stores stop at the year 9999
    /// and its deadlines thirty years out.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.policy.ttl = ttl;
        self
    }

    /// How long an expired key answers `key-expired`.
    pub fn with_tombstone_ttl(mut self, ttl: Duration) -> Self {
        self.policy.tombstone_ttl = ttl;
        self
    }

    /// Where the caller's scope comes from.
    ///
    /// A `header:` source on a header that carries a credential (`Cookie`, `X-Api-Key`, …: see
    /// [`ScopeSource::credential_header`]) fails [`Policy::validate`]; if the layer is given one
    /// anyway, the header's value is hashed as a credential, never stored or shown in clear.
    pub fn with_scope(mut self, scope: ScopeSource) -> Self {
        self.policy.scope = scope;
        self
    }

    /// What happens to requests without a key.
    pub fn with_missing_key(mut self, policy: MissingKeyPolicy) -> Self {
        self.policy.missing_key = policy;
        self
    }

    /// The lease of a running request, renewed while it runs.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.policy.lease = lease;
        self
    }

    /// How long a request may run before it is given up and its key released as unknown, so a
    /// hung handler never wedges its key.
    pub fn with_run_timeout(mut self, limit: Duration) -> Self {
        self.policy.run_timeout = limit;
        self
    }

    /// How long one store operation may take before it counts as failed.
    pub fn with_store_timeout(mut self, limit: Duration) -> Self {
        self.policy.store_timeout = limit;
        self
    }

    /// How long a copy waits for the first request before `409 key-in-flight`.
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.policy.wait = wait;
        self
    }

    /// The largest keyed request body; larger ones get `413`.
    pub fn with_max_body(mut self, bytes: usize) -> Self {
        self.policy.max_body = bytes;
        self
    }

    /// The largest answer stored whole; larger ones stream through and are stored compact
    ///.
    pub fn with_max_stored_body(mut self, bytes: usize) -> Self {
        self.policy.max_stored_body = bytes;
        self
    }

    /// The methods the protocol applies to.
    pub fn with_methods(mut self, methods: Vec<http::Method>) -> Self {
        self.policy.methods = methods;
        self
    }

    /// Store 5xx answers too, instead of letting a retry run again.
    pub fn with_store_5xx(mut self, store: bool) -> Self {
        self.policy.store_5xx = store;
        self
    }

    /// Run requests unprotected when the store is down, instead of `503 store-unavailable`.
    pub fn with_fail_open(mut self, fail_open: bool) -> Self {
        self.policy.fail_open = fail_open;
        self
    }

    /// The headers a stored answer keeps.
    pub fn with_stored_headers(mut self, headers: HeaderAllowList) -> Self {
        self.policy.stored_headers = headers;
        self
    }

    /// Answer `504 upstream-timeout` (with `Retry-After`) when the handler takes longer than
    /// `timeout`; the handler keeps running and its answer is stored for the retry.
    pub fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = Some(timeout);
        self
    }

    /// Seals stored answers at rest with the keyring's first key, and opens those sealed by any
    /// of its keys (a new key first and the old ones after it: records sealed before still
    /// replay). An answer no key opens is `500 answer-unreadable`, never run again.
    ///
    /// ```
    /// # fn example(store: impl idem_core::Store) -> Result<(), idem_core::KeyringError> {
    /// let keys = "k2026:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=".parse()?;
    /// let layer = idem_tower::IdempotencyLayer::new(store).with_encryption(keys);
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_encryption(mut self, keyring: Keyring) -> Self {
        self.keyring = Some(Arc::new(keyring));
        self
    }

    /// Mixes `secrets` into the hash of credential scopes (`ScopeSource::Credential`), besides the
    /// store's own random salt: a copy of the store then gives nothing to test guessed
    /// credentials against. Keep the secret out of the store (in the environment or a secret
    /// manager). To change it, keep the previous one as [`ScopeSecrets::with_previous`] for one
    /// retention, so that retries of keys used before the change still replay.
    ///
    /// ```
    /// # fn example(store: impl idem_core::Store) -> Result<(), idem_core::ScopeSecretError> {
    /// use idem_core::{ScopeSecret, ScopeSecrets};
    /// let secret = ScopeSecret::new("nG1ZtqAY0vVjY2h8fPq8y9pJ3kW7r0sL")?;
    /// let layer = idem_tower::IdempotencyLayer::new(store).with_scope_secrets(ScopeSecrets::new(Some(secret)));
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_scope_secrets(mut self, secrets: ScopeSecrets) -> Self {
        self.scope_hashing = Arc::new(ScopeHashing::new(secrets));
        self
    }

    /// The clock leases, expiry and tombstones are judged on (default: the store's, a
    /// [`StoreClock`]; another for tests of leases and retention).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The tasks running keyed handlers. Handlers run to completion even when their client hangs
    /// up; on shutdown, `close()` and `wait()` on this tracker let them finish and store their answers.
    pub fn tasks(&self) -> TaskTracker {
        self.tasks.clone()
    }

    /// The protocol this layer applies to paths no route matches.
    pub fn protocol(&self) -> Protocol {
        Protocol::with_clock(self.store.clone(), self.policy.clone(), self.clock.clone())
            .with_keyring(self.keyring.clone())
            .with_scope_hashing(self.scope_hashing.clone())
            .with_replay_cache(self.replay_cache.clone())
            .with_path_prefix(&self.path_prefix)
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let routing = Arc::new(Routing::new(self.protocol(), self.routes.clone()));
        IdempotencyService::new(inner, routing, self.response_timeout, self.tasks.clone())
    }
}
