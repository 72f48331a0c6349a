//! Scopes: who the caller is. A record is identified by `(scope, key)`, never by the key alone, so
//! one tenant can never receive another tenant's stored answer.

use std::fmt;
use std::str::FromStr;

use http::HeaderName;
use http::HeaderValue;
use http::request::Parts;

/// The caller a key belongs to.
///
/// Values are prefixed by their source (`cred-mac:`, `header:`, `app:`) so that two sources can
/// never produce the same scope.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope(Box<str>);

impl Scope {
    /// The scope of callers that present no identity.
    pub fn anonymous() -> Self {
        Self("anonymous".into())
    }

    /// The one scope shared by everyone (`--scope none`).
    pub fn shared() -> Self {
        Self("shared".into())
    }

    /// A scope chosen by the application, such as a tenant or user id from its own auth layer.
    ///
    /// Put it into the request extensions before the idempotency layer runs and select
    /// [`ScopeSource::Extension`].
    pub fn application(id: impl AsRef<str>) -> Self {
        Self(format!("app:{}", id.as_ref()).into())
    }

    /// Rebuilds a scope from its stored form (as returned by [`Scope::as_str`]).
    pub fn from_stored(stored: impl Into<Box<str>>) -> Self {
        Self(stored.into())
    }

    /// The stored form of the scope.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is the scope of callers that present no identity.
    pub fn is_anonymous(&self) -> bool {
        &*self.0 == "anonymous"
    }

