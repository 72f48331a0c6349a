//! Credential scopes (`--scope credential`): the stored scope of a caller is a keyed hash of its
//! `Authorization` header, never the credential nor a bare hash of it, which anyone holding a copy
//! of the store could test guesses against (API keys are often short or shaped).
//!
//! The hash is HMAC-SHA256 keyed by the store's [`ScopeSalt`] (random, one per store, shared by
//! every instance through the store) and, when the operator sets one, a [`ScopeSecret`] kept out
//! of the store: a dump alone then gives nothing to test guesses against.
//!
//! Changing how scopes are hashed must not make retries of earlier requests run again, so the
//! forms used before are still looked up for a while ([`CredentialScopes::earlier`]):
//! * the unsalted `cred:` SHA-256 of earlier versions, while the records of those versions may
//!   live (the salt says until when; a store that held no records never looks);
//! * the hash under the previous secret, while the operator keeps it configured.

use std::fmt;
use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

use crate::scope::{Scope, hex};
use crate::store::{ScopeSalt, Store, StoreError};
use crate::time::UnixMillis;

/// The prefix of a credential scope hashed with the store's salt.
const KEYED_PREFIX: &str = "cred-mac:";
/// The prefix of a credential scope as earlier versions stored it: a bare SHA-256.
const UNSALTED_PREFIX: &str = "cred:";

/// The shortest secret accepted: a secret is only worth having if it cannot be guessed.
pub const MIN_SECRET_LEN: usize = 16;

/// An operator's secret mixed into the hash of credential scopes (`IDEM_SCOPE_SECRET`), kept
/// outside the store.
#[derive(Clone, PartialEq, Eq)]
pub struct ScopeSecret(Box<[u8]>);

/// A secret too short to be worth having.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "is {0} bytes long; a scope secret must be at least {MIN_SECRET_LEN} bytes (32 random bytes, base64-encoded, is a good choice)"
)]
pub struct ScopeSecretError(usize);

impl ScopeSecret {
    /// A secret of these bytes, at least [`MIN_SECRET_LEN`] long.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, ScopeSecretError> {
        let secret = secret.as_ref();
        if secret.len() < MIN_SECRET_LEN {
            return Err(ScopeSecretError(secret.len()));
        }
        Ok(Self(secret.into()))
    }
}

impl fmt::Debug for ScopeSecret {
    /// Never prints the secret.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ScopeSecret(..)")
    }
}

/// How credential scopes are hashed: with the current secret (if any), and which secret was used
/// before, so that records stored under it still replay.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScopeSecrets {
    current: Option<ScopeSecret>,
    /// `Some(None)`: before, there was no secret.
    previous: Option<Option<ScopeSecret>>,
}

impl ScopeSecrets {
    /// Hashes with `current` (no secret: `None`), and nothing else.
    pub fn new(current: Option<ScopeSecret>) -> Self {
        Self {
            current,
            previous: None,
        }
    }

    /// Also looks up the records stored while `previous` was the secret (`None`: there was none),
    /// for as long as it is configured: keep it for one retention (`ttl` + `tombstone-ttl`) after
    /// the change, then remove it.
    pub fn with_previous(mut self, previous: Option<ScopeSecret>) -> Self {
        self.previous = Some(previous);
        self
    }

    /// Whether a secret is set.
    pub fn has_secret(&self) -> bool {
        self.current.is_some()
    }

    /// Whether the previous hashing is the current one (a mistake: nothing would change).
    pub fn previous_is_current(&self) -> bool {
        self.previous.as_ref() == Some(&self.current)
    }
}

/// How a store's credential scopes are hashed: the operator's secrets, and the store's salt once
/// read. The protocols of one store share one (`Protocol::with_scope_hashing`), so that the salt is
/// read once however many are made.
#[derive(Debug, Default)]
pub struct ScopeHashing {
    pub(crate) secrets: ScopeSecrets,
    pub(crate) loaded: tokio::sync::OnceCell<CredentialScopes>,
}

impl ScopeHashing {
    /// Hashing with `secrets`; the salt is read at the first credential.
    pub fn new(secrets: ScopeSecrets) -> Self {
        Self {
            secrets,
            loaded: tokio::sync::OnceCell::new(),
        }
    }
}

/// The hashing of credential scopes in a store: its salt and the operator's secrets.
#[derive(Clone)]
pub struct CredentialScopes {
    current: Hmac<Sha256>,
    previous: Option<Hmac<Sha256>>,
    /// Until when records with unsalted scopes may live (`None`: the store never held any).
    unsalted_until: Option<UnixMillis>,
}

impl fmt::Debug for CredentialScopes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CredentialScopes")
            .field("previous", &self.previous.is_some())
            .field("unsalted_until", &self.unsalted_until)
            .finish_non_exhaustive()
    }
}

impl CredentialScopes {
    /// The hashing in `store`: reads its salt, making it first if the store has none.
    pub async fn load(store: &dyn Store, secrets: &ScopeSecrets, now: UnixMillis) -> Result<Self, StoreError> {
        let salt = store.scope_salt(ScopeSalt::random(now)).await?;
        Ok(Self::new(&salt, secrets))
    }

    /// The hashing under `salt` and `secrets`.
    pub fn new(salt: &ScopeSalt, secrets: &ScopeSecrets) -> Self {
        Self {
            current: mac(salt, secrets.current.as_ref()),
            previous: secrets.previous.as_ref().map(|previous| mac(salt, previous.as_ref())),
            unsalted_until: salt.older_records_until,
        }
    }

    /// The scope of callers presenting this `Authorization` header value.
    pub fn scope(&self, authorization: &[u8]) -> Scope {
        keyed(&self.current, authorization)
    }

