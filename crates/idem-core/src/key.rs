//! The `Idempotency-Key` header: parsing (RFC 8941 sf-string or a bare key) and the timestamp that
//! time-ordered keys (UUIDv7, ULID) carry.

use std::fmt;
use std::str::FromStr;

use http::header::{GetAll, HeaderValue};

use crate::time::UnixMillis;

/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// A valid idempotency key: 1 to 255 visible ASCII characters.
///
/// Parse, don't validate: a value of this type is always valid.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Box<str>);

/// Why a key header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// More than one key header was sent.
    #[error("the request carries more than one idempotency key header; send exactly one")]
    Repeated,
    /// The value is empty.
    #[error("the idempotency key is empty; send 1 to {MAX_KEY_LEN} visible ASCII characters")]
    Empty,
    /// The value is longer than [`MAX_KEY_LEN`].
    #[error("the idempotency key is {0} characters long; the limit is {MAX_KEY_LEN}")]
    TooLong(usize),
    /// The value contains something other than visible ASCII.
    #[error("the idempotency key may contain only visible ASCII characters (no spaces or control characters)")]
    NotVisibleAscii,
    /// The value starts with `"` but is not one well-formed sf-string.
    #[error(
        "the idempotency key header is not a single RFC 8941 string; send one quoted string such as \"8e03978e-40d5-43e8-bc93-6894a57f9324\""
    )]
    MalformedString,
    /// A bare (unquoted) key contains `"`, `,` or `\`.
    #[error("an unquoted idempotency key may not contain '\"', ',' or '\\'; quote it as an RFC 8941 string")]
    BareKeyCharacters,
}

impl IdempotencyKey {
    /// Validates a key's characters (the content of the sf-string, or the bare key).
    pub fn new(key: &str) -> Result<Self, KeyError> {
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(key.len()));
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(KeyError::NotVisibleAscii);
        }
        Ok(Self(key.into()))
    }

    /// Parses one header value: an sf-string (`"abc"`) or a bare key (`abc`).
    pub fn from_header_value(value: &HeaderValue) -> Result<Self, KeyError> {
        let raw = value.to_str().map_err(|_| KeyError::NotVisibleAscii)?;
        let raw = raw.trim_matches(|c| c == ' ' || c == '\t');
        if raw.starts_with('"') {
            let item: sfv::Item = sfv::Parser::new(raw).parse().map_err(|_| KeyError::MalformedString)?;
            if !item.params.is_empty() {
                return Err(KeyError::MalformedString);
            }
            let string = item.bare_item.as_string().ok_or(KeyError::MalformedString)?;
            return Self::new(string.as_str());
        }
        if raw.contains(['"', ',', '\\']) {
            return Err(KeyError::BareKeyCharacters);
        }
        Self::new(raw)
    }

    /// Reads the key from every value of the key header: `Ok(None)` when there is none.
    pub fn from_headers(values: GetAll<'_, HeaderValue>) -> Result<Option<Self>, KeyError> {
        let mut iter = values.iter();
        let Some(first) = iter.next() else {
            return Ok(None);
        };
        if iter.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::from_header_value(first).map(Some)
    }

    /// The key's characters.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an sf-string header value, the form clients should send.
    pub fn to_header_value(&self) -> HeaderValue {
        let mut quoted = String::with_capacity(self.0.len() + 2);
        quoted.push('"');
        for c in self.0.chars() {
            if c == '"' || c == '\\' {
                quoted.push('\\');
            }
            quoted.push(c);
        }
        quoted.push('"');
        HeaderValue::from_str(&quoted).expect("visible ASCII is a valid header value")
    }

    /// The creation time embedded in this key, if it is a time-ordered key of one of `formats`.
    pub fn timestamp(&self, formats: KeyTimeFormats) -> Option<UnixMillis> {
        let uuid7 = || formats.uuid7.then(|| uuid_v7_millis(&self.0)).flatten();
        let ulid = || formats.ulid.then(|| ulid_millis(&self.0)).flatten();
        uuid7().or_else(ulid)
    }
}

/// The time-ordered key formats whose embedded creation time is trusted to expire a key before
/// any lookup (`--expire-by-key-time`).
///
/// A UUIDv7 says what it is (its version digit), so it is trusted by default. A ULID carries no
/// marker: any 26-character Crockford string reads as one, so a random key such as
/// `01ARZ3NDEKTSV4RRFFQ69G5FAV` would be "created" in 2016 and expire on first use. ULIDs are
/// trusted only when a deployment says its clients send them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyTimeFormats {
    /// UUIDv7 keys (RFC 9562).
    pub uuid7: bool,
    /// ULID keys.
    pub ulid: bool,
}

impl KeyTimeFormats {
    /// No key's time is trusted (`off`).
    pub const OFF: Self = Self {
        uuid7: false,
        ulid: false,
    };
}

impl Default for KeyTimeFormats {
    /// `uuid7`.
    fn default() -> Self {
        Self {
            uuid7: true,
            ulid: false,
        }
    }
}

impl fmt::Display for KeyTimeFormats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.uuid7, self.ulid) {
            (false, false) => f.write_str("off"),
            (true, false) => f.write_str("uuid7"),
            (false, true) => f.write_str("ulid"),
            (true, true) => f.write_str("uuid7,ulid"),
        }
    }
}