    /// The scope named by a header's exact bytes: `header:VALUE` for UTF-8 (the form records were
    /// always stored in), `header-bytes:HEX` for anything else, so two different values never
    /// share a scope.
    fn header(value: &[u8]) -> Self {
        match std::str::from_utf8(value) {
            Ok(text) => Self(format!("header:{text}").into()),
            Err(_) => Self(format!("header-bytes:{}", hex(value)).into()),
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where the scope of a request comes from (`--scope`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum ScopeSource {
    /// A hash of the `Authorization` header: a replay needs the same credential. No credential
    /// means the anonymous scope.
    #[default]
    Credential,
    /// A header set by a trusted auth layer in front of idem, such as `X-User-Id`. A request
    /// without it is in the anonymous scope.
    ///
    /// A header that carries a credential ([`ScopeSource::credential_header`]: `Cookie`,
    /// `X-Api-Key`, …) is refused by [`Policy::validate`](crate::Policy::validate), and so by the
    /// gateway and by [`Routes`](crate::Routes): its value would be stored in clear in every
    /// record and shown wherever a scope is (logs, `idem list`, spans). Where no one validates
    /// (an `IdempotencyLayer` given such a source), its value is taken as a credential, stored
    /// only as a keyed hash as for [`ScopeSource::Credential`], never in clear.
    Header(HeaderName),
    /// One scope shared by every caller.
    None,
    /// A [`Scope`] the application's own middleware put into the request extensions; a request
    /// without one is in the anonymous scope.
    Extension,
}

/// A request whose scope cannot be told: the header that names it is repeated, so which caller
/// it is depends on which copy one believes (`400 scope-invalid`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the {0} header appears more than once; send it once")]
pub struct ScopeError(pub HeaderName);

/// Who a request says its caller is: a scope, or a credential whose scope is a keyed hash that
/// takes the store's salt to compute ([`CredentialScopes`](crate::protocol::CredentialScopes)).
#[derive(Clone, PartialEq, Eq)]
pub enum Caller {
    /// The caller's scope.
    Scope(Scope),
    /// The `Authorization` header's value.
    Credential(HeaderValue),
}

impl fmt::Debug for Caller {
    /// Never prints the credential.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Scope(scope) => f.debug_tuple("Scope").field(scope).finish(),
            Self::Credential(_) => f.write_str("Credential(..)"),
        }
    }
}

impl Caller {
    /// The caller's scope if it is known without the store's salt.
    pub fn scope(&self) -> Option<&Scope> {
        match self {
            Self::Scope(scope) => Some(scope),
            Self::Credential(_) => None,
        }
    }

    /// Whether the request names no caller.
    pub fn is_anonymous(&self) -> bool {
        self.scope().is_some_and(Scope::is_anonymous)
    }
}

impl ScopeSource {
    /// Who the caller of a request is. An absent or empty header is the anonymous scope.
    pub fn caller_of(&self, parts: &Parts) -> Result<Caller, ScopeError> {
        match self {
            Self::Credential => header_caller(parts, &http::header::AUTHORIZATION, |value| {
                Caller::Credential(value.clone())
            }),
            // Never stored in clear, even where the policy was not validated: hashed as a credential.
            Self::Header(name) if carries_credential(name) => {
                header_caller(parts, name, |value| Caller::Credential(value.clone()))
            }
            Self::Header(name) => header_caller(parts, name, |value| Caller::Scope(Scope::header(value.as_bytes()))),
            Self::None => Ok(Caller::Scope(Scope::shared())),
            Self::Extension => Ok(Caller::Scope(
                parts
                    .extensions
                    .get::<Scope>()
                    .cloned()
                    .unwrap_or_else(Scope::anonymous),
            )),
        }
    }

    /// The header this source takes the scope from, if it carries a credential: `Authorization`,
    /// `Proxy-Authorization`, `Cookie`, or a name holding `key`, `token`, `secret`, `password`,
    /// `auth` or `cookie` (`X-Api-Key`, `X-Auth-Token`). Such a header identifies its caller by a
    /// secret, which a `header:` scope would store and show in clear.
    pub fn credential_header(&self) -> Option<&HeaderName> {
        match self {
            Self::Header(name) if carries_credential(name) => Some(name),
            _ => None,
        }
    }
}

/// Whether a header's value is a secret. Header names are lower case, so one spelling suffices;
/// `auth` covers both authorization headers.
fn carries_credential(name: &HeaderName) -> bool {
    const SECRET_WORDS: [&str; 6] = ["auth", "cookie", "key", "token", "secret", "password"];
    let name = name.as_str();
    SECRET_WORDS.iter().any(|word| name.contains(word))
}

fn header_caller(
    parts: &Parts,
    name: &HeaderName,
    caller: impl Fn(&HeaderValue) -> Caller,
) -> Result<Caller, ScopeError> {
    let mut values = parts.headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (Some(_), Some(_)) => Err(ScopeError(name.clone())),
        (Some(value), None) if !value.is_empty() => Ok(caller(value)),
        _ => Ok(Caller::Scope(Scope::anonymous())),
    }
}

/// A `--scope` value that is not one of `credential`, `none` or `header:NAME`.
#[derive(Debug, thiserror::Error)]
#[error("unknown scope source {0:?}: use credential, none or header:NAME")]
pub struct ScopeSourceError(String);

impl fmt::Display for ScopeSource {
    /// The form [`FromStr`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Credential => f.write_str("credential"),
            Self::None => f.write_str("none"),
            Self::Extension => f.write_str("extension"),
            Self::Header(name) => write!(f, "header:{name}"),
        }
    }
}

impl FromStr for ScopeSource {
    type Err = ScopeSourceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "credential" => Ok(Self::Credential),
            "none" => Ok(Self::None),
            "extension" => Ok(Self::Extension),
            _ => s
                .strip_prefix("header:")
                .and_then(|name| HeaderName::from_str(name).ok())
                .map(Self::Header)
                .ok_or_else(|| ScopeSourceError(s.to_owned())),
        }
    }
}

