//! Stored answers sealed at rest: a copy of the store (a backup, a replica, a dump) shows neither
//! a payment's result nor a customer's data.
//!
//! A [`Keyring`] holds named 32-byte keys (`IDEM_ENCRYPTION_KEYS="id:base64,…"`): the first seals,
//! every one opens, so keys rotate without losing records. An answer is sealed with
//! XChaCha20-Poly1305 under a random nonce, with the record's identity as associated data, so a
//! sealed answer copied onto another record does not open. Answers stored before sealing was
//! turned on (or with it off) are read as they are.

use std::fmt;

use bytes::Bytes;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};
use rand::RngCore;

use crate::response::StoredResponse;
use crate::store::RecordId;

/// What a sealed answer starts with: no encoded answer (`IDR1…`) does.
const MAGIC: &[u8; 4] = b"IDS1";
const NONCE_LEN: usize = 24;
/// The longest key id.
const MAX_ID_LEN: usize = 32;

/// The keys that seal and open stored answers.
#[derive(Clone)]
pub struct Keyring {
    /// The first seals; all open.
    keys: Vec<(String, XChaCha20Poly1305)>,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The ids only: a key never reaches a log.
        f.debug_struct("Keyring")
            .field("ids", &self.ids().collect::<Vec<_>>())
            .finish()
    }
}

/// An `IDEM_ENCRYPTION_KEYS` value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid encryption keys: {0}; the form is id:base64[,id:base64…] with 32-byte keys, the first sealing")]
pub struct KeyringError(String);

/// A stored answer that cannot be read: sealed under a key the keyring lacks, sealed for another
/// record, or damaged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    /// Sealed under a key id the keyring does not hold (or sealing is off).
    #[error("sealed under key {0:?}, which is not configured")]
    UnknownKey(String),
    /// The configured key with its id does not open it: another key under the same id, an answer
    /// moved from another record, or damaged bytes.
    #[error(
        "does not open under key {0:?}: a different key with that id, an answer moved from another record, or damaged bytes"
    )]
    DoesNotOpen(String),
    /// Not a sealed answer's layout.
    #[error("damaged sealed answer")]
    Damaged,
    /// Opened (or never sealed), but not an encoded answer.
    #[error("not a stored answer: {0}")]
    Undecodable(String),
}

impl std::str::FromStr for Keyring {
    type Err = KeyringError;

    /// `id:base64,…`; ids are 1 to 32 letters, digits, `-` or `_`, each used once.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        use base64::Engine as _;
        let mut keys: Vec<(String, XChaCha20Poly1305)> = Vec::new();
        // An error names an entry by its place and a key by its id, and shows nothing else of
        // the text: an entry written the wrong way round (`base64:id`, `id=base64:x`) has its
        // key where the id should be.
        for (n, entry) in text.split(',').map(str::trim).enumerate() {
            let n = n + 1;
            let (id, encoded) = entry
                .split_once(':')
                .ok_or_else(|| KeyringError(format!("entry {n} has no id: write id:base64")))?;
            let valid_id = !id.is_empty()
                && id.len() <= MAX_ID_LEN
                && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !valid_id {
                let hint = if looks_like_a_key(id) {
                    "; what is there looks like a key: write the id first, then ':' and the key"
                } else {
                    ""
                };
                return Err(KeyringError(format!(
                    "entry {n}: its id (the text before the first ':', not shown here) must be 1 to {MAX_ID_LEN} letters, digits, - or _{hint}"
                )));
            }
            if keys.iter().any(|(known, _)| known == id) {
                return Err(KeyringError(format!("key id {id:?} is given twice")));
            }
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .map_err(|_| KeyringError(format!("key {id:?} (entry {n}) is not base64")))?;
            let key = <[u8; 32]>::try_from(bytes.as_slice())
                .map_err(|_| KeyringError(format!("key {id:?} (entry {n}) has {} bytes, not 32", bytes.len())))?;
            keys.push((id.to_owned(), XChaCha20Poly1305::new(&Key::from(key))));
        }
        Ok(Self { keys })
    }
}

/// Whether `text` ends in what a key in base64 is (44 characters that decode to 32 bytes), to
/// tell an operator who wrote an entry the wrong way round.
fn looks_like_a_key(text: &str) -> bool {
    use base64::Engine as _;
    // Not at a character boundary: not base64 either.
    let Some(tail) = text.get(text.len().saturating_sub(44)..) else {
        return false;
    };
    base64::engine::general_purpose::STANDARD
        .decode(tail)
        .is_ok_and(|bytes| bytes.len() == 32)
}

