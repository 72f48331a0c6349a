//! The settings of `idem serve`, each declared once: its flag, its `IDEM_` environment variable,
//! its config-file key, its default, its `--help` text and whether a `[[route]]` may override it.
//! The flags (clap), the file's keys (serde), the layering, the defaults, the defaults `--help`
//! shows and the `[[route]]` tables are all made from the one list at the bottom of this file:
//! adding a setting is adding one entry there.

pub(crate) mod de;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use idem_core::replay_cache::ReplayCacheConfig;
use idem_core::{AnonymousPolicy, KeyTimeFormats, MissingKeyPolicy, PathReadings, Policy, ScopeSource};

use crate::misconfigured::Misconfigured;
use crate::units::{format_duration, format_size, parse_duration, parse_method, parse_size};

/// Declares the settings. Each entry is
///
/// ```text
/// /// The help text (the doc comment, as clap shows it).
/// name: Type {
///     flag: "kebab-name",   // --kebab-name, and `kebab-name` in the config file
///     env: "IDEM_NAME",
///     default: policy,      // `Policy::default().name`, and the value goes into the policy;
///                           // or `(expression)`, `none` (no value is fine), `required`
///     route: true,          // whether a `[[route]]` table may set it (a `Policy` field only:
///                           // `RouteSettings::over` does not compile for another)
///     arg: [clap attributes],       // optional: how the flag parses
///     file: [serde attributes],     // optional: how the file's value parses
///     shown: function,              // how `--help` writes the default (`fn(&Type) -> String`)
/// },
/// ```
///
/// and the entries' order is `--help`'s.
macro_rules! settings {
    (
        $(
            $(#[doc = $doc:literal])*
            $name:ident: $ty:ty {
                flag: $flag:literal,
                env: $env:literal,
                default: $default:tt,
                route: $route:tt,
                $(arg: [$($arg:tt)*],)?
                $(file: [$($file:tt)*],)?
                $(shown: $shown:path,)?
            },
        )*
    ) => {
        /// Every setting of `idem serve` as one source gives it: the flags (each also read from
        /// its `IDEM_` variable, both by clap), or the config file (by the flags' names). `None`:
        /// this source leaves the setting to the next one; [`ServeSettings::defaults`] comes last.
        #[derive(Debug, Default, clap::Args, serde::Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub(crate) struct ServeSettings {
            $(
                $(#[doc = $doc])*
                #[arg(long = $flag, env = $env, $($($arg)*)?)]
                #[serde(rename = $flag, $($($file)*)?)]
                pub(crate) $name: Option<$ty>,
            )*
            /// Rules by path, in the config file only: `[[route]]` tables.
            #[arg(skip)]
            pub(crate) route: Vec<RouteSettings>,
        }

        /// One `[[route]]` table of the config file: which paths, and the settings that differ
        /// there from the gateway's (any setting left out is the gateway's).
        #[derive(Debug, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub(crate) struct RouteSettings {
            /// `/exact`, `/with/{param}` segments, or a `/prefix/*`.
            pub(crate) path: toml::Spanned<String>,
            /// `false`: pass the route's requests through untouched.
            #[serde(default)]
            pub(crate) enabled: Option<bool>,
            $(
                #[cfg($route)]
                $(#[doc = $doc])*
                #[serde(default, rename = $flag, $($($file)*)?)]
                pub(crate) $name: Option<$ty>,
            )*
        }

        /// Every setting of `idem serve` with the value it runs with: the one given, or its
        /// default (a setting without one stays an `Option`).
        #[derive(Debug)]
        pub(crate) struct Resolved {
            $(
                $(#[doc = $doc])*
                pub(crate) $name: settings!(@resolved $default, $ty),
            )*
            /// The config file's `[[route]]` tables.
            pub(crate) route: Vec<RouteSettings>,
        }

        impl ServeSettings {
            /// The defaults, as a source of their own: the last one asked.
            pub(crate) fn defaults() -> Self {
                let policy = Policy::default();
                Self {
                    $($name: settings!(@default $default, policy, $name),)*
                    route: Vec::new(),
                }
            }

            /// These settings (the flags' and the environment's), with the config file's where
            /// these give none; and the names of the settings taken from the file.
            pub(crate) fn or_file(self, file: Self) -> (Self, BTreeSet<&'static str>) {
                let mut from_file = BTreeSet::new();
                let settings = Self {
                    $($name: match self.$name {
                        Some(value) => Some(value),
                        None => {
                            if file.$name.is_some() {
                                from_file.insert($flag);
                            }
                            file.$name
                        }
                    },)*
                    route: file.route,
                };
                (settings, from_file)
            }

            /// These settings with the defaults under them; a required setting that is missing
            /// is an error.
            pub(crate) fn resolve(self) -> Result<Resolved, Misconfigured> {
                let defaults = Self::defaults();
                Ok(Resolved {
                    $($name: settings!(@resolve $default, self.$name, defaults.$name, $flag, $env),)*
                    route: self.route,
                })
            }

            /// Each default by its flag's clap id, as `--help` shows it (`None`: it has no
            /// `shown`, which a test forbids).
            pub(crate) fn shown_defaults() -> Vec<(&'static str, Option<String>)> {
                let defaults = Self::defaults();
                let mut shown = Vec::new();
                $(
                    if let Some(value) = &defaults.$name {
                        let show = None::<fn(&$ty) -> String> $(.or(Some($shown as fn(&$ty) -> String)))?;
                        shown.push((stringify!($name), show.map(|show| show(value))));
                    }
                )*
                shown
            }
        }

        impl Resolved {
            /// The replay cache's size.
            pub(crate) fn replay_cache(&self) -> ReplayCacheConfig {
                ReplayCacheConfig {
                    entries: self.replay_cache_entries,
                    bytes: self.replay_cache_bytes,
                    max_age: self.replay_cache_max_age,
                }
            }

            /// The protocol's settings as a [`Policy`] (the rest of it at its defaults).
            pub(crate) fn policy(&self) -> Policy {
                let mut policy = Policy::default();
                $(settings!(@policy $default, policy.$name = self.$name.clone());)*
                policy
            }
        }

        impl RouteSettings {
            /// `policy` with this route's settings over it.
            pub(crate) fn over(&self, policy: &Policy) -> Policy {
                let mut policy = policy.clone();
                $(
                    #[cfg($route)]
                    if let Some(value) = &self.$name {
                        policy.$name = value.clone();
                    }
                )*
                policy
            }

            /// The names of the settings this route gives, besides `path` and `enabled`.
            pub(crate) fn given(&self) -> Vec<&'static str> {
                let mut given = Vec::new();
                $(
                    #[cfg($route)]
                    if self.$name.is_some() {
                        given.push($flag);
                    }
                )*
                given
            }
        }
    };

    // The type a setting resolves to.
    (@resolved none, $ty:ty) => { Option<$ty> };
    (@resolved $default:tt, $ty:ty) => { $ty };

    // A setting's default, as a source gives it.
    (@default required, $policy:ident, $name:ident) => { None };
    (@default none, $policy:ident, $name:ident) => { None };
    (@default policy, $policy:ident, $name:ident) => { Some($policy.$name.clone()) };
    (@default ($default:expr), $policy:ident, $name:ident) => { Some($default) };

    // A setting's value: the one given, else its default.
    (@resolve required, $given:expr, $default:expr, $flag:literal, $env:literal) => {
        $given.ok_or_else(|| Misconfigured {
            flag: $flag,
            reason: concat!("is required: give the flag, ", $env, ", or `", $flag, "` in the config file").to_owned(),
        })?
    };
    (@resolve none, $given:expr, $default:expr, $flag:literal, $env:literal) => { $given };
    (@resolve $kind:tt, $given:expr, $default:expr, $flag:literal, $env:literal) => {
        $given.or($default).expect("a setting with a default has one")
    };

    // Only the protocol's settings go into the policy.
    (@policy policy, $assign:expr) => { $assign };
    (@policy $kind:tt, $assign:expr) => { () };
}

/// How `--help` writes defaults.
mod shown {
    use std::fmt::Display;
    use std::time::Duration;

    pub(super) fn duration(duration: &Duration) -> String {
        super::format_duration(*duration)
    }

    pub(super) fn size(bytes: &usize) -> String {
        super::format_size(*bytes)
    }

    pub(super) fn text<T: Display>(value: &T) -> String {
        value.to_string()
    }

    #[expect(
        clippy::ptr_arg,
        reason = "a `shown` function takes `&Type`, and this type is a `Vec`"
    )]
    pub(super) fn methods(methods: &Vec<http::Method>) -> String {
        let names: Vec<&str> = methods.iter().map(http::Method::as_str).collect();
        names.join(",")
    }
}