/// Lower-case hex, two digits a byte (on every request's path: no formatting machinery).
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    // Into bytes, then one check: pushing `char`s would encode each digit as UTF-8 again.
    let mut digits = vec![0; bytes.len() * 2];
    for (pair, b) in digits.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
    String::from_utf8(digits).expect("hex digits are ASCII")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &[u8])]) -> Parts {
        let mut builder = http::Request::builder();
        for (name, value) in headers {
            builder = builder.header(*name, http::HeaderValue::from_bytes(value).unwrap());
        }
        builder.body(()).unwrap().into_parts().0
    }

    #[test]
    fn hex_is_two_lower_case_digits_a_byte() {
        assert_eq!(hex(&[]), "");
        assert_eq!(hex(&[0x00, 0x0f, 0x10, 0xab, 0xff]), "000f10abff");
    }

    #[test]
    fn credentials_are_kept_for_hashing() {
        let source = ScopeSource::Credential;
        let alice = source.caller_of(&parts(&[("authorization", b"Bearer alice")])).unwrap();
        assert_eq!(alice, Caller::Credential(HeaderValue::from_static("Bearer alice")));
        assert_eq!(alice.scope(), None);
        assert!(!alice.is_anonymous());
        assert!(
            !format!("{alice:?}").contains("alice"),
            "the credential is never printed"
        );
        assert_eq!(
            source.caller_of(&parts(&[])).unwrap(),
            Caller::Scope(Scope::anonymous())
        );
        assert!(
            source
                .caller_of(&parts(&[("authorization", b"")]))
                .unwrap()
                .is_anonymous()
        );
    }

    #[test]
    fn sources_parse() {
        assert_eq!("credential".parse::<ScopeSource>().unwrap(), ScopeSource::Credential);
        assert_eq!(
            "header:X-User-Id".parse::<ScopeSource>().unwrap(),
            ScopeSource::Header(HeaderName::from_static("x-user-id"))
        );
        assert!("header:".parse::<ScopeSource>().is_err());
        assert!("tenant".parse::<ScopeSource>().is_err());
    }

    #[test]
    fn credential_headers_are_told_from_identity_headers() {
        for (name, credential) in [
            ("authorization", true),
            ("proxy-authorization", true),
            ("cookie", true),
            ("x-api-key", true),
            ("x-auth-token", true),
            ("x-client-secret", true),
            ("x-password", true),
            ("x-user-id", false),
            ("x-tenant", false),
        ] {
            let source: ScopeSource = format!("header:{}", name.to_ascii_uppercase()).parse().unwrap();
            assert_eq!(source.credential_header().is_some(), credential, "{name}");
        }
        assert_eq!(ScopeSource::Credential.credential_header(), None);
    }

    #[test]
    fn a_credential_header_scope_is_never_kept_in_clear() {
        let source: ScopeSource = "header:X-Api-Key".parse().unwrap();
        let caller = source.caller_of(&parts(&[("x-api-key", b"k-123")])).unwrap();
        assert_eq!(caller, Caller::Credential(HeaderValue::from_static("k-123")));
        assert!(!format!("{caller:?}").contains("k-123"));
    }

    #[test]
    fn header_and_application_scopes_never_collide() {
        let from_header = ScopeSource::Header(HeaderName::from_static("x-user"))
            .caller_of(&parts(&[("x-user", b"7")]))
            .unwrap();
        assert_ne!(from_header, Caller::Scope(Scope::application("7")));
    }

    #[test]
    fn header_scopes_keep_exact_bytes() {
        let source = ScopeSource::Header(HeaderName::from_static("x-user-id"));
        let scope = |value: &[u8]| {
            let caller = source.caller_of(&parts(&[("x-user-id", value)])).unwrap();
            caller.scope().cloned().unwrap()
        };
        // Latin-1 "müller" and "mäller": one lossy UTF-8 conversion would make them one scope.
        assert_ne!(scope(b"m\xfcller"), scope(b"m\xe4ller"));
        assert_ne!(scope(b"m\xfcller"), scope("m\u{fffd}ller".as_bytes()));
        // UTF-8 values keep the form records were stored in before.
        assert_eq!(scope(b"u-7").as_str(), "header:u-7");
        assert_eq!(scope(b"m\xfcller").as_str(), "header-bytes:6dfc6c6c6572");
    }

    #[test]
    fn a_repeated_scope_header_is_refused() {
        let source = ScopeSource::Header(HeaderName::from_static("x-user-id"));
        let err = source
            .caller_of(&parts(&[("x-user-id", b"alice"), ("x-user-id", b"bob")]))
            .unwrap_err();
        assert_eq!(err.0, "x-user-id");
        assert!(
            ScopeSource::Credential
                .caller_of(&parts(&[
                    ("authorization", b"Bearer a"),
                    ("authorization", b"Bearer b")
                ]))
                .is_err()
        );
    }
}