    /// The scopes the same caller's records may be stored under from before a change of hashing,
    /// to look up when its key is new under [`CredentialScopes::scope`]: the unsalted form until
    /// `retention` after the last record written without a salt may have lived (a run in flight
    /// at the upgrade completes later, and instances not yet upgraded write more), and the
    /// previous secret's while it is configured. Empty on a store that never held unsalted
    /// records and without a previous secret: then nothing more is read.
    pub fn earlier(&self, authorization: &[u8], now: UnixMillis, retention: Duration) -> Vec<Scope> {
        let mut earlier = Vec::new();
        if let Some(previous) = &self.previous {
            earlier.push(keyed(previous, authorization));
        }
        if self.unsalted_until.is_some_and(|until| now < until.plus(retention)) {
            earlier.push(unsalted(authorization));
        }
        earlier
    }

    /// Every form the caller's records may be stored under, newest first, whatever the windows
    /// (for an operator looking a record up).
    pub fn every_form(&self, authorization: &[u8]) -> Vec<Scope> {
        let mut forms = vec![self.scope(authorization)];
        forms.extend(self.previous.as_ref().map(|previous| keyed(previous, authorization)));
        forms.push(unsalted(authorization));
        forms
    }
}

/// The HMAC keyed by the salt, then the secret: the salt has a fixed length, so the two never run
/// into each other.
fn mac(salt: &ScopeSalt, secret: Option<&ScopeSecret>) -> Hmac<Sha256> {
    let mut key = Vec::with_capacity(salt.salt.len() + secret.map_or(0, |s| s.0.len()));
    key.extend_from_slice(&salt.salt);
    key.extend_from_slice(secret.map_or(&[][..], |s| &s.0));
    Hmac::new_from_slice(&key).expect("HMAC takes a key of any length")
}

fn keyed(mac: &Hmac<Sha256>, authorization: &[u8]) -> Scope {
    let mut mac = mac.clone();
    mac.update(authorization);
    Scope::from_stored(format!("{KEYED_PREFIX}{}", hex(&mac.finalize().into_bytes())))
}

/// The scope earlier versions stored: `cred:` and the bare SHA-256 of the credential.
fn unsalted(authorization: &[u8]) -> Scope {
    Scope::from_stored(format!("{UNSALTED_PREFIX}{}", hex(&Sha256::digest(authorization))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn salt(byte: u8, older: Option<UnixMillis>) -> ScopeSalt {
        ScopeSalt {
            salt: [byte; 32],
            created_at: UnixMillis::from_i64(1),
            older_records_until: older,
        }
    }

    fn secret(text: &str) -> ScopeSecret {
        ScopeSecret::new(text).unwrap()
    }

    const DAY: Duration = Duration::from_secs(24 * 3600);

    #[test]
    fn scopes_are_keyed_by_salt_and_secret() {
        let plain = ScopeSecrets::default();
        let a = CredentialScopes::new(&salt(1, None), &plain).scope(b"Bearer alice");
        assert_eq!(a, CredentialScopes::new(&salt(1, None), &plain).scope(b"Bearer alice"));
        assert_ne!(a, CredentialScopes::new(&salt(1, None), &plain).scope(b"Bearer bob"));
        assert_ne!(a, CredentialScopes::new(&salt(2, None), &plain).scope(b"Bearer alice"));
        let with_secret = ScopeSecrets::new(Some(secret("0123456789abcdef")));
        assert_ne!(
            a,
            CredentialScopes::new(&salt(1, None), &with_secret).scope(b"Bearer alice")
        );
        assert!(a.as_str().starts_with(KEYED_PREFIX));
        // Neither the credential nor its bare hash.
        assert!(!a.as_str().contains("alice"));
        assert!(!a.as_str().contains(&hex(&Sha256::digest(b"Bearer alice"))));
    }

    #[test]
    fn the_unsalted_form_is_looked_up_only_while_its_records_may_live() {
        let now = UnixMillis::from_i64(1_000_000_000_000);
        let fresh = CredentialScopes::new(&salt(1, None), &ScopeSecrets::default());
        assert!(
            fresh.earlier(b"Bearer a", now, DAY).is_empty(),
            "a store that never held records"
        );

        let upgraded = CredentialScopes::new(&salt(1, Some(now.plus(DAY))), &ScopeSecrets::default());
        let earlier = upgraded.earlier(b"Bearer a", now, DAY);
        assert_eq!(
            earlier,
            vec![Scope::from_stored(format!(
                "cred:{}",
                hex(&Sha256::digest(b"Bearer a"))
            ))]
        );
        assert_eq!(
            upgraded
                .earlier(b"Bearer a", now.plus(2 * DAY - Duration::from_millis(1)), DAY)
                .len(),
            1
        );
        assert!(upgraded.earlier(b"Bearer a", now.plus(2 * DAY), DAY).is_empty());
    }

    #[test]
    fn the_previous_secret_is_looked_up_while_configured() {
        let now = UnixMillis::from_i64(1_000_000_000_000);
        let old = CredentialScopes::new(&salt(1, None), &ScopeSecrets::default());
        let rotated = ScopeSecrets::new(Some(secret("0123456789abcdef"))).with_previous(None);
        let new = CredentialScopes::new(&salt(1, None), &rotated);
        assert_ne!(new.scope(b"k"), old.scope(b"k"));
        assert_eq!(new.earlier(b"k", now, DAY), vec![old.scope(b"k")]);
        assert_eq!(new.every_form(b"k")[..2], [new.scope(b"k"), old.scope(b"k")]);
    }

    #[test]
    fn short_secrets_are_refused_and_never_printed() {
        assert_eq!(ScopeSecret::new("short").unwrap_err(), ScopeSecretError(5));
        assert_eq!(format!("{:?}", secret("0123456789abcdef")), "ScopeSecret(..)");
    }
}
