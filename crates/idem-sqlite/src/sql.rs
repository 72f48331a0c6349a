//! The statements of the store's operations, as `store.rs` runs them. The schema they run on is
//! `schema.rs`'s; every parameter is numbered, and a record's statements take the scope as `?1`
//! and the key as `?2`.

/// The record's columns that [`crate::decode::StoredRow`] reads, in its order, for a key.
pub(crate) const SELECT_RECORD: &str =
    "SELECT state, fingerprint, digest, token, lease_until, response, created_at, completed_at,
        expires_at, purge_at, replays, method, path, trace_id, recovered, status
    FROM idem_records WHERE scope = ?1 AND key = ?2";

/// A new key's claim, with what the record keeps about its request (method `?10`, path `?11`,
/// trace id `?12`); returns a row only if it made one.
pub(crate) const CLAIM: &str = "INSERT INTO idem_records
        (scope, key, state, fingerprint, digest, token, lease_until, created_at, expires_at, purge_at,
         replays, method, path, trace_id)
    VALUES (?1, ?2, 'in-flight', ?3, ?4, ?5, ?6, ?7, ?9, ?8, 0, ?10, ?11, ?12)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING 1";

/// A record past its `purge_at` is claimed anew, as if it were absent: nothing of it is kept,
/// its checkpoints, its origin, its recovery and its answer's status included. The parameters
/// are [`CLAIM`]'s.
pub(crate) const REPLACE: &str = "UPDATE idem_records
    SET state = 'in-flight', fingerprint = ?3, digest = ?4, token = ?5, lease_until = ?6,
        response = NULL, created_at = ?7, completed_at = NULL, expires_at = ?9,
        purge_at = ?8, replays = 0, checkpoints = NULL, method = ?10, path = ?11, trace_id = ?12,
        recovered = 0, status = NULL
    WHERE scope = ?1 AND key = ?2";

/// The checkpoints stay: the new run resumes from them. The new run has a ttl of its own, and
/// the record now names it: its trace id `?7` (`NULL` if its request carried none) and whether
/// it is recovered (`?8`). The method, path and creation time are the key's first claim's.
pub(crate) const TAKE_OVER: &str = "UPDATE idem_records
    SET state = 'in-flight', token = ?3, lease_until = ?4, purge_at = ?5, expires_at = ?6,
        trace_id = ?7, recovered = ?8
    WHERE scope = ?1 AND key = ?2";

/// A replay is counted in the same transaction that read the record.
pub(crate) const COUNT_REPLAY: &str = "UPDATE idem_records SET replays = replays + 1 WHERE scope = ?1 AND key = ?2";

/// Adds replays answered from a replay cache to a record (nothing if it is gone).
pub(crate) const ADD_REPLAYS: &str = "UPDATE idem_records SET replays = replays + ?3 WHERE scope = ?1 AND key = ?2";

/// The run is over, and so are its checkpoints. The token stays, as the claim that completed the
/// record ([`CLAIM_STATE`]), and so does `recovered`, which tells whether the run that answered
/// was recovered; the answer's status `?8` is kept beside it. Also run in a handler's own
/// transaction (`complete_in`).
pub(crate) const COMPLETE: &str = "UPDATE idem_records
    SET state = 'completed', lease_until = NULL, response = ?4,
        completed_at = ?5, expires_at = ?6, purge_at = ?7, checkpoints = NULL, status = ?8
    WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in-flight'";

/// Where the claim `?3` stands: the record's state and whether `?3` is its token (the current
/// claim's when in flight, the completing claim's when completed); no row without a record.
pub(crate) const CLAIM_STATE: &str = "SELECT state, token IS ?3 FROM idem_records WHERE scope = ?1 AND key = ?2";

/// Whether the record holds checkpoints (read before a takeover decides whether it recovers).
pub(crate) const HAS_CHECKPOINTS: &str =
    "SELECT checkpoints IS NOT NULL AND length(checkpoints) > 0 FROM idem_records WHERE scope = ?1 AND key = ?2";

/// Rolls the caller's whole transaction back (the `CHECK` of `idem_fence` fails, and `OR ROLLBACK`
/// ends the transaction): run in a handler's transaction whose claim was lost, so that none of
/// its writes can commit.
#[cfg(feature = "sqlx")]
pub(crate) const ABORT_TRANSACTION: &str = "INSERT OR ROLLBACK INTO idem_fence (aborted) VALUES (1)";

pub(crate) const FORGET: &str = "DELETE FROM idem_records
    WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in-flight'";

/// The fingerprint and the checkpoints stay: only the same request may take the record over, and
/// it resumes where this run stopped.
pub(crate) const RELEASE_UNKNOWN: &str = "UPDATE idem_records
    SET state = 'unknown', token = NULL, lease_until = NULL, expires_at = ?4, purge_at = ?5
    WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in-flight'";

/// Renewing moves an in-flight record's `purge_at` to the new lease's end if that is later; a claim
/// made before claims carried a `purge_at` of their own (no `expires_at`) keeps the old rule.
pub(crate) const RENEW: &str = "UPDATE idem_records
    SET lease_until = ?4,
        purge_at = CASE WHEN expires_at IS NULL THEN ?5 ELSE max(purge_at, ?4) END
    WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in-flight'";

/// The checkpoints of the claim `?3`; no row if it is not the record's current claim.
pub(crate) const CHECKPOINTS_OF_CLAIM: &str = "SELECT checkpoints FROM idem_records
    WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in-flight'";

pub(crate) const SET_CHECKPOINTS: &str = "UPDATE idem_records SET checkpoints = ?3 WHERE scope = ?1 AND key = ?2";

