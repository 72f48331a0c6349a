//! The knobs of the protocol: which requests are keyed, what happens to keyless ones, how long
//! answers live, and which answers are stored.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};

use crate::key::KeyTimeFormats;
use crate::response::HeaderAllowList;
use crate::scope::ScopeSource;
use crate::time::UnixMillis;

use crate::headers::IDEMPOTENCY_KEY;

/// What happens to a request that should carry a key and does not (`--missing-key`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingKeyPolicy {
    /// Pass it through untouched (the default, so adding idem breaks nobody).
    #[default]
    Allow,
    /// Refuse it with `400 key-missing`.
    Require,
    /// Allow it until `until`, with `Deprecation`/`Sunset` headers and a warning log, then require.
    Grace {
        /// When keys become required.
        until: UnixMillis,
    },
    /// Derive a provisional key from (scope, fingerprint) and deduplicate for `window`; the
    /// provisional key leaves no tombstone. It never spans two callers: an anonymous request is
    /// passed through as under `Allow`, and [`Policy::validate`] refuses it with
    /// [`ScopeSource::None`], where every caller shares one scope.
    Fingerprint {
        /// How long an identical keyless request counts as a copy.
        window: Duration,
    },
}

/// A `--missing-key` value that does not parse.
#[derive(Debug, thiserror::Error)]
#[error(
    "invalid missing-key policy {value:?}: {reason}; use allow, require, grace:<RFC 3339 date> or fingerprint:<duration>"
)]
pub struct MissingKeyPolicyError {
    value: String,
    reason: String,
}

impl FromStr for MissingKeyPolicy {
    type Err = MissingKeyPolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason: String| MissingKeyPolicyError {
            value: s.to_owned(),
            reason,
        };
        match s.split_once(':') {
            None if s == "allow" => Ok(Self::Allow),
            None if s == "require" => Ok(Self::Require),
            Some(("grace", date)) => {
                // A bare date means the start of that day, UTC.
                let full = if date.len() == 10 {
                    format!("{date}T00:00:00Z")
                } else {
                    date.to_owned()
                };
                let until = humantime::parse_rfc3339_weak(&full).map_err(|e| err(format!("bad date: {e}")))?;
                Ok(Self::Grace {
                    until: UnixMillis::from_system_time(until),
                })
            }
            Some(("fingerprint", window)) => {
                let window = humantime::parse_duration(window).map_err(|e| err(format!("bad duration: {e}")))?;
                if window.is_zero() {
                    return Err(err("the window must be longer than zero".into()));
                }
                Ok(Self::Fingerprint { window })
            }
            _ => Err(err("unknown policy".into())),
        }
    }
}

impl fmt::Display for MissingKeyPolicy {
    /// The form [`FromStr`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Allow => f.write_str("allow"),
            Self::Require => f.write_str("require"),
            Self::Grace { until } => {
                let at = std::time::UNIX_EPOCH + Duration::from_millis(until.0);
                write!(f, "grace:{}", humantime::format_rfc3339(at))
            }
            Self::Fingerprint { window } => write!(f, "fingerprint:{}", humantime::format_duration(*window)),
        }
    }
}

/// What happens to a keyed request from a caller without an identity (`--anonymous`): no
/// credential, no scope header, no application scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AnonymousPolicy {
    /// Such callers share the anonymous scope (the default).
    #[default]
    Allow,
    /// Refuse them with `401 credential-missing`, for deployments where anonymous callers must
    /// never see each other's answers.
    Reject,
}

/// An `--anonymous` value other than `allow` or `reject`.
#[derive(Debug, thiserror::Error)]
#[error("invalid anonymous policy {0:?}: use allow or reject")]
pub struct AnonymousPolicyError(String);

impl FromStr for AnonymousPolicy {
    type Err = AnonymousPolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "allow" => Ok(Self::Allow),
            "reject" => Ok(Self::Reject),
            _ => Err(AnonymousPolicyError(s.to_owned())),
        }
    }
}

impl fmt::Display for AnonymousPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Allow => "allow",
            Self::Reject => "reject",
        })
    }
}