impl Keyring {
    /// The key ids, the sealing one first.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|(id, _)| id.as_str())
    }

    /// `answer` sealed under the first key, bound to `record`.
    pub fn seal(&self, record: &RecordId, answer: &[u8]) -> Bytes {
        let (id, cipher) = &self.keys[0];
        let mut nonce = [0u8; NONCE_LEN];
        rand::rng().fill_bytes(&mut nonce);
        let aad = associated_data(record);
        let sealed = cipher
            .encrypt(&XNonce::from(nonce), Payload { msg: answer, aad: &aad })
            .expect("XChaCha20-Poly1305 seals any answer below 256 GiB");
        let mut out = Vec::with_capacity(MAGIC.len() + 1 + id.len() + NONCE_LEN + sealed.len());
        out.extend_from_slice(MAGIC);
        out.push(id.len() as u8);
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out.into()
    }

    /// The answer in `stored`, opened if it is sealed (with `record` as it was sealed for).
    pub fn open(&self, record: &RecordId, stored: &Bytes) -> Result<Bytes, Unreadable> {
        open(Some(self), record, stored)
    }
}

/// The answer in `stored`: as it is if it was never sealed, opened by `keyring` if it was.
pub fn open(keyring: Option<&Keyring>, record: &RecordId, stored: &Bytes) -> Result<Bytes, Unreadable> {
    let Some(sealed) = Sealed::parse(stored)? else {
        return Ok(stored.clone());
    };
    let cipher = keyring
        .and_then(|ring| ring.keys.iter().find(|(id, _)| id == sealed.key_id))
        .map(|(_, cipher)| cipher)
        .ok_or_else(|| Unreadable::UnknownKey(sealed.key_id.to_owned()))?;
    let aad = associated_data(record);
    cipher
        .decrypt(
            &XNonce::from(sealed.nonce),
            Payload {
                msg: sealed.ciphertext,
                aad: &aad,
            },
        )
        .map(Bytes::from)
        .map_err(|_| Unreadable::DoesNotOpen(sealed.key_id.to_owned()))
}

/// The answer stored for `record`, opened if it was sealed and decoded: what a replay sends and
/// `idem inspect` shows.
pub fn open_answer(keyring: Option<&Keyring>, record: &RecordId, stored: &Bytes) -> Result<StoredResponse, Unreadable> {
    let opened = open(keyring, record, stored)?;
    StoredResponse::decode(&opened).map_err(|err| Unreadable::Undecodable(err.to_string()))
}

/// The id of the key that sealed `stored`, or `None` if it is not sealed.
pub fn sealed_by(stored: &[u8]) -> Result<Option<&str>, Unreadable> {
    Ok(Sealed::parse(stored)?.map(|sealed| sealed.key_id))
}

/// A sealed answer's parts.
struct Sealed<'a> {
    key_id: &'a str,
    nonce: [u8; NONCE_LEN],
    ciphertext: &'a [u8],
}

impl<'a> Sealed<'a> {
    /// `None` for an answer that is not sealed.
    fn parse(stored: &'a [u8]) -> Result<Option<Self>, Unreadable> {
        let Some(rest) = stored.strip_prefix(MAGIC.as_slice()) else {
            return Ok(None);
        };
        let (&id_len, rest) = rest.split_first().ok_or(Unreadable::Damaged)?;
        let id_len = usize::from(id_len);
        if rest.len() < id_len + NONCE_LEN {
            return Err(Unreadable::Damaged);
        }
        let (id, rest) = rest.split_at(id_len);
        let (nonce, ciphertext) = rest.split_at(NONCE_LEN);
        Ok(Some(Self {
            key_id: std::str::from_utf8(id).map_err(|_| Unreadable::Damaged)?,
            nonce: nonce.try_into().map_err(|_| Unreadable::Damaged)?,
            ciphertext,
        }))
    }
}

