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

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

use crate::scope::{Scope, hex};
use crate::store::{ScopeSalt, Store, StoreError, StoreIdentity};
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
/// read once however many are made, and read again by one of them for all when a claim finds that
/// the store is not the one it was ([`StoreError::IdentityChanged`]).
#[derive(Debug, Default)]
pub struct ScopeHashing {
    pub(crate) secrets: ScopeSecrets,
    /// The hashing under the salt last read; `None` before the first read.
    loaded: RwLock<Option<Arc<CredentialScopes>>>,
    /// Held while the salt is read, so that requests finding the store changed at once read it once.
    loading: tokio::sync::Mutex<()>,
}

impl ScopeHashing {
    /// Hashing with `secrets`; the salt is read at the first keyed request.
    pub fn new(secrets: ScopeSecrets) -> Self {
        Self {
            secrets,
            ..Self::default()
        }
    }

    /// The hashing under the salt last read, if read.
    pub(crate) fn current(&self) -> Option<Arc<CredentialScopes>> {
        self.loaded.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The hashing under the store's salt as it is now, read by `load` unless another caller read
    /// it since `stale` was current (`None`: never read). The second of two callers that found the
    /// store changed at once gets what the first read.
    pub(crate) async fn reload<F>(
        &self,
        stale: Option<&Arc<CredentialScopes>>,
        load: F,
    ) -> Result<Arc<CredentialScopes>, StoreError>
    where
        F: Future<Output = Result<CredentialScopes, StoreError>>,
    {
        let _loading = self.loading.lock().await;
        if let Some(current) = self.current()
            && stale.is_none_or(|stale| !Arc::ptr_eq(stale, &current))
        {
            return Ok(current);
        }
        let loaded = Arc::new(load.await?);
        *self.loaded.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&loaded));
        Ok(loaded)
    }
}

/// The hashing of credential scopes in a store: its salt and the operator's secrets.
#[derive(Clone)]
pub struct CredentialScopes {
    /// The identity of the store whose salt this is: every claim made with a scope hashed here
    /// carries it, so that a store that lost its salt refuses the claim.
    identity: StoreIdentity,
    current: Hmac<Sha256>,
    previous: Option<Hmac<Sha256>>,
    /// Until when records with unsalted scopes may live (`None`: the store never held any).
    unsalted_until: Option<UnixMillis>,
}

impl fmt::Debug for CredentialScopes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CredentialScopes")
            .field("identity", &self.identity)
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
            identity: salt.identity,
            current: mac(salt, secrets.current.as_ref()),
            previous: secrets.previous.as_ref().map(|previous| mac(salt, previous.as_ref())),
            unsalted_until: salt.older_records_until,
        }
    }

    /// The identity of the store whose salt keys this hashing.
    pub fn identity(&self) -> StoreIdentity {
        self.identity
    }

    /// The scope of callers presenting this `Authorization` header value, in any spelling of it
    /// that names the same credential ([`canonical`]).
    pub fn scope(&self, authorization: &[u8]) -> Scope {
        keyed(&self.current, &canonical(authorization))
    }

    /// The scopes the same caller's records may be stored under from before a change of hashing,
    /// to look up when its key is new under [`CredentialScopes::scope`]: the unsalted form until
    /// `retention` after the last record written without a salt may have lived (a run in flight
    /// at the upgrade completes later, and instances not yet upgraded write more), and the
    /// previous secret's while it is configured. Empty on a store that never held unsalted
    /// records and without a previous secret: then nothing more is read.
    ///
    /// A credential sent in another spelling than its [`canonical`] one (`bearer`, two spaces) was
    /// hashed as sent before spellings were made one: its records of then are under that
    /// spelling's hash, current and previous, and its unsalted form is always the spelling's. Only
    /// such spellings pay for the look-up; the usual one is its own canonical form.
    pub fn earlier(&self, authorization: &[u8], now: UnixMillis, retention: Duration) -> Vec<Scope> {
        let mut earlier = self.earlier_keyed(authorization);
        if self.unsalted_until.is_some_and(|until| now < until.plus(retention)) {
            earlier.push(unsalted(authorization));
        }
        earlier
    }

    /// Every form the caller's records may be stored under, newest first, whatever the windows
    /// (for an operator looking a record up).
    pub fn every_form(&self, authorization: &[u8]) -> Vec<Scope> {
        let mut forms = vec![self.scope(authorization)];
        forms.extend(self.earlier_keyed(authorization));
        forms.push(unsalted(authorization));
        forms
    }

    /// The keyed hashes, other than [`CredentialScopes::scope`], that the caller's records may be
    /// stored under: the spelling as sent under the current secret (if it is not the canonical
    /// one), and the canonical spelling and the one as sent under the previous secret.
    fn earlier_keyed(&self, authorization: &[u8]) -> Vec<Scope> {
        let canonical = canonical(authorization);
        let respelt = *canonical != *authorization;
        let mut forms = Vec::new();
        if respelt {
            forms.push(keyed(&self.current, authorization));
        }
        if let Some(previous) = &self.previous {
            forms.push(keyed(previous, &canonical));
            if respelt {
                forms.push(keyed(previous, authorization));
            }
        }
        forms
    }
}