/// A policy that cannot work, found by [`Policy::validate`]: the setting and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {reason}")]
pub struct PolicyError {
    /// The setting, by its command-line name (`lease`, `ttl`, …).
    pub setting: &'static str,
    /// Why it cannot work.
    pub reason: String,
}

/// Everything the protocol needs to decide, with the defaults of the design.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The key header (default `Idempotency-Key`).
    pub key_header: HeaderName,
    /// Methods the protocol applies to (default `POST`, `PATCH`), matched without regard to ASCII
    /// case: see [`applies_to`](Self::applies_to).
    pub methods: Vec<Method>,
    /// Where the scope comes from (default: a hash of the credential).
    pub scope: ScopeSource,
    /// Keyed requests from callers without an identity (default: allow, in the anonymous scope).
    pub anonymous: AnonymousPolicy,
    /// Keyless requests (default: allow).
    pub missing_key: MissingKeyPolicy,
    /// How long an answer is replayable (default 24 h).
    pub ttl: Duration,
    /// The key formats whose embedded time expires a key older than `ttl` before any lookup
    /// (default: UUIDv7 only).
    pub expire_by_key_time: KeyTimeFormats,
    /// How long a tombstone answers `key-expired` after completion (default 7 d).
    pub tombstone_ttl: Duration,
    /// A claim's lease, renewed while the handler runs (default 60 s).
    pub lease: Duration,
    /// How long a run may take before it is given up and its key released as unknown, so a hung
    /// handler or upstream never wedges its key (default 5 min).
    pub run_timeout: Duration,
    /// How long one store operation may take before it counts as failed (default 5 s), so a
    /// half-open connection or a held lock answers `503` instead of hanging the request.
    pub store_timeout: Duration,
    /// How long a copy waits for the first request before `409 key-in-flight` (default 10 s).
    pub wait: Duration,
    /// The largest keyed request body, buffered to fingerprint it (default 1 MiB).
    pub max_body: usize,
    /// The largest response body stored whole; larger ones are stored compact (default 256 KiB).
    pub max_stored_body: usize,
    /// Store 5xx answers instead of releasing the key (default: no).
    pub store_5xx: bool,
    /// Pass requests through when the store is down instead of `503` (default: no, fail closed).
    pub fail_open: bool,
    /// The headers a stored answer keeps.
    pub stored_headers: HeaderAllowList,
    /// The `Retry-After` sent with `409 key-in-flight` and `503 store-unavailable` (default 1 s).
    pub retry_after: Duration,
    /// The handlers complete their records in their own database transaction, and every effect of
    /// theirs is in it (or is itself idempotent by the key): exactly once, not just flagged
    /// (default: no). A run that ends without completing then had no effect, so its key is
    /// forgotten and runs again unflagged, and a claim whose holder died is taken over unflagged.
    /// Only on a store that [completes in transactions](crate::Store::completes_in_transactions)
    /// (PostgreSQL, SQLite); elsewhere the route is an ordinary one.
    pub in_transaction: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            key_header: IDEMPOTENCY_KEY,
            methods: vec![Method::POST, Method::PATCH],
            scope: ScopeSource::default(),
            anonymous: AnonymousPolicy::default(),
            missing_key: MissingKeyPolicy::default(),
            expire_by_key_time: KeyTimeFormats::default(),
            ttl: Duration::from_secs(24 * 3600),
            tombstone_ttl: Duration::from_secs(7 * 24 * 3600),
            lease: Duration::from_secs(60),
            run_timeout: Duration::from_secs(5 * 60),
            store_timeout: Duration::from_secs(5),
            wait: Duration::from_secs(10),
            max_body: 1024 * 1024,
            max_stored_body: 256 * 1024,
            store_5xx: false,
            fail_open: false,
            stored_headers: HeaderAllowList::default(),
            retry_after: Duration::from_secs(1),
            in_transaction: false,
        }
    }
}

