//! [`Store::list`](idem_core::Store::list) on SQLite: one query with the operator's every condition
//! in its `WHERE` ([`sql::LIST`]), read off the `created_at` index newest first, and its rows
//! turned into [`Listed`] records, skipping any that cannot be.

use idem_core::StoreError;
use idem_core::store::{ListQuery, Listed};
use rusqlite::{Connection, params};

use crate::conn::db_error;
use crate::decode::ListedRow;
use crate::sql;

/// The records `query` asks for, in [`Listed::newest_first`] order, at most `query.limit`.
///
/// A row that cannot be read (a value of the wrong type, a key that is no key) is skipped with a
/// warning rather than failing the whole list: listing is an operator's question, and the
/// operator still reads such a record with `idem inspect`. A failure of SQLite itself fails it.
pub(crate) fn list(conn: &Connection, query: &ListQuery) -> Result<Vec<Listed>, StoreError> {
    let route = query.route_reading();
    let mut stmt = conn.prepare_cached(sql::LIST).map_err(db_error)?;
    let rows = stmt
        .query_map(
            params![
                query.now.as_i64(),
                query.since.map_or(i64::MIN, |since| since.as_i64()),
                query.state.map(|state| state.as_str()),
                query.recovered,
                route.as_deref().map(str::as_bytes),
                i64::try_from(query.limit).unwrap_or(i64::MAX)
            ],
            ListedRow::from_row,
        )
        .map_err(db_error)?;
    let mut listed = Vec::with_capacity(query.limit.min(1024));
    for row in rows {
        let row = match row.map_err(db_error) {
            Ok(row) => row.listed(query.now),
            Err(StoreError::Corrupt(why)) => Err(why),
            Err(err) => return Err(err),
        };
        match row {
            Ok(record) => listed.push(record),
            Err(why) => tracing::warn!(%why, "skipping a record that cannot be listed"),
        }
    }
    Ok(listed)
}