/// An `--expire-by-key-time` value that is not `off` or a list of `uuid7` and `ulid`.
#[derive(Debug, thiserror::Error)]
#[error("invalid key-time formats {0:?}: use off, or a comma-separated list of uuid7 and ulid")]
pub struct KeyTimeFormatsError(String);

impl FromStr for KeyTimeFormats {
    type Err = KeyTimeFormatsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim() == "off" {
            return Ok(Self::OFF);
        }
        let mut formats = Self::OFF;
        for name in s.split(',').map(str::trim) {
            match name {
                "uuid7" => formats.uuid7 = true,
                "ulid" => formats.ulid = true,
                _ => return Err(KeyTimeFormatsError(s.to_owned())),
            }
        }
        Ok(formats)
    }
}

fn uuid_v7_millis(key: &str) -> Option<UnixMillis> {
    let uuid = uuid::Uuid::try_parse(key).ok()?;
    if uuid.get_version_num() != 7 {
        return None;
    }
    let (secs, nanos) = uuid.get_timestamp()?.to_unix();
    Some(UnixMillis(secs * 1000 + u64::from(nanos / 1_000_000)))
}

fn ulid_millis(key: &str) -> Option<UnixMillis> {
    const CROCKFORD: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    if key.len() != 26 {
        return None;
    }
    let mut value: u128 = 0;
    for b in key.bytes() {
        let digit = CROCKFORD.iter().position(|&c| c == b.to_ascii_uppercase())?;
        value = (value << 5) | digit as u128;
    }
    // 26 digits carry 130 bits; a valid ULID's first digit is at most 7, so the top two bits are zero.
    if key.as_bytes()[0] > b'7' {
        return None;
    }
    Some(UnixMillis((value >> 80) as u64))
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    fn parse(raw: &str) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::from_header_value(&HeaderValue::from_str(raw).unwrap())
    }

    #[test]
    fn accepts_sf_strings_and_bare_keys() {
        assert_eq!(parse("\"abc-123\"").unwrap().as_str(), "abc-123");
        assert_eq!(parse("abc-123").unwrap().as_str(), "abc-123");
        assert_eq!(parse(r#""a\"b""#).unwrap().as_str(), "a\"b");
        assert_eq!(parse(&"k".repeat(255)).unwrap().as_str().len(), 255);
    }

    #[test]
    fn refuses_what_is_not_one_valid_key() {
        assert_eq!(parse("\"\"").unwrap_err(), KeyError::Empty);
        assert_eq!(parse(&"k".repeat(256)).unwrap_err(), KeyError::TooLong(256));
        assert_eq!(parse("\"a b\"").unwrap_err(), KeyError::NotVisibleAscii);
        assert_eq!(parse("\"a\", \"b\"").unwrap_err(), KeyError::MalformedString);
        assert_eq!(parse("\"abc").unwrap_err(), KeyError::MalformedString);
        assert_eq!(parse("\"abc\";p=1").unwrap_err(), KeyError::MalformedString);
        assert_eq!(parse("a,b").unwrap_err(), KeyError::BareKeyCharacters);
        assert_eq!(parse("a\\b").unwrap_err(), KeyError::BareKeyCharacters);
        assert_eq!(parse("a b").unwrap_err(), KeyError::NotVisibleAscii);
    }

    #[test]
    fn two_headers_are_refused() {
        let mut headers = HeaderMap::new();
        headers.append("idempotency-key", HeaderValue::from_static("a"));
        headers.append("idempotency-key", HeaderValue::from_static("b"));
        assert_eq!(
            IdempotencyKey::from_headers(headers.get_all("idempotency-key")).unwrap_err(),
            KeyError::Repeated
        );
        assert_eq!(
            IdempotencyKey::from_headers(HeaderMap::new().get_all("idempotency-key")),
            Ok(None)
        );
    }

    #[test]
    fn header_value_round_trips() {
        let key = IdempotencyKey::new(r#"a"b\c"#).unwrap();
        assert_eq!(IdempotencyKey::from_header_value(&key.to_header_value()).unwrap(), key);
    }

    #[test]
    fn reads_timestamps_of_time_ordered_keys() {
        let at = UnixMillis(1_700_000_000_123);
        let ts = uuid::Timestamp::from_unix(uuid::NoContext, at.0 / 1000, (at.0 % 1000) as u32 * 1_000_000);
        let v7 = uuid::Uuid::new_v7(ts).to_string();
        let all = KeyTimeFormats {
            uuid7: true,
            ulid: true,
        };
        assert_eq!(IdempotencyKey::new(&v7).unwrap().timestamp(all), Some(at));
        assert_eq!(
            IdempotencyKey::new(&v7).unwrap().timestamp(KeyTimeFormats::default()),
            Some(at)
        );
        assert_eq!(IdempotencyKey::new(&v7).unwrap().timestamp(KeyTimeFormats::OFF), None);
        // ULID spec example: 01ARZ3NDEK decodes to 1469922850259 ms; trusted only when asked.
        let ulid = IdempotencyKey::new("01ARZ3NDEKTSV4RRFFQ69G5FAV").unwrap();
        assert_eq!(ulid.timestamp(all), Some(UnixMillis(1_469_922_850_259)));
        assert_eq!(ulid.timestamp(KeyTimeFormats::default()), None);
        let v4 = uuid::Uuid::new_v4().to_string();
        assert_eq!(IdempotencyKey::new(&v4).unwrap().timestamp(all), None);
        assert_eq!(IdempotencyKey::new("order-42").unwrap().timestamp(all), None);
    }
}