impl Policy {
    /// The longest `ttl`, `tombstone_ttl` and `fingerprint:` window [`validate`](Self::validate)
    /// accepts: ten years (`10y`, 3652.5 days).
    ///
    /// idem adds these to "now" in Unix milliseconds, and every store must take the sum: SQLite's
    /// and PostgreSQL's `bigint` (up to `i64::MAX`), Redis's `PEXPIRE` (at most `i64::MAX` minus
    /// the server's clock, and computed in Lua's doubles) and RFC 3339, in which `idem list` and
    /// `idem inspect` write times, which stops at the year 9999
    /// ([`UnixMillis::LAST_RFC3339`](crate::UnixMillis::LAST_RFC3339)). Now plus a ttl, a
    /// tombstone and a lease at their bounds is about twenty years from now, far inside them all;
    /// and a retry ten years late is no retry.
    pub const MAX_RETENTION: Duration = Duration::from_secs(10 * 31_557_600);

    /// The longest `lease`, `run_timeout`, `wait` and `store_timeout` (and the gateway's own
    /// timeouts) [`validate`](Self::validate) accepts: a day. Each is a deadline from now that
    /// idem counts on a monotonic clock or renews while a request runs; a request held for longer
    /// than a day is a fault to end, not a wait to keep, and the bound keeps every deadline idem
    /// adds (a timer, a lease's end) far from overflowing.
    pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

    /// Checks that each of `timeouts` (a setting's name and its value) is at most
    /// [`MAX_TIMEOUT`](Self::MAX_TIMEOUT): the policy's own, and those a caller keeps beside it
    /// (the gateway's upstream and read timeouts, its shutdown grace). The first past it is the
    /// error.
    pub fn within_max_timeout(timeouts: &[(&'static str, Duration)]) -> Result<(), PolicyError> {
        match timeouts.iter().find(|(_, duration)| *duration > Self::MAX_TIMEOUT) {
            Some((setting, _)) => Err(PolicyError {
                setting,
                reason: "must be at most 1d (one day): a request or a shutdown held longer is a fault to end, not a wait to keep (see Policy::MAX_TIMEOUT)".to_owned(),
            }),
            None => Ok(()),
        }
    }

    /// Checks that the settings can work together; the first that cannot is the error.
    ///
    /// The gateway refuses to start with such a policy. The tower layer does not check (it is
    /// built infallibly): call this where you build yours.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let fail = |setting, reason: &str| {
            Err(PolicyError {
                setting,
                reason: reason.to_owned(),
            })
        };
        if self.lease.is_zero() {
            return fail(
                "lease",
                "must be longer than zero: a claim is renewed every third of its lease while the request runs",
            );
        }
        if self.run_timeout.is_zero() {
            return fail("run-timeout", "must be longer than zero, or no request could ever run");
        }
        if self.store_timeout.is_zero() {
            return fail(
                "store-timeout",
                "must be longer than zero, or no store operation could succeed",
            );
        }
        if self.ttl.is_zero() {
            return fail("ttl", "must be longer than zero, or no answer could ever be replayed");
        }
        let retention = [
            ("ttl", self.ttl),
            ("tombstone-ttl", self.tombstone_ttl),
            (
                "missing-key",
                match self.missing_key {
                    MissingKeyPolicy::Fingerprint { window } => window,
                    _ => Duration::ZERO,
                },
            ),
        ];
        for (setting, duration) in retention {
            if duration > Self::MAX_RETENTION {
                return fail(
                    setting,
                    "must be at most 10y (ten years): idem adds it to the time of every record, which every store must keep and RFC 3339 write (see Policy::MAX_RETENTION)",
                );
            }
        }
        let timeouts = [
            ("lease", self.lease),
            ("run-timeout", self.run_timeout),
            ("wait", self.wait),
            ("store-timeout", self.store_timeout),
        ];
        Self::within_max_timeout(&timeouts)?;
        if self.methods.is_empty() {
            return fail("methods", "must name at least one method");
        }
        if matches!(self.missing_key, MissingKeyPolicy::Fingerprint { .. }) && self.scope == ScopeSource::None {
            return fail(
                "missing-key",
                "fingerprint: derives a provisional key from the caller's scope and the request, and with --scope none every caller shares one scope, so two callers posting the same body would get one run and one answer; use --scope credential or header:NAME, or another --missing-key",
            );
        }
        if let Some(name) = self.scope.credential_header() {
            return Err(PolicyError {
                setting: "scope",
                reason: format!(
                    "header:{name} carries a credential, which would be stored in clear in every record and shown in every request's log line, `idem list` and the idem.scope span attribute; use --scope credential (a keyed hash of the Authorization header), or a header that a trusted auth layer sets to name the caller (header:X-User-Id)"
                ),
            });
        }
        if self.anonymous == AnonymousPolicy::Reject && self.scope == ScopeSource::None {
            return fail(
                "anonymous",
                "reject needs a scope that identifies callers; with --scope none nobody has a credential",
            );
        }
        Ok(())
    }

