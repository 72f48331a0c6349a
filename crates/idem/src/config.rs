//! `idem serve`'s settings, resolved: a flag beats the environment (`IDEM_<FLAG>`, both read by
//! clap), which beats the config file (`--config FILE`), which beats the defaults; all of them
//! are declared in [`crate::settings`]. Here they are checked and turned into what the listeners,
//! the proxy and the protocol run with.

mod file;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use idem_core::replay_cache::ReplayCacheConfig;
use idem_core::{Keyring, Policy, RouteError, RoutePattern, RouteRule, Routes, ScopeSecret, ScopeSecrets, ScopeSource};

use crate::cli::{ENCRYPTION_KEYS, SCOPE_SECRET, SCOPE_SECRET_PREVIOUS, ServeArgs};
use crate::misconfigured::Misconfigured;
use crate::settings::{Resolved, RouteSettings, ServeSettings};

pub(crate) use file::ConfigError;
use file::ConfigFile;

/// What a listener allows its clients.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    /// How long a client may take to send a request's head, counted from when its connection
    /// opened or its last answer ended, and how long in all it may keep the gateway waiting for a
    /// request's body.
    pub(crate) read_timeout: Duration,
    /// Connections open at once; accepting waits while this many are open.
    pub(crate) max_connections: usize,
    /// From the shutdown signal: how long running requests (and `background` work) may take
    /// before the connections left are closed.
    pub(crate) shutdown_grace: Duration,
}

impl Default for Limits {
    /// The settings' defaults.
    fn default() -> Self {
        let defaults = ServeSettings::defaults();
        let given = "the setting has a default";
        Self {
            read_timeout: defaults.read_timeout.expect(given),
            max_connections: defaults.max_connections.expect(given),
            shutdown_grace: defaults.shutdown_grace.expect(given),
        }
    }
}

/// The most connections a listener can be asked to hold (the limit of the semaphore it counts
/// them with).
const MOST_CONNECTIONS: usize = tokio::sync::Semaphore::MAX_PERMITS;

/// How the gateway speaks to its upstream, beyond its URL.
#[derive(Clone, Debug, Default)]
pub(crate) struct UpstreamOptions {
    /// A PEM bundle of CAs trusted besides the system's (`--upstream-ca`; `https://` only).
    pub(crate) ca: Option<PathBuf>,
    /// HTTP/2 by prior knowledge (h2c) to an `http://` upstream (`--upstream-http2`).
    pub(crate) http2: bool,
    /// Send each keyed run's `Idempotency-Token`, for `idem_complete`: on a PostgreSQL store.
    pub(crate) completion_tokens: bool,
}

/// Whether the store at `url` installs `idem_complete`, with which an upstream completes a run in
/// its own transaction: PostgreSQL.
pub(crate) fn completes_with_sql(url: &str) -> bool {
    let scheme = url.split_once(':').map_or(url, |(scheme, _)| scheme);
    matches!(scheme, "postgres" | "postgresql")
}

/// The keys that seal stored answers, from `IDEM_ENCRYPTION_KEYS` (an environment variable only:
/// a flag would show them in the process list); `None` when it is unset or empty.
pub(crate) fn keyring_from_env() -> Result<Option<Keyring>, Misconfigured> {
    match std::env::var(ENCRYPTION_KEYS) {
        Ok(keys) if !keys.trim().is_empty() => {
            keys.parse()
                .map(Some)
                .map_err(|err: idem_core::KeyringError| Misconfigured {
                    flag: ENCRYPTION_KEYS,
                    reason: err.to_string(),
                })
        }
        Ok(_) | Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(Misconfigured {
            flag: ENCRYPTION_KEYS,
            reason: "is not UTF-8".to_owned(),
        }),
    }
}

/// How credential scopes are hashed, from `IDEM_SCOPE_SECRET` and `IDEM_SCOPE_SECRET_PREVIOUS`
/// (the environment only, like the sealing keys). A secret is taken as its exact bytes.
pub(crate) fn scope_secrets_from_env() -> Result<ScopeSecrets, Misconfigured> {
    let secret = |var: &'static str, value: std::ffi::OsString| {
        ScopeSecret::new(value.as_encoded_bytes()).map_err(|err| Misconfigured {
            flag: var,
            reason: err.to_string(),
        })
    };
    let current = match std::env::var_os(SCOPE_SECRET) {
        Some(value) if !value.is_empty() => Some(secret(SCOPE_SECRET, value)?),
        _ => None,
    };
    let mut secrets = ScopeSecrets::new(current);
    match std::env::var_os(SCOPE_SECRET_PREVIOUS) {
        Some(value) if value == "none" => secrets = secrets.with_previous(None),
        Some(value) if !value.is_empty() => {
            secrets = secrets.with_previous(Some(secret(SCOPE_SECRET_PREVIOUS, value)?))
        }
        _ => {}
    }
    if secrets.previous_is_current() {
        return Err(Misconfigured {
            flag: SCOPE_SECRET_PREVIOUS,
            reason: format!(
                "is the same as {SCOPE_SECRET}; set it to the secret used before (`none` if there was none)"
            ),
        });
    }
    Ok(secrets)
}