/// A completed record has none (`complete` clears them); the state is checked all the same.
pub(crate) const CHECKPOINTS: &str = "SELECT checkpoints FROM idem_records
    WHERE scope = ?1 AND key = ?2 AND state <> 'completed'";

/// Makes the scope salt from the candidate unless there is one. `max(purge_at)` is read off the
/// `purge_at` index, not by a scan.
pub(crate) const SCOPE_SALT_INSERT: &str =
    "INSERT INTO idem_scope_salt (id, salt, created_at, older_records_until, identity)
    VALUES (1, ?1, ?2, (SELECT max(purge_at) FROM idem_records), ?3)
    ON CONFLICT (id) DO NOTHING";

/// A salt made before salts had an identity gets the candidate's (the first caller's after the
/// upgrade: later ones find it set).
pub(crate) const SCOPE_SALT_IDENTIFY: &str =
    "UPDATE idem_scope_salt SET identity = ?1 WHERE id = 1 AND identity IS NULL";

pub(crate) const SCOPE_SALT_SELECT: &str =
    "SELECT salt, created_at, older_records_until, identity FROM idem_scope_salt WHERE id = 1";

/// The store's identity, read in a claim's transaction to check it, and by replay caches.
pub(crate) const IDENTITY: &str = "SELECT identity FROM idem_scope_salt WHERE id = 1";

/// An operator's delete of a claim in flight: the holder is fenced (no token), the key is left
/// unknown with the claim's retention, and the run's checkpoints go (see `Store::delete`).
pub(crate) const DELETE_IN_FLIGHT: &str = "UPDATE idem_records
    SET state = 'unknown', token = NULL, lease_until = NULL, expires_at = COALESCE(expires_at, purge_at),
        checkpoints = NULL
    WHERE scope = ?1 AND key = ?2 AND state = 'in-flight'";

/// An operator's delete of any other record.
pub(crate) const DELETE: &str = "DELETE FROM idem_records WHERE scope = ?1 AND key = ?2";

/// Deletes up to `?2` records due at `?1`. `DELETE ... LIMIT` is not compiled into the bundled
/// SQLite: delete by rowid.
pub(crate) const PURGE_DELETE: &str = "DELETE FROM idem_records WHERE rowid IN
    (SELECT rowid FROM idem_records WHERE purge_at <= ?1 LIMIT ?2)";

/// Drops up to `?2` answers expired at `?1`, found through the partial `expires_at` index.
pub(crate) const PURGE_TOMBSTONE: &str = "UPDATE idem_records SET response = NULL WHERE rowid IN
    (SELECT rowid FROM idem_records WHERE response IS NOT NULL AND expires_at <= ?1 LIMIT ?2)";

/// The records an operator asks for ([`idem_core::store::ListQuery`]), newest first, at most
/// `?6`, with the query's every condition pushed down as [`ListQuery::matches`] states it:
///
/// - `?1` is the query's `now`, by which states are judged as [`ListedState::at`] judges them
///   (the `CASE`; a `NULL` time is never live).
/// - `?2` the earliest `created_at` (`i64::MIN` for any), a range on `idem_records_created_at`,
///   which is walked backwards for the order.
/// - `?3` the listed state's word, or `NULL` for any.
/// - `?4` true for only the records whose latest run was recovered.
/// - `?5` the query's route (`ListQuery::route_reading`: read as servers read paths, in ASCII
///   lower case) as a blob, or `NULL` for any: [`path_is_under`] on bytes, against the path in
///   ASCII lower case (SQLite's `lower` lowers ASCII letters only, as Rust's
///   `to_ascii_lowercase`). SQLite's `substr` and `length` count characters in text but bytes in
///   blobs, and `LIKE` would read `%` and `_` in the path as wildcards, so the path is compared as
///   bytes, prefix and following `/` alike. A route is never empty (the reading of an empty one
///   is `/`, which takes every path).
///
/// Ties in `created_at` are ordered by scope and key under the `BINARY` collation, byte by byte,
/// as Rust compares strings ([`Listed::newest_first`]). The answers themselves are never read,
/// only whether there is one.
///
/// [`ListQuery::matches`]: idem_core::store::ListQuery::matches
/// [`ListedState::at`]: idem_core::store::ListedState::at
/// [`path_is_under`]: idem_core::store::path_is_under
/// [`Listed::newest_first`]: idem_core::store::Listed::newest_first
pub(crate) const LIST: &str = "SELECT scope, key, state, expires_at, purge_at, response IS NOT NULL,
        created_at, replays, method, path, trace_id, recovered, status
    FROM idem_records
    WHERE created_at >= ?2
        AND (?3 IS NULL OR ?3 = CASE
            WHEN state = 'in-flight' THEN 'in-flight'
            WHEN state = 'unknown' AND COALESCE(expires_at, purge_at) > ?1 THEN 'unknown'
            WHEN state = 'completed' AND response IS NOT NULL AND expires_at > ?1 THEN 'completed'
            ELSE 'tombstone'
        END)
        AND (NOT ?4 OR recovered)
        AND (?5 IS NULL OR ?5 = X'2F' OR (
            substr(CAST(lower(path) AS BLOB), 1, length(?5)) = ?5
            AND (length(CAST(path AS BLOB)) = length(?5)
                OR substr(CAST(path AS BLOB), length(?5) + 1, 1) = X'2F')))
    ORDER BY created_at DESC, scope, key
    LIMIT ?6";

pub(crate) const PING: &str = "SELECT 1";
