//! The replies of the scripts and commands, read into the stored forms idem-core checks: a record's
//! fields into a [`StoredRecord`], the checkpoints, the scope salt, the outcome of `begin`, a `SCAN`
//! step, a record as `list` finds it. Anything of the wrong shape is a corrupt record
//! ([`StoreError::Corrupt`]), never a panic.

use std::collections::HashMap;

use idem_core::store::backend::{Existing, StoredRecord};
use idem_core::{
    IdempotencyKey, Scope, StoreError, UnixMillis,
    store::{Begin, BeginRequest, Checkpoint, Listed, Record, RecordId, ScopeSalt, StoreIdentity},
};
use redis::Value;

use crate::origin;

/// The next cursor and the keys of a `SCAN` step, from the replies of its pipeline.
pub(crate) fn parse_scan(replies: Vec<Value>) -> Result<(Vec<u8>, Vec<Vec<u8>>), StoreError> {
    let mut parts = match replies.into_iter().next() {
        Some(Value::Array(parts)) if parts.len() == 2 => parts.into_iter(),
        other => return Err(StoreError::Corrupt(format!("unexpected reply of SCAN: {other:?}"))),
    };
    let cursor = bulk(parts.next().unwrap_or_default(), "the cursor of SCAN")?;
    let keys = array(parts.next().unwrap_or_default(), "the keys SCAN found")?
        .into_iter()
        .map(|key| bulk(key, "a key SCAN found"))
        .collect::<Result<_, _>>()?;
    Ok((cursor, keys))
}

/// The text of a string reply (bulk, simple or verbatim), if it is one in UTF-8.
pub(crate) fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(text) | Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// The error for a reply of the wrong shape to a command that is not a script (`what`): the
/// redis crate's `UnexpectedReturnType`, so it is taken as the store being unavailable.
pub(crate) fn unexpected(what: &str, got: &dyn std::fmt::Debug) -> redis::RedisError {
    (
        redis::ErrorKind::UnexpectedReturnType,
        "unexpected reply",
        format!("{what}: {got:?}"),
    )
        .into()
}