/// Where the gateway listens by default.
const LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8080);
/// Where the admin listener listens by default.
const ADMIN_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9090);

settings! {
    /// The upstream every request is forwarded to, such as http://127.0.0.1:3000 (required).
    upstream: http::Uri {
        flag: "upstream", env: "IDEM_UPSTREAM", default: required, route: false,
        file: [deserialize_with = "de::parsed"],
    },
    /// Where the gateway listens.
    listen: SocketAddr {
        flag: "listen", env: "IDEM_LISTEN", default: (LISTEN), route: false,
        file: [deserialize_with = "de::parsed"],
        shown: shown::text,
    },
    /// Where /metrics, /healthz and /readyz are served.
    admin_listen: SocketAddr {
        flag: "admin-listen", env: "IDEM_ADMIN_LISTEN", default: (ADMIN_LISTEN), route: false,
        file: [deserialize_with = "de::parsed"],
        shown: shown::text,
    },
    /// The store: sqlite://PATH, postgres://…, redis://HOST:PORT, redis+sentinel://S1:P1,S2:P2,…/PRIMARY or redis+cluster://H1:P1,H2:P2,….
    store: String {
        flag: "store", env: "IDEM_STORE", default: (crate::stores::DEFAULT_STORE.to_owned()), route: false,
        shown: shown::text,
    },
    /// How long an answer is replayable.
    ttl: Duration {
        flag: "ttl", env: "IDEM_TTL", default: policy, route: true,
        arg: [value_parser = parse_duration],
        file: [deserialize_with = "de::duration"],
        shown: shown::duration,
    },
    /// How long an expired key still answers key-expired.
    tombstone_ttl: Duration {
        flag: "tombstone-ttl", env: "IDEM_TOMBSTONE_TTL", default: policy, route: true,
        arg: [value_parser = parse_duration],
        file: [deserialize_with = "de::duration"],
        shown: shown::duration,
    },
    /// The lease of a running request; renewed while it runs.
    lease: Duration {
        flag: "lease", env: "IDEM_LEASE", default: policy, route: false,
        arg: [value_parser = parse_duration],
        file: [deserialize_with = "de::duration"],
        shown: shown::duration,
    },
    /// How long a request may run before it is given up and its key released as unknown (the
    /// retry runs, marked Idempotency-Recovered), so a hung upstream never wedges its key.
    run_timeout: Duration {
        flag: "run-timeout", env: "IDEM_RUN_TIMEOUT", default: policy, route: true,
        arg: [value_parser = parse_duration],
        file: [deserialize_with = "de::duration"],
        shown: shown::duration,
    },
    /// How long a copy waits for the first request before 409 key-in-flight.
    wait: Duration {
        flag: "wait", env: "IDEM_WAIT", default: policy, route: false,
        arg: [value_parser = parse_duration],
        file: [deserialize_with = "de::duration"],
        shown: shown::duration,
    },
    /// Who the caller is: credential, none or header:NAME (not a header that carries a
    /// credential, such as Cookie or X-Api-Key).
    scope: ScopeSource {
        flag: "scope", env: "IDEM_SCOPE", default: policy, route: true,
        file: [deserialize_with = "de::parsed"],
        shown: shown::text,
    },
    /// Keyed requests from callers without a credential (or scope header): allow (they share the
    /// anonymous scope) or reject (401 credential-missing).
    anonymous: AnonymousPolicy {
        flag: "anonymous", env: "IDEM_ANONYMOUS", default: policy, route: false,
        file: [deserialize_with = "de::parsed"],
        shown: shown::text,
    },
    /// Key formats whose embedded time expires a key older than --ttl on first sight: uuid7,
    /// ulid (comma-separated) or off. ULIDs have no version marker, so any 26-character Crockford
    /// string reads as one: add ulid only if your clients send ULIDs.
    expire_by_key_time: KeyTimeFormats {
        flag: "expire-by-key-time", env: "IDEM_EXPIRE_BY_KEY_TIME", default: policy, route: false,
        file: [deserialize_with = "de::parsed"],
        shown: shown::text,
    },
    /// Keyless requests: allow, require, grace:<RFC 3339 date> or fingerprint:<duration>.
    missing_key: MissingKeyPolicy {
        flag: "missing-key", env: "IDEM_MISSING_KEY", default: policy, route: true,
        file: [deserialize_with = "de::parsed"],
        shown: shown::text,
    },
    /// The methods the protocol applies to, comma-separated.
    methods: Vec<http::Method> {
        flag: "methods", env: "IDEM_METHODS", default: policy, route: true,
        arg: [value_delimiter = ',', value_parser = parse_method],
        file: [deserialize_with = "de::methods"],
        shown: shown::methods,
    },
    /// The largest keyed request body (larger: 413).
    max_body: usize {
        flag: "max-body", env: "IDEM_MAX_BODY", default: policy, route: true,
        arg: [value_parser = parse_size],
        file: [deserialize_with = "de::size"],
        shown: shown::size,
    },
    /// The largest answer stored whole; larger answers stream through and are stored compact.
    max_stored_body: usize {
        flag: "max-stored-body", env: "IDEM_MAX_STORED_BODY", default: policy, route: true,
        arg: [value_parser = parse_size],
        file: [deserialize_with = "de::size"],
        shown: shown::size,
    },
    /// Store 5xx answers instead of letting a retry run again.
    store_5xx: bool {
        flag: "store-5xx", env: "IDEM_STORE_5XX", default: policy, route: true,
        arg: [num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = BoolishValueParser::new()],
        shown: shown::text,
    },
    /// The upstream completes every keyed request in its own PostgreSQL transaction with
    /// `idem_complete` and has no effect outside it: a run that ends without completing is then
    /// forgotten (its retry runs unflagged), and so is one whose gateway died before the upstream
    /// committed.
    in_transaction: bool {
        flag: "in-transaction", env: "IDEM_IN_TRANSACTION", default: policy, route: true,
        arg: [num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = BoolishValueParser::new()],
        shown: shown::text,
    },
    /// The most answers kept in memory to answer replays without a store round trip (0 turns
    /// the cache off). An entry answers exactly as the store's record would, until the record
    /// expires; a delete anywhere reaches every gateway's cache through the store's notification
    /// channel.
    replay_cache_entries: usize {
        flag: "replay-cache-entries", env: "IDEM_REPLAY_CACHE_ENTRIES", default: (ReplayCacheConfig::DEFAULT.entries), route: false,
        shown: shown::text,
    },
    /// The most bytes of answers the replay cache keeps; an answer over an eighth of it is not kept.
    replay_cache_bytes: usize {
        flag: "replay-cache-bytes", env: "IDEM_REPLAY_CACHE_BYTES", default: (ReplayCacheConfig::DEFAULT.bytes), route: false,
        arg: [value_parser = parse_size],
        file: [deserialize_with = "de::size"],
        shown: shown::size,
    },
    /// How long a cached answer is used before it is read from the store again: the longest a
    /// delete whose notification was lost unnoticed leaves an answer replayed from memory.
    replay_cache_max_age: Duration {
        flag: "replay-cache-max-age", env: "IDEM_REPLAY_CACHE_MAX_AGE", default: (ReplayCacheConfig::DEFAULT.max_age), route: false,
        arg: [value_parser = parse_duration],
        file: [deserialize_with = "de::duration"],
        shown: shown::duration,
    },
    /// Forward requests unprotected when the store is down, instead of 503.
    fail_open: bool {
        flag: "fail-open", env: "IDEM_FAIL_OPEN", default: policy, route: false,
        arg: [num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = BoolishValueParser::new()],
        shown: shown::text,
    },
    /// How long a client waits for the upstream before 504; the gateway keeps waiting and stores
    /// the answer for the retry.
    upstream_timeout: Duration {
        flag: "upstream-timeout", env: "IDEM_UPSTREAM_TIMEOUT", default: (Duration::from_secs(30)), route: false,
        arg: [value_parser = parse_duration],
        file: [deserialize_with = "de::duration"],
        shown: shown::duration,
    },
    /// How long a client may take to send a request's head (counted from when its connection
    /// opened or went idle, so an idle connection is closed after it too), and how long in all it
    /// may keep the gateway waiting for the body (a keyed body cut off by it is 400
    /// body-incomplete, nothing claimed).
    read_timeout: Duration {
        flag: "read-timeout", env: "IDEM_READ_TIMEOUT", default: (Duration::from_secs(30)), route: false,
        arg: [value_parser = parse_duration],
        file: [deserialize_with = "de::duration"],
        shown: shown::duration,
    },
    /// The most client connections open at once; further connections wait in the listen queue
    /// until one closes.
    max_connections: usize {
        flag: "max-connections", env: "IDEM_MAX_CONNECTIONS", default: (10_000), route: false,
        shown: shown::text,
    },
    /// On SIGTERM: how long running requests may take to finish and store their answers before
    /// the gateway closes what is left and exits.
    shutdown_grace: Duration {
        flag: "shutdown-grace", env: "IDEM_SHUTDOWN_GRACE", default: (Duration::from_secs(30)), route: false,
        arg: [value_parser = parse_duration],
        file: [deserialize_with = "de::duration"],
        shown: shown::duration,
    },
    /// A PEM bundle of CA certificates trusted for an https:// upstream, besides the system's; a
    /// server certificate that is one of them byte for byte is accepted as pinned (a self-signed
    /// `openssl req -x509` certificate), if it names the upstream and is valid now.
    upstream_ca: PathBuf {
        flag: "upstream-ca", env: "IDEM_UPSTREAM_CA", default: none, route: false,
        arg: [value_name = "FILE"],
    },
    /// Speak HTTP/2 by prior knowledge (h2c) to an http:// upstream. Over https:// HTTP/2 is
    /// negotiated by ALPN without asking.
    upstream_http2: bool {
        flag: "upstream-http2", env: "IDEM_UPSTREAM_HTTP2", default: (false), route: false,
        arg: [num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = BoolishValueParser::new()],
        shown: shown::text,
    },
    /// Serve clients over TLS with this PEM certificate chain (the server's first); needs
    /// --tls-key. ALPN offers h2 and http/1.1.
    tls_cert: PathBuf {
        flag: "tls-cert", env: "IDEM_TLS_CERT", default: none, route: false,
        arg: [value_name = "FILE"],
    },
    /// The PEM private key of --tls-cert.
    tls_key: PathBuf {
        flag: "tls-key", env: "IDEM_TLS_KEY", default: none, route: false,
        arg: [value_name = "FILE"],
    },
    /// How the upstream reads paths, besides as sent and normalised (percent-decoded, dot
    /// segments removed, slashes merged, a trailing slash ignored), which routes always match:
    /// standard, or case-insensitive and/or strip-params (comma-separated) for upstreams that
    /// route case-insensitively (ASP.NET) or drop `;params` (Tomcat).
    path_readings: PathReadings {
        flag: "path-readings", env: "IDEM_PATH_READINGS", default: (PathReadings::default()), route: false,
        file: [deserialize_with = "de::parsed"],
        shown: shown::text,
    },
}

