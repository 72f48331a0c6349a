//! The statements of the store's operations, as `store.rs` runs them. The schema they run on is
//! `schema.rs`'s; every record statement takes the scope as `$1` and the key as `$2`.
//! `bench/pgbench.sh` reads [`CLAIM`] out of this file, to time the store's own claim.

/// A new key's claim, or else the record as it stands, in one statement: one round trip for a
/// new key and for a replay. The record is read first, and only when the read found nothing is
/// the insert run, by `idem_claim_insert` (schema version 8): a replay is a plain `SELECT` of the
/// row, which never opens the table for writing (a statement with the insert in it would, even
/// when the insert does not run: measured in `bench/README.md`). The read is in the statement's
/// snapshot, which misses a row committed after it began: then the insert conflicts with that
/// row and does nothing, no record is returned and nothing was inserted, and the claim is tried
/// again. A new claim keeps the request's origin ($10 to $12: method, path, trace id), not
/// recovered and without a status (the columns' defaults).
///
/// The store's identity is checked in the same statement: unless $13 (the identity the caller
/// knows) is `NULL`, nothing is inserted and the last column is false when the salt's row holds
/// another identity or there is none (the store lost its data, or its schema was made anew).
pub(crate) const CLAIM: &str = "
SELECT f.state, f.fingerprint, f.digest, f.token, f.lease_until, f.response, f.created_at, f.completed_at,
    f.expires_at, f.purge_at, f.replays, f.method, f.path, f.trace_id, f.recovered, f.status,
    CASE WHEN f.state IS NULL AND same.store
        THEN COALESCE(idem_claim_insert($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12), false)
        ELSE false
    END,
    same.store
FROM (
    SELECT $13::bytea IS NULL OR EXISTS (SELECT 1 FROM idem_scope_salt WHERE id = 1 AND identity = $13::bytea) AS store
) AS same
LEFT JOIN (
    SELECT state, fingerprint, digest, token, lease_until, response, created_at, completed_at, expires_at,
        purge_at, replays, method, path, trace_id, recovered, status
    FROM idem_records WHERE scope = $1 AND key = $2
) f ON true";

pub(crate) const SELECT: &str = "
SELECT state, fingerprint, digest, token, lease_until, response, created_at, completed_at, expires_at, purge_at, replays, method, path, trace_id, recovered, status
FROM idem_records WHERE scope = $1 AND key = $2";

/// The row, locked for a takeover or a replacement decided under its lock; never waited for: a
/// row locked by another transaction fails at once (`55P03`), as a run alive (its handler's own
/// transaction completing it) or another claim deciding this instant.
pub(crate) const SELECT_FOR_UPDATE: &str = "
SELECT state, fingerprint, digest, token, lease_until, response, created_at, completed_at, expires_at, purge_at, replays, method, path, trace_id, recovered, status
FROM idem_records WHERE scope = $1 AND key = $2
FOR UPDATE NOWAIT";

/// The start of the statements that must not wait on a run ([`RENEW`], [`FORGET`],
/// [`RELEASE_UNKNOWN`]): the record's row is locked first, without waiting (`55P03` if another
/// transaction holds it: a handler's own, completing the record), and the change is made only
/// if the lock was had. Referenced by the statement (`EXISTS (SELECT 1 FROM locked)`), since a
/// `WITH` query that is not referenced does not run.
macro_rules! locked_first {
    () => {
        "WITH locked AS (
    SELECT 1 FROM idem_records WHERE scope = $1 AND key = $2 FOR NO KEY UPDATE NOWAIT
)"
    };
}

/// `$change`, a change of the record (`UPDATE` or `DELETE`) named `$name` in the statement, and
/// the `NOTIFY` (its payload `$notice`) that wakes the record's waiters if the change found any:
/// the end of a statement whose `WITH` comes before, or (`WITH` first) the whole statement.
macro_rules! waking_waiters {
    (WITH $name:literal, $change:literal, $notice:literal) => {
        concat!("\nWITH ", waking_waiters!($name, $change, $notice))
    };
    ($name:literal, $change:literal, $notice:literal) => {
        concat!(
            $name,
            " AS (\n",
            $change,
            "\n    RETURNING waiters\n)\nSELECT (SELECT pg_notify('idem_records', ",
            $notice,
            ") WHERE ",
            $name,
            ".waiters > 0) FROM ",
            $name
        )
    };
}