/// The authentication schemes of IANA's registry, in their registered spelling: the spelling a
/// scheme sent in another case is hashed in.
const REGISTERED_SCHEMES: [&str; 14] = [
    "Basic",
    "Bearer",
    "Concealed",
    "Digest",
    "DPoP",
    "GNAP",
    "HOBA",
    "Mutual",
    "Negotiate",
    "OAuth",
    "PrivateToken",
    "SCRAM-SHA-1",
    "SCRAM-SHA-256",
    "vapid",
];

/// The spelling of an `Authorization` value its scope is hashed from, so that the spellings of
/// one credential are one caller (RFC 9110 §11.4: `credentials = auth-scheme [ 1*SP ( token68 /
/// #auth-param ) ]`, the scheme case-insensitive): a registered scheme in its registered case
/// (`bearer` and `BEARER` are `Bearer`), and one space after the scheme however many were sent.
/// The credentials themselves are case-sensitive and kept as sent, and so is a scheme the registry
/// does not name (no one spelling of it can be picked without moving the scope of the callers who
/// send another). The usual spelling is its own canonical form, borrowed.
pub(crate) fn canonical(authorization: &[u8]) -> Cow<'_, [u8]> {
    let Some(space) = authorization.iter().position(|&b| b == b' ') else {
        return Cow::Borrowed(authorization);
    };
    let (scheme, after) = authorization.split_at(space);
    let credentials = after.trim_ascii_start();
    if credentials.is_empty() {
        return Cow::Borrowed(authorization);
    }
    let registered = REGISTERED_SCHEMES
        .iter()
        .map(|name| name.as_bytes())
        .find(|name| name.eq_ignore_ascii_case(scheme))
        .unwrap_or(scheme);
    if registered == scheme && after.len() == credentials.len() + 1 && after[0] == b' ' {
        return Cow::Borrowed(authorization);
    }
    let mut respelt = Vec::with_capacity(registered.len() + 1 + credentials.len());
    respelt.extend_from_slice(registered);
    respelt.push(b' ');
    respelt.extend_from_slice(credentials);
    Cow::Owned(respelt)
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
            identity: StoreIdentity::from_bytes([byte; 16]),
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

    #[test]
    fn the_spellings_of_one_credential_are_one_scope() {
        let scopes = CredentialScopes::new(&salt(1, None), &ScopeSecrets::default());
        let usual = scopes.scope(b"Bearer alice");
        assert_eq!(
            usual,
            keyed(&scopes.current, b"Bearer alice"),
            "the usual spelling hashes as before"
        );
        for spelling in [
            &b"bearer alice"[..],
            b"BEARER alice",
            b"Bearer  alice",
            b"bEaReR   alice",
        ] {
            assert_eq!(scopes.scope(spelling), usual, "{}", String::from_utf8_lossy(spelling));
        }
        for other in [&b"Bearer Alice"[..], b"Bearer alice2", b"Basic alice", b"Bearer"] {
            assert_ne!(scopes.scope(other), usual, "{}", String::from_utf8_lossy(other));
        }
        assert_eq!(scopes.scope(b"basic dXNlcjpw"), scopes.scope(b"Basic dXNlcjpw"));
        assert_eq!(
            scopes.scope(b"aws4-hmac-sha256 Credential=x"),
            keyed(&scopes.current, b"aws4-hmac-sha256 Credential=x"),
            "an unregistered scheme keeps its case"
        );
        assert_eq!(
            canonical(b"Token  x"),
            Cow::<[u8]>::Owned(b"Token x".to_vec()),
            "one space after it"
        );
    }

    #[test]
    fn a_credential_spelt_otherwise_looks_up_its_records_of_before() {
        let now = UnixMillis::from_i64(1_000);
        let old = secret("an-old-secret-0123456789");
        let secrets = ScopeSecrets {
            current: Some(secret("0123456789abcdef")),
            previous: Some(Some(old)),
        };
        let scopes = CredentialScopes::new(&salt(1, Some(now)), &secrets);
        // The usual spelling looks up what it always did: the previous secret's and the unsalted.
        assert_eq!(
            scopes.earlier(b"Bearer a", now, DAY),
            vec![
                keyed(scopes.previous.as_ref().unwrap(), b"Bearer a"),
                unsalted(b"Bearer a")
            ]
        );
        // Another spelling also looks up the hashes of that spelling, which earlier versions wrote.
        let respelt = scopes.earlier(b"bearer a", now, DAY);
        assert_eq!(
            respelt,
            vec![
                keyed(&scopes.current, b"bearer a"),
                keyed(scopes.previous.as_ref().unwrap(), b"Bearer a"),
                keyed(scopes.previous.as_ref().unwrap(), b"bearer a"),
                unsalted(b"bearer a"),
            ]
        );
        assert!(!respelt.contains(&scopes.scope(b"bearer a")));
        let forms = scopes.every_form(b"bearer a");
        assert_eq!(forms[0], scopes.scope(b"Bearer a"));
        assert_eq!(forms[1..], respelt[..]);
    }
}
