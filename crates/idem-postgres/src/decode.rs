//! Rows as the store reads them, turned into the stored forms idem-core checks: a record's row into
//! a [`StoredRecord`] (and its digest), a listed row into a [`Listed`], the checkpoint arrays into
//! [`Checkpoint`]s, the scope salt's row into a [`ScopeSalt`]. A value of the wrong type is a
//! corrupt record, never a panic.

use idem_core::store::backend::StoredRecord;
use idem_core::{
    StoreError, UnixMillis,
    store::{Checkpoint, Listed, Record, RecordId, ScopeSalt, StoreIdentity},
};
use tokio_postgres::Row;

use crate::error::describe;

/// A row as stored: the record's fields, and the digest the claim rules compare.
pub(crate) struct StoredRow {
    pub(crate) digest: Vec<u8>,
    pub(crate) stored: StoredRecord,
}

impl StoredRow {
    /// Reads the columns of [`SELECT`](crate::sql::SELECT), in order; a value of the wrong type is a corrupt record.
    pub(crate) fn from_row(row: &Row, id: &RecordId) -> Result<Self, StoreError> {
        let read = || -> Result<Self, tokio_postgres::Error> {
            Ok(Self {
                digest: row.try_get(2)?,
                stored: StoredRecord {
                    state: row.try_get(0)?,
                    fingerprint: row.try_get(1)?,
                    token: row.try_get(3)?,
                    lease_until: row.try_get(4)?,
                    response: row.try_get(5)?,
                    created_at: row.try_get(6)?,
                    completed_at: row.try_get(7)?,
                    expires_at: row.try_get(8)?,
                    purge_at: Some(row.try_get(9)?),
                    replays: row.try_get(10)?,
                    method: row.try_get(11)?,
                    path: row.try_get(12)?,
                    trace_id: row.try_get(13)?,
                    recovered: row.try_get(14)?,
                    status: row.try_get::<_, Option<i32>>(15)?.map(i64::from),
                },
            })
        };
        read().map_err(|err| StoreError::Corrupt(format!("record {} {}: {}", id.scope, id.key, describe(&err))))
    }

    pub(crate) fn into_record(self, id: RecordId) -> Result<Record, StoreError> {
        self.stored.into_record(id)
    }
}

/// Reads a row of [`LIST`](crate::sql::LIST), its state judged at `now`. What does not read (a
/// value of the wrong type, a key that is not one, a state that is none) is described, for the
/// warning with which the listing skips it.
pub(crate) fn listed_from_row(row: &Row, now: UnixMillis) -> Result<Listed, String> {
    let (scope, key): (String, String) = (
        row.try_get(0).map_err(|err| describe(&err))?,
        row.try_get(1).map_err(|err| describe(&err))?,
    );
    let read = || -> Result<(StoredRecord, bool), tokio_postgres::Error> {
        let stored = StoredRecord {
            state: row.try_get(2)?,
            expires_at: row.try_get(3)?,
            purge_at: row.try_get(4)?,
            created_at: row.try_get(6)?,
            replays: row.try_get(7)?,
            method: row.try_get(8)?,
            path: row.try_get(9)?,
            trace_id: row.try_get(10)?,
            recovered: row.try_get(11)?,
            status: row.try_get::<_, Option<i32>>(12)?.map(i64::from),
            ..StoredRecord::default()
        };
        Ok((stored, row.try_get(5)?))
    };
    let (stored, has_answer) = read().map_err(|err| format!("record {scope} {key}: {}", describe(&err)))?;
    stored.listed_as(&scope, &key, has_answer, now)
}

/// Reads the columns of [`CHECKPOINTS`](crate::sql::CHECKPOINTS); values of the wrong type (or `NULL`s) and arrays that do
/// not line up are a corrupt record.
pub(crate) fn checkpoints_from_row(row: &Row, id: &RecordId) -> Result<Vec<Checkpoint>, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt(format!("record {} {}: {detail}", id.scope, id.key));
    let names: Vec<String> = row.try_get(0).map_err(|err| corrupt(describe(&err)))?;
    let values: Vec<Vec<u8>> = row.try_get(1).map_err(|err| corrupt(describe(&err)))?;
    pair_checkpoints(names, values).map_err(corrupt)
}

/// Reads the columns of [`SCOPE_SALT_SELECT`](crate::sql::SCOPE_SALT_SELECT); values of the wrong type and a salt of the wrong
/// length are a corrupt store.
/// `None` for a salt without an identity (made by an instance of a version before identities,
/// after the migration that gave the salt of then one).
pub(crate) fn scope_salt_from_row(row: &Row) -> Result<Option<ScopeSalt>, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt(format!("the scope salt: {detail}"));
    let salt: Vec<u8> = row.try_get(0).map_err(|err| corrupt(describe(&err)))?;
    let created_at: i64 = row.try_get(1).map_err(|err| corrupt(describe(&err)))?;
    let older_records_until: Option<i64> = row.try_get(2).map_err(|err| corrupt(describe(&err)))?;
    let salt = <[u8; 32]>::try_from(salt.as_slice())
        .map_err(|_| corrupt(format!("{} bytes where 32 were expected", salt.len())))?;
    let Some(identity) = identity_from_row(row, 3)? else {
        return Ok(None);
    };
    Ok(Some(ScopeSalt {
        salt,
        identity,
        created_at: UnixMillis::from_i64(created_at),
        older_records_until: older_records_until.map(UnixMillis::from_i64),
    }))
}

/// The store's identity in column `index` (`None`: `NULL`); one of the wrong length or type is a
/// corrupt store.
pub(crate) fn identity_from_row(row: &Row, index: usize) -> Result<Option<StoreIdentity>, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt(format!("the store's identity: {detail}"));
    let identity: Option<Vec<u8>> = row.try_get(index).map_err(|err| corrupt(describe(&err)))?;
    identity
        .map(|bytes| {
            <[u8; 16]>::try_from(bytes.as_slice())
                .map(StoreIdentity::from_bytes)
                .map_err(|_| corrupt(format!("{} bytes where 16 were expected", bytes.len())))
        })
        .transpose()
}

/// Pairs each name with the value at its position.
fn pair_checkpoints(names: Vec<String>, values: Vec<Vec<u8>>) -> Result<Vec<Checkpoint>, String> {
    if names.len() != values.len() {
        return Err(format!(
            "{} checkpoint names but {} checkpoint values",
            names.len(),
            values.len()
        ));
    }
    Ok(names
        .into_iter()
        .zip(values)
        .map(|(name, value)| Checkpoint {
            name,
            value: value.into(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_pair_names_and_values_by_position() {
        let pairs = pair_checkpoints(
            vec!["reserved".to_owned(), "charged".to_owned()],
            vec![b"order 8".to_vec(), vec![0, 0xff]],
        )
        .unwrap();
        assert_eq!(
            pairs,
            vec![
                Checkpoint {
                    name: "reserved".to_owned(),
                    value: bytes::Bytes::from_static(b"order 8"),
                },
                Checkpoint {
                    name: "charged".to_owned(),
                    value: bytes::Bytes::from_static(&[0, 0xff]),
                },
            ]
        );
        assert!(pair_checkpoints(Vec::new(), Vec::new()).unwrap().is_empty());
        let err = pair_checkpoints(vec!["charged".to_owned()], Vec::new()).unwrap_err();
        assert_eq!(err, "1 checkpoint names but 0 checkpoint values");
    }
}
