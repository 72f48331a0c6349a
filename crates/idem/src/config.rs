//! `idem serve`'s settings, from four places: a flag beats the environment (`IDEM_<FLAG>`, both
//! read by clap), which beats the config file (`--config FILE`), which beats the defaults. The
//! defaults are here ([`Defaults`]) and, for the protocol's settings, in `Policy::default()`;
//! `--help` shows them from there.

pub(crate) mod de;
mod file;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use idem_core::{
    Keyring, PathReadings, Policy, RouteError, RoutePattern, RouteRule, Routes, ScopeSecret, ScopeSecrets, ScopeSource,
};

use crate::cli::{Misconfigured, RouteSettings, ServeArgs, ServeSettings};
use crate::proxy::UpstreamOptions;
use crate::serve::Limits;
use crate::units::{format_duration, format_size};

pub(crate) use file::ConfigError;
use file::ConfigFile;

/// The defaults of the gateway's own settings; the protocol's are `Policy::default()`.
pub(crate) struct Defaults;

impl Defaults {
    pub(crate) const LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8080);
    pub(crate) const ADMIN_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9090);
    pub(crate) const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);
    pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(30);
    pub(crate) const MAX_CONNECTIONS: usize = 10_000;
    pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
    pub(crate) const UPSTREAM_HTTP2: bool = false;

    /// Each defaulted setting's clap id and its default as a flag would take it, for `--help`.
    pub(crate) fn shown() -> Vec<(&'static str, String)> {
        let policy = Policy::default();
        let methods: Vec<&str> = policy.methods.iter().map(http::Method::as_str).collect();
        vec![
            ("listen", Self::LISTEN.to_string()),
            ("admin_listen", Self::ADMIN_LISTEN.to_string()),
            ("store", crate::stores::DEFAULT_STORE.to_owned()),
            ("ttl", format_duration(policy.ttl)),
            ("tombstone_ttl", format_duration(policy.tombstone_ttl)),
            ("lease", format_duration(policy.lease)),
            ("run_timeout", format_duration(policy.run_timeout)),
            ("wait", format_duration(policy.wait)),
            ("scope", policy.scope.to_string()),
            ("anonymous", policy.anonymous.to_string()),
            ("expire_by_key_time", policy.expire_by_key_time.to_string()),
            ("missing_key", policy.missing_key.to_string()),
            ("methods", methods.join(",")),
            ("max_body", format_size(policy.max_body)),
            ("max_stored_body", format_size(policy.max_stored_body)),
            ("store_5xx", policy.store_5xx.to_string()),
            ("fail_open", policy.fail_open.to_string()),
            ("upstream_timeout", format_duration(Self::UPSTREAM_TIMEOUT)),
            ("read_timeout", format_duration(Self::READ_TIMEOUT)),
            ("max_connections", Self::MAX_CONNECTIONS.to_string()),
            ("shutdown_grace", format_duration(Self::SHUTDOWN_GRACE)),
            ("upstream_http2", Self::UPSTREAM_HTTP2.to_string()),
            ("path_readings", PathReadings::default().to_string()),
        ]
    }
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

/// The environment variable of the sealing keys.
pub(crate) const ENCRYPTION_KEYS: &str = "IDEM_ENCRYPTION_KEYS";

/// The environment variable of the secret mixed into the hash of credential scopes.
pub(crate) const SCOPE_SECRET: &str = "IDEM_SCOPE_SECRET";
/// The environment variable of the secret used before `IDEM_SCOPE_SECRET` (`none`: there was
/// none), kept for one retention after a change so that keys used before it still replay.
pub(crate) const SCOPE_SECRET_PREVIOUS: &str = "IDEM_SCOPE_SECRET_PREVIOUS";

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
    origins: Origins,
}