/// A record past its `purge_at` is claimed anew, as if it were absent: nothing of it is kept,
/// its checkpoints, origin, recovery and status included. The new claim is $1 to $12, as for
/// [`CLAIM`]; $13 is the notice to its waiters.
pub(crate) const REPLACE: &str = waking_waiters!(
    WITH "replaced",
    "    UPDATE idem_records
    SET state = 'in-flight', fingerprint = $3, digest = $4, token = $5, lease_until = $6,
        response = NULL, created_at = $7, completed_at = NULL, expires_at = $9,
        purge_at = $8, replays = 0, checkpoint_names = '{}', checkpoint_values = '{}',
        method = $10, path = $11, trace_id = $12, recovered = false, status = NULL
    WHERE scope = $1 AND key = $2",
    "$13"
);

/// The checkpoints stay: the new run resumes from them. The new run has a ttl of its own, and the
/// record names it: its trace id ($8) and whether it is recovered ($9). The method, path and
/// creation time stay the first claim's.
pub(crate) const TAKE_OVER: &str = waking_waiters!(
    WITH "taken",
    "    UPDATE idem_records
    SET state = 'in-flight', token = $3, lease_until = $4, purge_at = $5, expires_at = $7, trace_id = $8,
        recovered = $9
    WHERE scope = $1 AND key = $2",
    "$6"
);

/// The run is over, and so are its checkpoints. The token stays, as the claim that completed the
/// record ([`CLAIM_STATE`]), and so does the recovery of the run that answered. The answer's
/// status ($9) is kept beside it, readable without the answer. `idem_complete_claim` (schema.rs)
/// is the same change, made in a handler's own transaction.
pub(crate) const COMPLETE: &str = waking_waiters!(
    WITH "completed",
    "    UPDATE idem_records
    SET state = 'completed', lease_until = NULL, response = $4, status = $9,
        completed_at = $5, expires_at = $6, purge_at = $7,
        checkpoint_names = '{}', checkpoint_values = '{}'
    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in-flight'",
    "$8"
);

/// Where the claim `$3` stands: the record's state and whether `$3` is its token (the current
/// claim's when in flight, the completing claim's when completed); no row without a record. A
/// waiter reads it too, to learn whether the claim it waits on is still current.
pub(crate) const CLAIM_STATE: &str =
    "SELECT state, token IS NOT DISTINCT FROM $3 FROM idem_records WHERE scope = $1 AND key = $2";

/// Whether the record holds checkpoints (read before a takeover decides whether it recovers).
pub(crate) const HAS_CHECKPOINTS: &str =
    "SELECT cardinality(checkpoint_names) > 0 FROM idem_records WHERE scope = $1 AND key = $2";

pub(crate) const FORGET: &str = concat!(
    locked_first!(),
    ", ",
    waking_waiters!(
        "forgotten",
        "    DELETE FROM idem_records
    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in-flight' AND EXISTS (SELECT 1 FROM locked)",
        "$4"
    )
);

/// The fingerprint stays: only the same request may take the record over. So do the
/// checkpoints, for the run that takes it over, and the origin and recovery of the run released.
pub(crate) const RELEASE_UNKNOWN: &str = concat!(
    locked_first!(),
    ", ",
    waking_waiters!(
        "released",
        "    UPDATE idem_records
    SET state = 'unknown', token = NULL, lease_until = NULL, purge_at = $4, expires_at = $6
    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in-flight' AND EXISTS (SELECT 1 FROM locked)",
        "$5"
    )
);

/// Returns the record as it was and, as `Store::delete` says, deletes it, or, for a claim in
/// flight, fences it (no token) and leaves the key unknown with the claim's retention, its
/// checkpoints dropped; waiters on it are woken to look again. The row is locked as it is read,
/// so the change is made to the row returned; a row another transaction holds is not waited
/// for (`55P03`): the command reports the run completing and changes nothing. A claim too
/// damaged to have a token or a lease is deleted, so that an operator can always clear it. Every delete is announced ($4, on commit) to
/// the replay caches of every instance.
pub(crate) const DELETE: &str = "
WITH found AS (
    SELECT state, fingerprint, digest, token, lease_until, response, created_at, completed_at, expires_at, purge_at, replays, method, path, trace_id, recovered, status,
        waiters, state = 'in-flight' AND token IS NOT NULL AND lease_until IS NOT NULL AS in_flight
    FROM idem_records WHERE scope = $1 AND key = $2
    FOR UPDATE NOWAIT
), fenced AS (
    UPDATE idem_records r
    SET state = 'unknown', token = NULL, lease_until = NULL, expires_at = COALESCE(r.expires_at, r.purge_at),
        checkpoint_names = '{}', checkpoint_values = '{}'
    FROM found
    WHERE r.scope = $1 AND r.key = $2 AND found.in_flight
), deleted AS (
    DELETE FROM idem_records r
    USING found
    WHERE r.scope = $1 AND r.key = $2 AND NOT found.in_flight
)
SELECT state, fingerprint, digest, token, lease_until, response, created_at, completed_at, expires_at, purge_at, replays, method, path, trace_id, recovered, status,
    (SELECT pg_notify('idem_records', $3) WHERE found.waiters > 0),
    pg_notify('idem_records', $4)