/// The shortest lease the gateway accepts.
const MIN_LEASE: Duration = Duration::from_secs(1);

/// Everything `idem serve` runs with, resolved.
#[derive(Debug)]
pub(crate) struct ServeConfig {
    pub(crate) upstream: http::Uri,
    pub(crate) listen: SocketAddr,
    pub(crate) admin_listen: SocketAddr,
    pub(crate) store: String,
    /// The policy of paths no route matches.
    pub(crate) policy: Policy,
    pub(crate) routes: Routes,
    pub(crate) limits: Limits,
    pub(crate) upstream_timeout: Duration,
    pub(crate) upstream_options: UpstreamOptions,
    pub(crate) tls_cert: Option<PathBuf>,
    pub(crate) tls_key: Option<PathBuf>,
    /// Seals stored answers (`IDEM_ENCRYPTION_KEYS`).
    pub(crate) keyring: Option<Keyring>,
    /// Mixed into the hash of credential scopes (`IDEM_SCOPE_SECRET`).
    pub(crate) scope_secrets: ScopeSecrets,
    /// The replay cache's size.
    pub(crate) replay_cache: ReplayCacheConfig,
    origins: Origins,
}

/// Which settings the file gave, to say where a setting that cannot work came from.
#[derive(Debug)]
struct Origins {
    file: Option<ConfigFile>,
    from_file: BTreeSet<&'static str>,
}

impl ServeConfig {
    /// The settings of `args`, with its config file's under them and the defaults under both.
    /// Errors are [`Misconfigured`] or [`ConfigError`]: the operator's to fix (exit 2).
    pub(crate) fn load(args: ServeArgs) -> anyhow::Result<Self> {
        let (file, file_settings) = match &args.config {
            Some(path) => {
                let (file, settings) = ConfigFile::read(path)?;
                (Some(file), settings)
            }
            None => (None, ServeSettings::default()),
        };
        let (settings, from_file) = args.settings.or_file(file_settings);
        let origins = Origins { file, from_file };
        let settings = settings.resolve()?;
        let policy = settings.policy();
        check_for_gateway(&policy).map_err(|err| origins.place(err))?;
        gateway_timeouts(&settings).map_err(|err| origins.place(err))?;
        let limits = limits(&settings).map_err(|err| origins.place(err))?;
        let routes = match &origins.file {
            Some(file) => routes(file, &settings.route, &policy)?,
            None => Routes::new(),
        }
        .with_readings(settings.path_readings);
        let keyring = keyring_from_env()?;
        let scope_secrets = scope_secrets_from_env()?;
        let replay_cache = settings.replay_cache();
        let Resolved {
            upstream,
            listen,
            admin_listen,
            store,
            upstream_timeout,
            upstream_ca,
            upstream_http2,
            tls_cert,
            tls_key,
            ..
        } = settings;
        let completion_tokens = completes_with_sql(&store);
        let in_transaction = policy.in_transaction
            || routes
                .iter()
                .any(|route| matches!(&route.rule, RouteRule::Protect(policy) if policy.in_transaction));
        if in_transaction && !completion_tokens {
            return Err(Misconfigured {
                flag: "in-transaction",
                reason: format!(
                    "needs a PostgreSQL store, in whose database the upstream completes its runs with idem_complete; the store is {}",
                    idem_core::redact_url(&store)
                ),
            }
            .into());
        }
        Ok(Self {
            upstream,
            listen,
            admin_listen,
            store,
            policy,
            routes,
            limits,
            upstream_timeout,
            upstream_options: UpstreamOptions {
                ca: upstream_ca,
                http2: upstream_http2,
                completion_tokens,
            },
            tls_cert,
            tls_key,
            keyring,
            scope_secrets,
            replay_cache,
            origins,
        })
    }

    /// An error about a setting, placed in the config file if that is where the setting came from.
    pub(crate) fn place(&self, err: Misconfigured) -> anyhow::Error {
        self.origins.place(err)
    }
}

impl Origins {
    fn place(&self, err: Misconfigured) -> anyhow::Error {
        match &self.file {
            Some(file) if self.from_file.contains(err.flag) => file.error_about(err.flag, &err.reason).into(),
            _ => err.into(),
        }
    }
}

