//! Scopes: who the caller is. A record is identified by `(scope, key)`, never by the key alone, so
//! one tenant can never receive another tenant's stored answer.

use std::fmt;
use std::str::FromStr;

use http::HeaderName;
use http::request::Parts;
use sha2::{Digest, Sha256};

/// The caller a key belongs to.
///
/// Values are prefixed by their source (`cred:`, `header:`, `app:`) so that two sources can never
/// produce the same scope.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
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

    /// The scope of callers presenting this `Authorization` header value (`--scope credential`).
    pub fn credential(authorization: &[u8]) -> Self {
        let digest = Sha256::digest(authorization);
        Self(format!("cred:{}", hex(&digest)).into())
    }

    fn header(value: &[u8]) -> Self {
        Self(format!("header:{}", String::from_utf8_lossy(value)).into())
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Scope").field(&self.0).finish()
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
    Header(HeaderName),
    /// One scope shared by every caller.
    None,
    /// A [`Scope`] the application's own middleware put into the request extensions; a request
    /// without one is in the anonymous scope.
    Extension,
}

impl ScopeSource {
    /// The scope of a request.
    pub fn scope_of(&self, parts: &Parts) -> Scope {
        match self {
            Self::Credential => parts
                .headers
                .get(http::header::AUTHORIZATION)
                .map_or_else(Scope::anonymous, |v| Scope::credential(v.as_bytes())),
            Self::Header(name) => parts
                .headers
                .get(name)
                .map_or_else(Scope::anonymous, |v| Scope::header(v.as_bytes())),
            Self::None => Scope::shared(),
            Self::Extension => parts
                .extensions
                .get::<Scope>()
                .cloned()
                .unwrap_or_else(Scope::anonymous),
        }
    }
}

/// A `--scope` value that is not one of `credential`, `none` or `header:NAME`.
#[derive(Debug, thiserror::Error)]
#[error("unknown scope source {0:?}: use credential, none or header:NAME")]
pub struct ScopeSourceError(String);

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

pub(crate) fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut builder = http::Request::builder();
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    #[test]
    fn credentials_separate_callers() {
        let source = ScopeSource::Credential;
        let alice = source.scope_of(&parts(&[("authorization", "Bearer alice")]));
        let bob = source.scope_of(&parts(&[("authorization", "Bearer bob")]));
        assert_ne!(alice, bob);
        assert_eq!(alice, source.scope_of(&parts(&[("authorization", "Bearer alice")])));
        assert_eq!(source.scope_of(&parts(&[])), Scope::anonymous());
        assert!(
            !alice.as_str().contains("alice"),
            "the credential itself is never stored"
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
    fn header_and_application_scopes_never_collide() {
        let from_header = ScopeSource::Header(HeaderName::from_static("x-user")).scope_of(&parts(&[("x-user", "7")]));
        assert_ne!(from_header, Scope::application("7"));
    }
}