FROM found";

/// Renewing moves the `purge_at` of the claim to the new lease's end if that is later; a claim
/// made before claims carried a `purge_at` of their own (no `expires_at`) keeps the old rule, $5.
/// A row locked by the run's own open transaction is not waited for (a lock held is a run alive).
pub(crate) const RENEW: &str = concat!(
    locked_first!(),
    "
UPDATE idem_records
SET lease_until = $4, purge_at = CASE WHEN expires_at IS NULL THEN $5 ELSE GREATEST(purge_at, $4) END
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in-flight' AND EXISTS (SELECT 1 FROM locked)"
);

/// Records a checkpoint under the claim, as a compare-and-set on the token. A name already written
/// keeps its position and takes the new value; a new name goes after the others. Both arrays are
/// assigned at the same position, computed (twice, alike) from the row as it was before the
/// statement; assigning one past the end appends.
pub(crate) const CHECKPOINT: &str = "
UPDATE idem_records
SET checkpoint_names[COALESCE(array_position(checkpoint_names, $4::text), cardinality(checkpoint_names) + 1)] = $4::text,
    checkpoint_values[COALESCE(array_position(checkpoint_names, $4::text), cardinality(checkpoint_names) + 1)] = $5::bytea
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in-flight'";

/// A completed record has none (completing empties them); the state is checked all the same.
pub(crate) const CHECKPOINTS: &str = "
SELECT checkpoint_names, checkpoint_values
FROM idem_records WHERE scope = $1 AND key = $2 AND state IN ('in-flight', 'unknown')";

/// Makes the scope salt from the candidate unless there is one; returns it only if made here.
/// `max(purge_at)` reads the end of the `purge_at` index, as of the statement's snapshot: a
/// record committed while it runs is not counted, like one written later by an instance not yet
/// upgraded, and the protocol looks back one retention past this time for both.
pub(crate) const SCOPE_SALT_INSERT: &str = "
INSERT INTO idem_scope_salt (id, salt, created_at, older_records_until, identity)
SELECT 1, $1::bytea, $2::bigint, (SELECT max(purge_at) FROM idem_records), $3::bytea
ON CONFLICT (id) DO NOTHING
RETURNING salt, created_at, older_records_until, identity";

/// A statement of its own after [`SCOPE_SALT_INSERT`] found the row taken: under read committed it
/// sees the row that a concurrent caller committed, which the insert's snapshot may not.
pub(crate) const SCOPE_SALT_SELECT: &str =
    "SELECT salt, created_at, older_records_until, identity FROM idem_scope_salt WHERE id = 1";

/// A salt made by an instance of a version before identities (after the migration that gave the
/// salt of then one) gets the candidate's.
pub(crate) const SCOPE_SALT_IDENTIFY: &str =
    "UPDATE idem_scope_salt SET identity = $1 WHERE id = 1 AND identity IS NULL";

/// The store's identity, for replay caches (no row: no salt).
pub(crate) const IDENTITY: &str = "SELECT identity FROM idem_scope_salt WHERE id = 1";

/// A waiter's mark on the claim it waits on, so that the change that ends the claim notifies
/// (changes of records nobody waits on do not: a `NOTIFY` takes a lock that serialises every
/// notifying commit in the database). Marks no row if the claim is no longer current, and none
/// if the row is locked (by the run's own transaction, completing it): a waiter never queues on
/// the row's lock, holding a pooled connection; it polls instead. The row is found and locked by
/// the sub-select, skipping a locked one; the update repeats no condition, as the row it locked
/// still meets them.
pub(crate) const WAIT_ON: &str = "
UPDATE idem_records SET waiters = waiters + 1
WHERE ctid = ANY (ARRAY (
    SELECT ctid FROM idem_records
    WHERE scope = $1 AND key = $2 AND state = 'in-flight' AND token = $3
    FOR NO KEY UPDATE SKIP LOCKED
))";

/// Keyed on the schema that holds the tables, so that stores in different schemas of one
/// database do not keep each other from purging.
pub(crate) const PURGE_LOCK: &str = "SELECT pg_try_advisory_xact_lock($1, hashtext(COALESCE(current_schema(), '')))";

/// The key of the advisory lock that lets one purger at a time work on a schema (`"idem"`, and
/// the hash of the schema's name as the second key).
pub(crate) const PURGE_LOCK_CLASS: i32 = 0x6964_656d;