#[cfg(test)]
mod tests {
    use clap::Args as _;

    use super::*;

    #[test]
    fn each_flag_is_its_name_and_reads_idem_and_its_name() {
        let serve = ServeSettings::augment_args(clap::Command::new("serve"));
        assert!(serve.get_arguments().any(|arg| arg.get_id() == "upstream_timeout"));
        for arg in serve.get_arguments() {
            let id = arg.get_id().as_str();
            assert_eq!(arg.get_long(), Some(id.replace('_', "-").as_str()), "{id}");
            let env = arg.get_env().and_then(|env| env.to_str());
            assert_eq!(env, Some(format!("IDEM_{}", id.to_ascii_uppercase()).as_str()), "{id}");
        }
    }

    #[test]
    fn the_defaults_resolve_once_the_upstream_is_given() {
        let err = ServeSettings::default()
            .resolve()
            .expect_err("the upstream is required");
        assert_eq!(err.flag, "upstream");
        let given = ServeSettings {
            upstream: Some("http://127.0.0.1:3000".parse().unwrap()),
            ..ServeSettings::default()
        };
        let resolved = given
            .resolve()
            .expect("everything else has a default or may be left out");
        assert_eq!(resolved.listen, LISTEN);
        assert_eq!(resolved.upstream_ca, None);
        let policy = Policy::default();
        assert_eq!((resolved.ttl, resolved.methods), (policy.ttl, policy.methods));
    }