    /// Whether the protocol applies to a request with this method. The match ignores ASCII case:
    /// `patch` is `PATCH`, because frameworks (Django, werkzeug, Rails) uppercase the method before
    /// they route, so a lowercase spelling would otherwise run the handler unprotected.
    pub fn applies_to(&self, method: &Method) -> bool {
        self.methods
            .iter()
            .any(|listed| listed.as_str().eq_ignore_ascii_case(method.as_str()))
    }

    /// Until when a key settled at `now` is replayed or taken over (`expires_at`), and when its
    /// record goes (`purge_at`): the ttl, then the tombstone. A provisional key (`window`) leaves
    /// no tombstone: after the window the same body is a new request.
    pub(crate) fn retention(&self, now: UnixMillis, window: Option<Duration>) -> (UnixMillis, UnixMillis) {
        match window {
            Some(window) => (now.plus(window), now.plus(window)),
            None => (now.plus(self.ttl), now.plus(self.tombstone_ttl.max(self.ttl))),
        }
    }

    /// Whether an answer with this status is stored (otherwise the key is released and a retry
    /// runs again): every status below 500 except 408, 409, 425 and 429; 5xx only with `store_5xx`.
    pub fn stores(&self, status: StatusCode) -> bool {
        match status.as_u16() {
            408 | 409 | 425 | 429 => false,
            500.. => self.store_5xx,
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_bounded_where_every_store_takes_them() {
        type Set = fn(&mut Policy, Duration);
        let cases: [(&str, Set, Duration); 7] = [
            ("ttl", |p, d| p.ttl = d, Policy::MAX_RETENTION),
            ("tombstone-ttl", |p, d| p.tombstone_ttl = d, Policy::MAX_RETENTION),
            (
                "missing-key",
                |p, d| p.missing_key = MissingKeyPolicy::Fingerprint { window: d },
                Policy::MAX_RETENTION,
            ),
            ("lease", |p, d| p.lease = d, Policy::MAX_TIMEOUT),
            ("run-timeout", |p, d| p.run_timeout = d, Policy::MAX_TIMEOUT),
            ("wait", |p, d| p.wait = d, Policy::MAX_TIMEOUT),
            ("store-timeout", |p, d| p.store_timeout = d, Policy::MAX_TIMEOUT),
        ];
        for (setting, set, bound) in cases {
            let mut policy = Policy::default();
            set(&mut policy, bound);
            assert_eq!(policy.validate(), Ok(()), "{setting} at its bound");
            set(&mut policy, bound + Duration::from_millis(1));
            let err = policy.validate().expect_err(setting);
            assert_eq!(err.setting, setting);
            assert!(err.reason.starts_with("must be at most"), "{setting}: {}", err.reason);
        }
        // The longest sum idem computes stays a time every store takes and RFC 3339 writes, from
        // any clock before the year 9900.
        let year_9900 = UnixMillis(250_246_000_000_000);
        let latest = year_9900.0 + (2 * Policy::MAX_RETENTION + Policy::MAX_TIMEOUT).as_millis() as u64;
        assert!(UnixMillis(latest).is_rfc3339());
    }

    #[test]
    fn a_provisional_key_over_one_shared_scope_is_refused() {
        let fingerprint = MissingKeyPolicy::Fingerprint {
            window: Duration::from_secs(5),
        };
        let shared = Policy {
            missing_key: fingerprint,
            scope: ScopeSource::None,
            ..Policy::default()
        };
        let err = shared.validate().unwrap_err();
        assert_eq!(err.setting, "missing-key");
        assert!(err.reason.contains("--scope none"), "{err}");
        let per_caller = Policy {
            missing_key: fingerprint,
            ..Policy::default()
        };
        assert_eq!(per_caller.validate(), Ok(()));
    }

    #[test]
    fn a_header_scope_on_a_credential_is_refused() {
        for source in ["header:Authorization", "header:Cookie", "header:X-Api-Key"] {
            let policy = Policy {
                scope: source.parse().unwrap(),
                ..Policy::default()
            };
            let err = policy.validate().unwrap_err();
            assert_eq!(err.setting, "scope", "{source}");
            assert!(err.reason.contains("--scope credential"), "{source}: {err}");
        }
        let identity = Policy {
            scope: "header:X-User-Id".parse().unwrap(),
            ..Policy::default()
        };
        assert_eq!(identity.validate(), Ok(()));
    }

    #[test]
    fn parses_missing_key_policies() {
        assert_eq!("allow".parse::<MissingKeyPolicy>().unwrap(), MissingKeyPolicy::Allow);
        assert_eq!(
            "require".parse::<MissingKeyPolicy>().unwrap(),
            MissingKeyPolicy::Require
        );
        assert_eq!(
            "fingerprint:5s".parse::<MissingKeyPolicy>().unwrap(),
            MissingKeyPolicy::Fingerprint {
                window: Duration::from_secs(5)
            }
        );
        let MissingKeyPolicy::Grace { until } = "grace:2027-01-01".parse().unwrap() else {
            panic!()
        };
        assert_eq!(until, UnixMillis(1_798_761_600_000));
        let MissingKeyPolicy::Grace { until: same } = "grace:2027-01-01T00:00:00Z".parse().unwrap() else {
            panic!()
        };
        assert_eq!(until, same);
        for policy in [
            "allow",
            "require",
            "grace:2027-01-01T00:00:00Z",
            "fingerprint:5s",
            "fingerprint:1m 30s",
        ] {
            let parsed: MissingKeyPolicy = policy.parse().unwrap();
            assert_eq!(
                parsed.to_string().parse::<MissingKeyPolicy>().unwrap(),
                parsed,
                "{policy}"
            );
        }
        for bad in [
            "",
            "deny",
            "grace:soon",
            "fingerprint:",
            "fingerprint:0s",
            "require:now",
        ] {
            assert!(bad.parse::<MissingKeyPolicy>().is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn methods_match_in_any_case() {
        let method = |text: &str| Method::from_bytes(text.as_bytes()).unwrap();
        let policy = Policy::default();
        for yes in ["POST", "post", "Post", "PATCH", "patch", "pAtCh"] {
            assert!(policy.applies_to(&method(yes)), "{yes}");
        }
        for no in ["GET", "get", "PUT", "put", "POSTX", "PATC"] {
            assert!(!policy.applies_to(&method(no)), "{no}");
        }
        let listed_lowercase = Policy {
            methods: vec![method("purge")],
            ..Policy::default()
        };
        assert!(listed_lowercase.applies_to(&method("PURGE")));
        assert!(!listed_lowercase.applies_to(&Method::POST));
    }

    #[test]
    fn stores_what_the_design_says() {
        let policy = Policy::default();
        for status in [200, 201, 204, 301, 400, 404, 422] {
            assert!(policy.stores(StatusCode::from_u16(status).unwrap()), "{status}");
        }
        for status in [408, 409, 425, 429, 500, 502, 503] {
            assert!(!policy.stores(StatusCode::from_u16(status).unwrap()), "{status}");
        }
        let stripe = Policy {
            store_5xx: true,
            ..Policy::default()
        };
        assert!(stripe.stores(StatusCode::INTERNAL_SERVER_ERROR));
        assert!(!stripe.stores(StatusCode::TOO_MANY_REQUESTS));
    }
}