/// What binds a sealed answer to its record: the scope and the key, each length-prefixed.
fn associated_data(record: &RecordId) -> Vec<u8> {
    let (scope, key) = (record.scope.as_str().as_bytes(), record.key.as_str().as_bytes());
    let mut aad = Vec::with_capacity(16 + scope.len() + key.len() + 8);
    aad.extend_from_slice(b"idem-answer\0");
    for part in [scope, key] {
        aad.extend_from_slice(&(part.len() as u32).to_be_bytes());
        aad.extend_from_slice(part);
    }
    aad
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IdempotencyKey, Scope};

    const A: &str = "a:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    const B: &str = "b:HxwdHhsaGRgXFhUUExIREA8ODQwLCgkIBwYFBAMCAQA=";

    fn record(key: &str) -> RecordId {
        RecordId::new(Scope::application("tenant"), IdempotencyKey::new(key).unwrap())
    }

    #[test]
    fn seals_and_opens_under_rotation() {
        let old: Keyring = A.parse().unwrap();
        let answer = b"IDR1 the answer";
        let sealed = old.seal(&record("k"), answer);
        assert!(
            !sealed.windows(answer.len()).any(|w| w == answer),
            "the answer is not in clear"
        );
        assert_eq!(sealed_by(&sealed).unwrap(), Some("a"));
        assert_eq!(old.open(&record("k"), &sealed).unwrap(), &answer[..]);
        // A new key first, the old kept: old answers still open, new ones are sealed by the new.
        let rotated: Keyring = format!("{B},{A}").parse().unwrap();
        assert_eq!(rotated.open(&record("k"), &sealed).unwrap(), &answer[..]);
        assert_eq!(sealed_by(&rotated.seal(&record("k"), answer)).unwrap(), Some("b"));
        // The old key dropped: unreadable, and said so.
        let new_only: Keyring = B.parse().unwrap();
        assert_eq!(
            new_only.open(&record("k"), &sealed),
            Err(Unreadable::UnknownKey("a".into()))
        );
        assert_eq!(
            open(None, &record("k"), &sealed),
            Err(Unreadable::UnknownKey("a".into()))
        );
        // Unsealed answers read as they are.
        let plain = Bytes::from_static(b"IDR1 plain");
        assert_eq!(old.open(&record("k"), &plain).unwrap(), plain);
    }

    #[test]
    fn a_sealed_answer_does_not_open_for_another_record_or_another_key_with_its_id() {
        let ring: Keyring = A.parse().unwrap();
        let sealed = ring.seal(&record("k1"), b"answer");
        assert_eq!(
            ring.open(&record("k2"), &sealed),
            Err(Unreadable::DoesNotOpen("a".into()))
        );
        let impostor: Keyring = B.replacen("b:", "a:", 1).parse().unwrap();
        assert_eq!(
            impostor.open(&record("k1"), &sealed),
            Err(Unreadable::DoesNotOpen("a".into()))
        );
        let mut damaged = sealed.to_vec();
        *damaged.last_mut().unwrap() ^= 1;
        assert!(ring.open(&record("k1"), &Bytes::from(damaged)).is_err());
        assert_eq!(
            ring.open(&record("k1"), &Bytes::from_static(b"IDS1")),
            Err(Unreadable::Damaged)
        );
    }

    #[test]
    fn malformed_keys_are_refused_without_showing_them() {
        for bad in [
            "",
            "nokey",
            ":AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
            "a:not base64!",
            "a:AAEC",
            "a b:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
            &format!("{A},{A}"),
            // Written the wrong way round, or with a stray separator: the key is where the id
            // should be, and must not come back in the error.
            "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=:a",
            "a=AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=:x",
            "b:HxwdHhsaGRgXFhUUExIREA8ODQwLCgkIBwYFBAMCAQA=,AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=:a",
            "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8",
            "ééééééééééééééééééééééééééééééééééééééééééééééé:AAEC",
        ] {
            let err = bad.parse::<Keyring>().unwrap_err().to_string();
            for part in ["AAECAwQF", "ODxAREhMUFRYX", "HxwdHhsaGRgX"] {
                assert!(!err.contains(part), "{bad:?}: {err}");
            }
        }
        let backwards = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=:a"
            .parse::<Keyring>()
            .unwrap_err()
            .to_string();
        assert!(
            backwards.contains("entry 1") && backwards.contains("id first"),
            "says which entry and what is wrong: {backwards}"
        );
        let ring: Keyring = format!("{A}, {B}").parse().unwrap();
        assert_eq!(ring.ids().collect::<Vec<_>>(), ["a", "b"]);
        assert!(!format!("{ring:?}").contains("AAEC"));
    }
}
