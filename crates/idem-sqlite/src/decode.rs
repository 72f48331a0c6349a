//! Rows as the store reads them, turned into the stored forms idem-core checks: a record's row
//! into a [`StoredRecord`] (and its digest), a listed record's row into a [`Listed`], the scope
//! salt's row into a [`ScopeSalt`].

use idem_core::store::backend::StoredRecord;
use idem_core::{
    StoreError, UnixMillis,
    store::{Listed, Record, RecordId, ScopeSalt, StoreIdentity},
};
use rusqlite::Row;

/// A row as stored: the record's fields, and the digest the claim rules compare.
pub(crate) struct StoredRow {
    pub(crate) digest: Vec<u8>,
    pub(crate) stored: StoredRecord,
}

impl StoredRow {
    /// Reads the columns of [`SELECT_RECORD`](crate::sql::SELECT_RECORD), in order.
    pub(crate) fn from_row(row: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            digest: row.get(2)?,
            stored: StoredRecord {
                state: row.get(0)?,
                fingerprint: row.get(1)?,
                token: row.get(3)?,
                lease_until: row.get(4)?,
                response: row.get(5)?,
                created_at: row.get(6)?,
                completed_at: row.get(7)?,
                expires_at: row.get(8)?,
                purge_at: Some(row.get(9)?),
                replays: row.get(10)?,
                method: row.get(11)?,
                path: row.get(12)?,
                trace_id: row.get(13)?,
                recovered: row.get(14)?,
                status: row.get(15)?,
            },
        })
    }

    pub(crate) fn into_record(self, id: RecordId) -> Result<Record, StoreError> {
        self.stored.into_record(id)
    }
}

/// A row of [`LIST`](crate::sql::LIST): a record without its fingerprint, token or answer, and
/// whether it holds an answer.
pub(crate) struct ListedRow {
    scope: String,
    key: String,
    has_answer: bool,
    stored: StoredRecord,
}

impl ListedRow {
    /// Reads the columns of [`LIST`](crate::sql::LIST), in order.
    pub(crate) fn from_row(row: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            scope: row.get(0)?,
            key: row.get(1)?,
            has_answer: row.get(5)?,
            stored: StoredRecord {
                state: row.get(2)?,
                expires_at: row.get(3)?,
                purge_at: Some(row.get(4)?),
                created_at: row.get(6)?,
                replays: row.get(7)?,
                method: row.get(8)?,
                path: row.get(9)?,
                trace_id: row.get(10)?,
                recovered: row.get(11)?,
                status: row.get(12)?,
                ..StoredRecord::default()
            },
        })
    }

    /// The record as listed at `now`, or why it cannot be (its key is no key, or its state no
    /// state).
    pub(crate) fn listed(self, now: UnixMillis) -> Result<Listed, String> {
        self.stored.listed_as(&self.scope, &self.key, self.has_answer, now)
    }
}

/// The store's identity from its column (`None`: no salt, or a salt not yet given one); one of
/// the wrong length is a corrupt store.
pub(crate) fn store_identity(identity: Option<Vec<u8>>) -> Result<Option<StoreIdentity>, StoreError> {
    identity
        .map(|bytes| {
            <[u8; 16]>::try_from(bytes.as_slice())
                .map(StoreIdentity::from_bytes)
                .map_err(|_| StoreError::Corrupt(format!("the store's identity is {} bytes long, not 16", bytes.len())))
        })
        .transpose()
}

/// The scope salt from the columns of [`SCOPE_SALT_SELECT`](crate::sql::SCOPE_SALT_SELECT); a salt
/// of the wrong length is a corrupt store.
pub(crate) fn scope_salt(
    salt: Vec<u8>,
    created_at: i64,
    older_records_until: Option<i64>,
    identity: Option<Vec<u8>>,
) -> Result<ScopeSalt, StoreError> {
    let salt = <[u8; 32]>::try_from(salt.as_slice())
        .map_err(|_| StoreError::Corrupt(format!("the scope salt is {} bytes long, not 32", salt.len())))?;
    let identity =
        store_identity(identity)?.ok_or_else(|| StoreError::Corrupt("the scope salt has no identity".to_owned()))?;
    Ok(ScopeSalt {
        salt,
        identity,
        created_at: UnixMillis::from_i64(created_at),
        older_records_until: older_records_until.map(UnixMillis::from_i64),
    })
}