    #[test]
    fn the_file_is_under_the_flags_and_names_what_it_gave() {
        let flags = ServeSettings {
            ttl: Some(Duration::from_secs(60)),
            ..ServeSettings::default()
        };
        let file: ServeSettings = toml::from_str("ttl = \"1h\"\nwait = \"5s\"\n").unwrap();
        let (settings, from_file) = flags.or_file(file);
        assert_eq!(settings.ttl, Some(Duration::from_secs(60)));
        assert_eq!(settings.wait, Some(Duration::from_secs(5)));
        assert_eq!(from_file.into_iter().collect::<Vec<_>>(), ["wait"]);
    }

    #[test]
    fn a_route_sets_only_the_policy_settings_it_names() {
        let route: RouteSettings =
            toml::from_str("path = \"/pay\"\nttl = \"1s\"\nstore-5xx = true\nmissing-key = \"require\"\n").unwrap();
        assert_eq!(route.given(), ["ttl", "missing-key", "store-5xx"]);
        let gateway = Policy {
            wait: Duration::from_secs(3),
            ..Policy::default()
        };
        let policy = route.over(&gateway);
        assert_eq!(policy.ttl, Duration::from_secs(1));
        assert!(policy.store_5xx);
        assert_eq!(policy.missing_key, MissingKeyPolicy::Require);
        assert_eq!(policy.wait, gateway.wait, "what the route leaves out is the gateway's");
        let err = toml::from_str::<RouteSettings>("path = \"/pay\"\nlease = \"5s\"\n").unwrap_err();
        assert!(err.message().contains("unknown field `lease`"), "{err}");
    }
}