/// Which settings the file gave, to say where a setting that cannot work came from.
#[derive(Debug)]
struct Origins {
    file: Option<ConfigFile>,
    from_file: BTreeSet<String>,
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
        let mut origins = Origins {
            file,
            from_file: BTreeSet::new(),
        };
        let settings = merge(args.settings, file_settings, &mut origins.from_file);
        let upstream = settings.upstream.clone().ok_or_else(|| Misconfigured {
            flag: "upstream",
            reason: "is required: give the flag, IDEM_UPSTREAM, or `upstream` in the config file".to_owned(),
        })?;
        let policy = policy(&settings).map_err(|err| origins.place(err))?;
        let limits = limits(&settings).map_err(|err| origins.place(err))?;
        let routes = match &origins.file {
            Some(file) => routes(file, &settings.route, &policy)?,
            None => Routes::new(),
        }
        .with_readings(settings.path_readings.unwrap_or_default());
        let keyring = keyring_from_env()?;
        let scope_secrets = scope_secrets_from_env()?;
        Ok(Self {
            upstream,
            listen: settings.listen.unwrap_or(Defaults::LISTEN),
            admin_listen: settings.admin_listen.unwrap_or(Defaults::ADMIN_LISTEN),
            store: settings
                .store
                .unwrap_or_else(|| crate::stores::DEFAULT_STORE.to_owned()),
            policy,
            routes,
            limits,
            upstream_timeout: settings.upstream_timeout.unwrap_or(Defaults::UPSTREAM_TIMEOUT),
            upstream_options: UpstreamOptions {
                ca: settings.upstream_ca,
                http2: settings.upstream_http2.unwrap_or(Defaults::UPSTREAM_HTTP2),
            },
            tls_cert: settings.tls_cert,
            tls_key: settings.tls_key,
            keyring,
            scope_secrets,
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

/// `flags` (and the environment), with the file's settings where they give none; records which
/// settings came from the file.
fn merge(flags: ServeSettings, file: ServeSettings, from_file: &mut BTreeSet<String>) -> ServeSettings {
    macro_rules! merged {
        ($($setting:ident),* $(,)?) => {
            ServeSettings {
                $($setting: match flags.$setting {
                    Some(value) => Some(value),
                    None => {
                        if file.$setting.is_some() {
                            from_file.insert(stringify!($setting).replace('_', "-"));
                        }
                        file.$setting
                    }
                },)*
                route: file.route,
            }
        };
    }
    merged!(
        upstream,
        listen,
        admin_listen,
        store,
        ttl,
        tombstone_ttl,
        lease,
        run_timeout,
        wait,
        scope,
        anonymous,
        expire_by_key_time,
        missing_key,
        methods,
        max_body,
        max_stored_body,
        store_5xx,
        fail_open,
        upstream_timeout,
        read_timeout,
        max_connections,
        shutdown_grace,
        upstream_ca,
        upstream_http2,
        tls_cert,
        tls_key,
        path_readings,
    )
}

/// Sets each named field of `target` to the value `source` gives for it, where it gives one.
macro_rules! overlay {
    ($target:ident, $source:ident; $($setting:ident),* $(,)?) => {
        $(if let Some(value) = $source.$setting.clone() {
            $target.$setting = value;
        })*
    };
}

fn refuse<T>(flag: &'static str, reason: &str) -> Result<T, Misconfigured> {
    Err(Misconfigured {
        flag,
        reason: reason.to_owned(),
    })
}

/// The gateway's policy for paths no route matches.
fn policy(settings: &ServeSettings) -> Result<Policy, Misconfigured> {
    let mut policy = Policy::default();
    overlay!(policy, settings;
        ttl,
        tombstone_ttl,
        lease,
        run_timeout,
        wait,
        scope,
        anonymous,
        expire_by_key_time,
        missing_key,
        methods,
        max_body,
        max_stored_body,
        store_5xx,
        fail_open,
    );
    check_for_gateway(&policy)?;
    Ok(policy)
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

/// What the gateway's listeners allow their clients.
fn limits(settings: &ServeSettings) -> Result<Limits, Misconfigured> {
    let limits = Limits {
        read_timeout: settings.read_timeout.unwrap_or(Defaults::READ_TIMEOUT),
        max_connections: settings.max_connections.unwrap_or(Defaults::MAX_CONNECTIONS),
        shutdown_grace: settings.shutdown_grace.unwrap_or(Defaults::SHUTDOWN_GRACE),
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
    if limits.max_connections > crate::serve::MOST_CONNECTIONS {
        return refuse(
            "max-connections",
            &format!("must be at most {}", crate::serve::MOST_CONNECTIONS),
        );
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
                let ignored = table.settings_given();
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

impl RouteSettings {
    /// `policy` with this route's settings over it.
    fn over(&self, policy: &Policy) -> Policy {
        let mut policy = policy.clone();
        overlay!(policy, self;
            methods,
            ttl,
            tombstone_ttl,
            missing_key,
            scope,
            max_body,
            max_stored_body,
            store_5xx,
            run_timeout
        );
        policy
    }

    /// The names of the settings this route gives, besides `path` and `enabled`.
    fn settings_given(&self) -> Vec<&'static str> {
        let given = [
            ("methods", self.methods.is_some()),
            ("ttl", self.ttl.is_some()),
            ("tombstone-ttl", self.tombstone_ttl.is_some()),
            ("missing-key", self.missing_key.is_some()),
            ("scope", self.scope.is_some()),
            ("max-body", self.max_body.is_some()),
            ("max-stored-body", self.max_stored_body.is_some()),
            ("store-5xx", self.store_5xx.is_some()),
            ("run-timeout", self.run_timeout.is_some()),
        ];
        given
            .into_iter()
            .filter(|(_, set)| *set)
            .map(|(name, _)| name)
            .collect()
    }
}