/// Deletes by `ctid` (a TID scan) the rows that the sub-select found through the `purge_at` index
/// and locked; rows locked by a running claim are skipped, not waited for. The outer statement
/// repeats no condition: the rows are locked, so they still meet it, and a condition here would
/// tempt the planner into scanning every due row through the index for each batch.
pub(crate) const PURGE_DELETE: &str = "
DELETE FROM idem_records
WHERE ctid = ANY (ARRAY (
    SELECT ctid FROM idem_records
    WHERE purge_at <= $1
    LIMIT $2
    FOR UPDATE SKIP LOCKED
))";

/// Drops expired answers, found through the partial `expires_at` index.
pub(crate) const PURGE_TOMBSTONE: &str = "
UPDATE idem_records SET response = NULL
WHERE ctid = ANY (ARRAY (
    SELECT ctid FROM idem_records
    WHERE response IS NOT NULL AND expires_at <= $1
    LIMIT $2
    FOR UPDATE SKIP LOCKED
))";

/// The records `Store::list` asks for, newest first: $1 the query's `now`, then its conditions,
/// each left out when `NULL` (false for $3): $2 `since`, $3 `recovered`, $4 `path`, $5 the state's
/// word; $6 the limit. Run as an unnamed statement, which is planned with its values, so a
/// condition left out folds away and a `since` bounds the scan of the `created_at` index. The
/// state is `ListedState::at`'s, in SQL; a path matches as `path_is_under` says: `$4` is the
/// query's `route_reading` (in ASCII lower case), compared with the path in ASCII lower case
/// (`translate`, not `lower`, which would also lower other letters by the database's locale)
/// with `starts_with`, in which no character is special. Scopes and keys are ordered by their bytes
/// (`COLLATE "C"`), as Rust orders strings. An answer is never read: only whether there is one.
pub(crate) const LIST: &str = r#"
SELECT scope, key, state, expires_at, purge_at, response IS NOT NULL, created_at, replays,
    method, path, trace_id, recovered, status
FROM idem_records
WHERE ($2::bigint IS NULL OR created_at >= $2::bigint)
    AND (NOT $3::boolean OR recovered)
    AND ($4::text IS NULL OR $4::text = '/'
        OR translate(path, 'ABCDEFGHIJKLMNOPQRSTUVWXYZ', 'abcdefghijklmnopqrstuvwxyz') = $4::text
        OR starts_with(translate(path, 'ABCDEFGHIJKLMNOPQRSTUVWXYZ', 'abcdefghijklmnopqrstuvwxyz'), $4::text || '/'))
    AND ($5::text IS NULL OR $5::text = CASE
        WHEN state = 'in-flight' THEN 'in-flight'
        WHEN state = 'unknown' AND COALESCE(expires_at, purge_at) > $1::bigint THEN 'unknown'
        WHEN state = 'completed' AND response IS NOT NULL AND expires_at > $1::bigint THEN 'completed'
        WHEN state IN ('unknown', 'completed') THEN 'tombstone'
    END)
ORDER BY created_at DESC, scope COLLATE "C", key COLLATE "C"
LIMIT $6::bigint"#;

pub(crate) const PING: &str = "SELECT 1";

/// The server's clock, in Unix milliseconds.
pub(crate) const CLOCK: &str = "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::listener::CHANNEL;

    #[test]
    fn every_notification_goes_to_the_listened_channel() {
        for sql in [REPLACE, TAKE_OVER, COMPLETE, FORGET, RELEASE_UNKNOWN, DELETE] {
            assert!(sql.contains(&format!("pg_notify('{CHANNEL}', $")), "{sql}");
        }
    }

    #[test]
    fn ending_a_run_or_starting_a_new_one_empties_the_checkpoints() {
        for sql in [REPLACE, COMPLETE] {
            assert!(
                sql.contains("checkpoint_names = '{}', checkpoint_values = '{}'"),
                "{sql}"
            );
        }
        for sql in [TAKE_OVER, RELEASE_UNKNOWN, RENEW] {
            assert!(!sql.contains("checkpoint"), "{sql}");
        }
    }

    #[test]
    fn listing_never_reads_an_answer() {
        let mentions: Vec<_> = LIST.match_indices("response").map(|(at, _)| &LIST[at..]).collect();
        assert!(!mentions.is_empty());
        for mention in mentions {
            assert!(mention.starts_with("response IS NOT NULL"), "{mention}");
        }
    }

    #[test]
    fn the_selects_read_the_columns_in_order() {
        const COLUMNS: &str = "state, fingerprint, digest, token, lease_until, response, created_at, completed_at, expires_at, purge_at, replays, method, path, trace_id, recovered, status";
        assert!(SELECT.contains(COLUMNS));
        assert!(SELECT_FOR_UPDATE.contains(COLUMNS));
        assert_eq!(DELETE.matches(&format!("SELECT {COLUMNS},")).count(), 2, "{DELETE}");
    }
}