fn refuse<T>(flag: &'static str, reason: &str) -> Result<T, Misconfigured> {
    Err(Misconfigured {
        flag,
        reason: reason.to_owned(),
    })
}

/// What the gateway refuses in a policy beyond [`Policy::validate`].
fn check_for_gateway(policy: &Policy) -> Result<(), Misconfigured> {
    if policy.scope == ScopeSource::Extension {
        return refuse(
            "scope",
            "extension is set by an application's own middleware, which the gateway does not have: every caller would be anonymous; use credential, header:NAME or none",
        );
    }
    if policy.lease < MIN_LEASE {
        return refuse(
            "lease",
            "must be at least 1s: the lease is renewed over the network every third of it, and a shorter one expires under a running request",
        );
    }
    policy.validate().map_err(|err| Misconfigured {
        flag: err.setting,
        reason: err.reason,
    })
}

/// The gateway's own timeouts, bounded as the policy's are ([`Policy::MAX_TIMEOUT`]): each is a
/// deadline added to the monotonic clock, and an upload, an upstream answer or a shutdown that
/// takes longer than a day is a fault to end, not a wait to keep. The replay cache's `max-age` is
/// the bound on how long a lost delete notification can leave an answer replayed from memory: a
/// day at most, like them (`0s` turns the cache off).
fn gateway_timeouts(settings: &Resolved) -> Result<(), Misconfigured> {
    if settings.replay_cache_max_age > Policy::MAX_TIMEOUT {
        return refuse(
            "replay-cache-max-age",
            "must be at most 1d (one day): it bounds how long an answer deleted elsewhere can still be replayed from this instance's memory when the delete's notification is lost",
        );
    }
    if settings.upstream_timeout.is_zero() {
        return refuse(
            "upstream-timeout",
            "must be longer than zero, or every request would end in 504 before the upstream could answer",
        );
    }
    Policy::within_max_timeout(&[
        ("upstream-timeout", settings.upstream_timeout),
        ("read-timeout", settings.read_timeout),
        ("shutdown-grace", settings.shutdown_grace),
    ])
    .map_err(|err| Misconfigured {
        flag: err.setting,
        reason: err.reason,
    })
}

/// What the gateway's listeners allow their clients.
fn limits(settings: &Resolved) -> Result<Limits, Misconfigured> {
    let limits = Limits {
        read_timeout: settings.read_timeout,
        max_connections: settings.max_connections,
        shutdown_grace: settings.shutdown_grace,
    };
    if limits.read_timeout.is_zero() {
        return refuse(
            "read-timeout",
            "must be longer than zero, or no client could ever send a request",
        );
    }
    if limits.max_connections == 0 {
        return refuse("max-connections", "must be at least 1, or no client could ever connect");
    }
    if limits.max_connections > MOST_CONNECTIONS {
        return refuse("max-connections", &format!("must be at most {MOST_CONNECTIONS}"));
    }
    if limits.shutdown_grace.is_zero() {
        return refuse(
            "shutdown-grace",
            "must be longer than zero, or a shutdown would cut every running request and lose its answer",
        );
    }
    Ok(limits)
}

/// The file's `[[route]]` tables, each over the gateway's `policy`.
fn routes(file: &ConfigFile, tables: &[RouteSettings], policy: &Policy) -> Result<Routes, ConfigError> {
    let mut routes = Routes::new();
    for table in tables {
        let at = table.path.span().start;
        let path = table.path.get_ref();
        let refuse = |message: String| file.error_at(at, format!("route {path:?}: {message}"));
        let pattern: RoutePattern = path.parse().map_err(|err| refuse(format!("{err}")))?;
        let rule = match table.enabled {
            Some(false) => {
                let ignored = table.given();
                if !ignored.is_empty() {
                    return Err(refuse(format!(
                        "enabled = false passes the route through untouched, so {} would do nothing: remove them or the enabled line",
                        ignored.join(", ")
                    )));
                }
                RouteRule::PassThrough
            }
            _ => {
                let policy = table.over(policy);
                check_for_gateway(&policy)
                    .map_err(|err| refuse(err.to_string().trim_start_matches("--").to_owned()))?;
                RouteRule::Protect(policy)
            }
        };
        routes.push(pattern, rule).map_err(|err| match err {
            RouteError::Shadowed { by, .. } => refuse(format!(
                "can never match: every path it matches is matched first by the route {by:?} above it; put the narrower route first"
            )),
            other => refuse(other.to_string()),
        })?;
    }
    Ok(routes)
}