/// A time stored as decimal Unix milliseconds.
pub(crate) fn parse_millis(digits: &[u8]) -> Option<i64> {
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// The scope salt from the reply of the `scope_salt` script (the fields of `key`); `None` if there
/// is none.
pub(crate) fn parse_scope_salt(
    mut items: std::vec::IntoIter<Value>,
    key: &str,
) -> Result<Option<ScopeSalt>, StoreError> {
    let Some(mut fields) = parse_hash(items.next().unwrap_or_default())? else {
        return Ok(None);
    };
    let corrupt = |what: String| StoreError::Corrupt(format!("the scope salt {key}: {what}"));
    let salt = fields.remove(b"salt".as_slice()).unwrap_or_default();
    let salt = <[u8; 32]>::try_from(salt.as_slice())
        .map_err(|_| corrupt(format!("its salt is {} bytes long, not 32", salt.len())))?;
    let mut time = |field: &str| {
        fields
            .remove(field.as_bytes())
            .map(|digits| {
                parse_millis(&digits)
                    .map(UnixMillis::from_i64)
                    .ok_or_else(|| corrupt(format!("no valid {field}")))
            })
            .transpose()
    };
    let created_at = time("created_at")?.ok_or_else(|| corrupt("no created_at".to_owned()))?;
    let older_records_until = time("older_records_until")?;
    let identity = fields.remove(b"identity".as_slice()).unwrap_or_default();
    let identity = parse_identity(&identity).ok_or_else(|| corrupt("no valid identity".to_owned()))?;
    Ok(Some(ScopeSalt {
        salt,
        identity,
        created_at,
        older_records_until,
    }))
}

/// A store's identity as the scripts keep it: 32 hex digits.
pub(crate) fn parse_identity(hex: &[u8]) -> Option<StoreIdentity> {
    if hex.len() != 32 {
        return None;
    }
    let mut bytes = [0; 16];
    for (byte, pair) in bytes.iter_mut().zip(hex.chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(StoreIdentity::from_bytes(bytes))
}

/// The value of a Lua `false` or a missing key.
fn is_nil(value: &Value) -> bool {
    matches!(value, Value::Nil | Value::Boolean(false))
}

fn bulk(value: Value, what: &str) -> Result<Vec<u8>, StoreError> {
    match value {
        Value::BulkString(bytes) => Ok(bytes),
        Value::SimpleString(text) => Ok(text.into_bytes()),
        other => Err(StoreError::Corrupt(format!(
            "expected {what}, Redis answered {other:?}"
        ))),
    }
}

fn array(value: Value, what: &str) -> Result<Vec<Value>, StoreError> {
    match value {
        Value::Array(items) => Ok(items),
        other => Err(StoreError::Corrupt(format!(
            "expected {what}, Redis answered {other:?}"
        ))),
    }
}

/// The fields of a record the scripts return, in this order (`read_record` in the scripts'
/// prelude): one value each, nil where the hash has none. Values only, no names: a shorter reply to
/// send and to parse on every replay.
const RECORD_FIELDS: [&str; 14] = [
    "state",
    "fingerprint",
    "token",
    "lease_until",
    "created_at",
    "completed_at",
    "expires_at",
    "purge_at",
    "replays",
    "digest",
    "recovered",
    "trace_id",
    "origin",
    "status",
];

/// The fields `begin` reads and returns (`read_claim` in the scripts): the first of
/// [`RECORD_FIELDS`]: what a claim or a replay needs, and the run's trace (a replay's span links to
/// it), without the rest of what a record keeps for the operator.
const CLAIM_FIELDS: &[&str] = RECORD_FIELDS.split_at(12).0;

/// The fields `list` reads of every record it finds (one `HMGET` each): what a [`Listed`] shows,
/// never the fingerprint, the token or the answer.
pub(crate) const LISTED_FIELDS: [&str; 9] = [
    "state",
    "created_at",
    "expires_at",
    "purge_at",
    "replays",
    "recovered",
    "origin",
    "trace_id",
    "status",
];

/// A record's fields as a script returned them (see [`RECORD_FIELDS`]), and its body.
pub(crate) struct StoredHash {
    fields: [Option<Vec<u8>>; RECORD_FIELDS.len()],
    body: Option<Vec<u8>>,
}

impl StoredHash {
    /// `None` for a missing record (nil).
    pub(crate) fn parse(fields: Value, body: Value) -> Result<Option<Self>, StoreError> {
        Self::parse_fields(&RECORD_FIELDS, fields, body)
    }

    /// [`parse`](Self::parse) of the fields `names` only, in that order.
    fn parse_fields(names: &[&str], fields: Value, body: Value) -> Result<Option<Self>, StoreError> {
        if is_nil(&fields) {
            return Ok(None);
        }
        let mut hash = Self::of(names, array(fields, "the record's fields")?)?;
        if !is_nil(&body) {
            hash.body = Some(bulk(body, "the stored answer")?);
        }
        Ok(Some(hash))
    }

    /// The values of the fields `names` (some of [`RECORD_FIELDS`]), in that order, as `HMGET`
    /// returned them; the others, and the body, none.
    fn of(names: &[&str], values: Vec<Value>) -> Result<Self, StoreError> {
        if values.len() != names.len() {
            return Err(StoreError::Corrupt(format!(
                "the record came with {} fields, not {}",
                values.len(),
                names.len()
            )));
        }
        let mut fields: [Option<Vec<u8>>; RECORD_FIELDS.len()] = Default::default();
        for (name, value) in names.iter().zip(values) {
            let at = RECORD_FIELDS
                .iter()
                .position(|field| field == name)
                .expect("one of RECORD_FIELDS");
            if !is_nil(&value) {
                fields[at] = Some(bulk(value, name)?);
            }
        }
        Ok(Self { fields, body: None })
    }

    /// The value of field `name`, one of [`RECORD_FIELDS`].
    fn field(&self, name: &str) -> Option<&[u8]> {
        let at = RECORD_FIELDS.iter().position(|field| *field == name)?;
        self.fields[at].as_deref()
    }

    pub(crate) fn into_record(self, id: RecordId) -> Result<Record, StoreError> {
        self.into_stored(&id)?.into_record(id)
    }

    /// The fields as a [`StoredRecord`], before they are checked.
    fn into_stored(self, id: &RecordId) -> Result<StoredRecord, StoreError> {
        let Self { fields, body } = self;
        let corrupt = |what: &str| StoreError::Corrupt(format!("record {} {}: {what}", id.scope, id.key));
        let [
            state,
            fingerprint,
            token,
            lease_until,
            created_at,
            completed_at,
            expires_at,
            purge_at,
            replays,
            _digest,
            recovered,
            trace_id,
            origin,
            status,
        ] = fields;
        let number = |value: Option<Vec<u8>>, field: &str| -> Result<Option<i64>, StoreError> {
            value
                .map(|bytes| parse_millis(&bytes).ok_or_else(|| corrupt(&format!("no valid {field}"))))
                .transpose()
        };
        let state = state
            .and_then(|bytes| String::from_utf8(bytes).ok())
            .ok_or_else(|| corrupt("no state"))?;
        let stored_origin = origin.as_deref().and_then(origin::decode);
        Ok(StoredRecord {
            state,
            fingerprint: fingerprint.unwrap_or_default(),
            token,
            lease_until: number(lease_until, "lease_until")?,
            response: body,
            created_at: number(created_at, "created_at")?.ok_or_else(|| corrupt("no created_at"))?,
            completed_at: number(completed_at, "completed_at")?,
            expires_at: number(expires_at, "expires_at")?,
            purge_at: number(purge_at, "purge_at")?,
            replays: number(replays, "replays")?.ok_or_else(|| corrupt("no replays"))?,
            // What the record says about its request decides nothing: a field that does not read
            // is left out (empty, none, false), never a corrupt record. A record written before
            // records kept them has none of them.
            method: stored_origin.map(|origin| origin.method.to_owned()).unwrap_or_default(),
            path: stored_origin.map(|origin| origin.path.to_owned()).unwrap_or_default(),
            trace_id: trace_id
                .filter(|hex| !hex.is_empty())
                .and_then(|hex| String::from_utf8(hex).ok()),
            recovered: recovered.as_deref() == Some(b"1"),
            status: status.as_deref().and_then(parse_millis),
        })
    }
}

/// What `list` makes of one record it found.
pub(crate) enum Found {
    /// The record, judged at the query's `now`.
    Listed(Listed),
    /// Gone since the scan found it, or past its `purge_at` (as good as gone: `get` reads none).
    Gone,
    /// Written before records kept their scope and key: `list` cannot name it.
    WithoutOrigin,
}

/// What the record hash `name` is, from `values` (its reply to an `HMGET` of [`LISTED_FIELDS`]),
/// judged at `now`; why it does not read otherwise. `record_name` gives the hash name of a record,
/// to check that the scope and key its `origin` holds are its own.
pub(crate) fn parse_listed(
    name: &[u8],
    values: Value,
    now: UnixMillis,
    record_name: impl Fn(&RecordId) -> String,
) -> Result<Found, String> {
    let values = match values {
        Value::Array(values) => values,
        Value::ServerError(err) => return Err(format!("Redis answered {err:?}")),
        other => return Err(format!("expected its fields, Redis answered {other:?}")),
    };
    let hash = StoredHash::of(&LISTED_FIELDS, values).map_err(|err| err.to_string())?;
    if hash.field("state").is_none() {
        return Ok(Found::Gone);
    }
    let Some(stored_origin) = hash.field("origin") else {
        return Ok(Found::WithoutOrigin);
    };
    let stored_origin = origin::decode(stored_origin).ok_or("its origin does not read")?;
    let key = IdempotencyKey::new(stored_origin.key).map_err(|err| format!("its key does not read: {err}"))?;
    let id = RecordId {
        scope: Scope::from_stored(stored_origin.scope),
        key,
    };
    // An origin that reads but names another record would make the operator act on that one.
    if record_name(&id).as_bytes() != name {
        return Err("its origin names another record".to_owned());
    }
    let stored = hash.into_stored(&id).map_err(|err| err.to_string())?;
    if stored.purge_at.is_some_and(|purge_at| purge_at <= now.as_i64()) {
        return Ok(Found::Gone);
    }
    stored
        .listed(id, true, now)
        .map(Found::Listed)
        .ok_or_else(|| format!("its state {:?} is no state", stored.state))
}

/// A hash's fields by name.
type HashFields = HashMap<Vec<u8>, Vec<u8>>;

/// The fields of a hash as `HGETALL` returned them; `None` for a missing key (an empty hash).
fn parse_hash(fields: Value) -> Result<Option<HashFields>, StoreError> {
    // A script's reply is an array; `HGETALL` itself answers a map on a RESP3 connection.
    let fields = match fields {
        Value::Map(pairs) => Value::Array(pairs.into_iter().flat_map(|(name, value)| [name, value]).collect()),
        other => other,
    };
    let flat = array(fields, "the hash's fields")?;
    if flat.is_empty() {
        return Ok(None);
    }
    if flat.len() % 2 != 0 {
        return Err(StoreError::Corrupt("the hash's fields are not pairs".to_owned()));
    }
    let mut fields = HashMap::with_capacity(flat.len() / 2);
    let mut items = flat.into_iter();
    while let (Some(name), Some(value)) = (items.next(), items.next()) {
        fields.insert(bulk(name, "a field name")?, bulk(value, "a field value")?);
    }
    Ok(Some(fields))
}

/// The checkpoints as the `checkpoints` script returns them: names and values, alternating, in
/// the order the names were first written.
pub(crate) fn parse_checkpoints(
    mut items: std::vec::IntoIter<Value>,
    id: &RecordId,
) -> Result<Vec<Checkpoint>, StoreError> {
    let flat = array(items.next().unwrap_or_default(), "the checkpoints")?;
    if flat.len() % 2 != 0 {
        return Err(StoreError::Corrupt(format!(
            "record {} {}: the checkpoints are not name and value pairs",
            id.scope, id.key
        )));
    }
    let mut checkpoints = Vec::with_capacity(flat.len() / 2);
    let mut items = flat.into_iter();
    while let (Some(name), Some(value)) = (items.next(), items.next()) {
        let name = String::from_utf8(bulk(name, "a checkpoint's name")?).map_err(|_| {
            StoreError::Corrupt(format!(
                "record {} {}: a checkpoint's name is not UTF-8",
                id.scope, id.key
            ))
        })?;
        let value = bulk(value, "a checkpoint's value")?.into();
        checkpoints.push(Checkpoint { name, value });
    }
    Ok(checkpoints)
}

/// The reply of the `begin` script to `request`, and whether the request replays the record's
/// answer (by the claim rule every store shares, [`StoredRecord::on_begin`]).
/// What the `begin` script did: claimed or read the record (and whether that read was a replay,
/// which it counted), or nothing, the store's identity being another than the caller's (the
/// identity the script found, empty for none).
// Not boxed, as `Begin` is not: once per claim, and the record carries heap data anyway.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Claimed {
    Begun(Begin, bool),
    OtherStore(Vec<u8>),
}

pub(crate) fn parse_begin(
    mut items: std::vec::IntoIter<Value>,
    request: &BeginRequest<'_>,
) -> Result<Claimed, StoreError> {
    let outcome = bulk(items.next().unwrap_or_default(), "the outcome of begin")?;
    match outcome.as_slice() {
        b"acquired" => {
            let recovered = match items.next() {
                Some(Value::Int(flag)) => flag != 0,
                other => return Err(StoreError::Corrupt(format!("unexpected recovered flag {other:?}"))),
            };
            Ok(Claimed::Begun(Begin::Acquired { recovered }, false))
        }
        b"existing" => {
            let fields = items.next().unwrap_or_default();
            let body = items.next().unwrap_or_default();
            let stored = StoredHash::parse_fields(CLAIM_FIELDS, fields, body)?
                .ok_or_else(|| StoreError::Corrupt("begin returned an empty record".to_owned()))?;
            let same_request = stored.field("digest") == Some(&request.fingerprint.digest()[..]);
            let stored = stored.into_stored(request.id)?;
            let replay = stored.on_begin(same_request, request.now.as_i64()) == Existing::Replay;
            Ok(Claimed::Begun(
                Begin::Existing(stored.into_record(request.id.clone())?),
                replay,
            ))
        }
        b"other-store" => Ok(Claimed::OtherStore(bulk(
            items.next().unwrap_or_default(),
            "the identity held",
        )?)),
        other => Err(StoreError::Corrupt(format!(
            "unexpected outcome of begin {:?}",
            String::from_utf8_lossy(other)
        ))),
    }
}
