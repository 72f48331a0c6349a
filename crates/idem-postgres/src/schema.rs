//! Versioned migrations. `idem_schema_migrations` records the versions applied; every migration
//! that is missing runs in one transaction under a transaction-scoped advisory lock, so that
//! instances starting together apply each migration exactly once and the others wait for it.

use std::error::Error as StdError;

use deadpool_postgres::{Pool, PoolError};

use crate::{PostgresError, privileges};

/// The key of the advisory lock held while migrating (`"idem"` and 1, as one `bigint`). One lock
/// for the whole database: migrations are rare and short, and schemas are created under it too.
const MIGRATION_LOCK: i64 = 0x6964_656d_0000_0001;

// The texts that several migrations write alike, each once. A released migration never changes:
// these pieces are what the migrations were released with, and each migration's text is the one
// it was (version 10's first `idem_complete_claim` aside, whose `SET` is laid out as the others').

/// The `ALTER FUNCTION` that pins `$function`'s `search_path` to the schema that holds the tables
/// now (not to a `search_path` whose `"$user"` would be the caller's own schema), then `pg_temp`,
/// so that no caller's objects stand in for them.
macro_rules! pin {
    ($function:literal) => {
        concat!(
            "DO $pin$ BEGIN
    EXECUTE format(
        'ALTER FUNCTION ",
            $function,
            " SET search_path = %I, pg_temp',
        current_schema()
    );
END $pin$;
"
        )
    };
}

/// `idem_complete_claim`, made with `$create` (`"CREATE"` or `"CREATE OR REPLACE"`): the eight
/// arguments of version 5 (`without status`), or with the answer's status as a ninth (`with
/// status`, version 7). A claim that is not current runs `$lost`: [`claim_not_current!`] until
/// version 10, `idem_claim_lost` since.
macro_rules! complete_claim {
    (@ $create:literal, $status_parameter:literal, $status_set:literal, $lost:expr) => {
        concat!(
            $create,
            " FUNCTION idem_complete_claim(
    p_scope TEXT, p_key TEXT, p_token BYTEA, p_response BYTEA,
    p_completed_at BIGINT, p_expires_at BIGINT, p_purge_at BIGINT, p_notice TEXT",
            $status_parameter,
            "
) RETURNS void
LANGUAGE plpgsql
AS $fn$
DECLARE
    woken INTEGER;
BEGIN
    IF p_response IS NULL OR p_completed_at IS NULL OR p_expires_at IS NULL OR p_purge_at IS NULL THEN
        RAISE EXCEPTION 'idem: a completion needs an answer and its times' USING ERRCODE = 'IDEM2';
    END IF;
    -- Never kept for less than the claim itself promised (its ttl and tombstone from the claim).
    UPDATE idem_records
    SET state = 'completed', lease_until = NULL, response = p_response,",
            $status_set,
            "
        completed_at = p_completed_at, expires_at = GREATEST(p_expires_at, expires_at),
        purge_at = GREATEST(p_purge_at, purge_at), checkpoint_names = '{}', checkpoint_values = '{}'
    WHERE scope = p_scope AND key = p_key AND token = p_token AND state = 'in-flight'
    RETURNING waiters INTO woken;
    IF NOT FOUND THEN
        ",
            $lost,
            "
    END IF;
    IF woken > 0 THEN
        PERFORM pg_notify('idem_records', p_notice);
    END IF;
END
$fn$;
"
        )
    };
    ($create:literal, without status, $lost:expr) => {
        complete_claim!(@ $create, "", "", $lost)
    };
    ($create:literal, with status, $lost:expr) => {
        complete_claim!(@ $create, ", p_status INTEGER", " status = p_status,", $lost)
    };
}

/// What `idem_complete_claim` did with a claim that is not current before version 10: one
/// `IDEM1` for every cause.
macro_rules! claim_not_current {
    () => {
        "RAISE EXCEPTION 'idem: the claim on this record is no longer current (its lease ran out and another run took the key, or it was deleted)'
            USING ERRCODE = 'IDEM1',
                  HINT = 'this transaction must not commit: the run that holds the key now answers the client';"
    };
}

/// The variables of `idem_complete` (`jsonb` headers) that every version declares: the token's
/// fields, the database's clock, and the stored headers with their count.
macro_rules! complete_variables {
    () => {
        r"    parts   TEXT[] := string_to_array(p_token, '.');
    v_scope TEXT;
    v_key   TEXT;
    v_token BYTEA;
    v_ttl   BIGINT;
    v_keep  BIGINT;
    v_now   BIGINT := (extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    v_heads BYTEA := '\x'::bytea;
    v_count INTEGER := 0;
"
    };
}

/// `idem_complete` refuses the statuses that are not stored (`IDEM2`).
macro_rules! complete_status_check {
    () => {
        "    IF p_status IS NULL OR p_status < 200 OR p_status > 499 OR p_status IN (408, 409, 425, 429) THEN
        RAISE EXCEPTION 'idem: a % answer is not stored (a retry runs the request again); do not complete with it', p_status
            USING ERRCODE = 'IDEM2';
    END IF;
"
    };
}

/// The start of `idem_complete`'s loop over the headers of the default allow-list, one value at a
/// time, refusing a value that is not a string or not a valid header value (`IDEM2`).
macro_rules! complete_headers_loop {
    () => {
        r"    FOR h IN
        SELECT lower(e.key) AS name, v.value #>> '{}' AS value, jsonb_typeof(v.value) AS kind
        FROM jsonb_each(COALESCE(p_headers, '{}'::jsonb)) AS e,
             LATERAL jsonb_array_elements(
                 CASE jsonb_typeof(e.value) WHEN 'array' THEN e.value ELSE jsonb_build_array(e.value) END
             ) AS v(value)
        WHERE lower(e.key) IN ('content-type', 'content-encoding', 'vary', 'location', 'content-location', 'etag', 'link')
    LOOP
        IF h.kind <> 'string' THEN
            RAISE EXCEPTION 'idem: the value of header % must be a string (or an array of strings), not %', h.name, h.kind
                USING ERRCODE = 'IDEM2';
        END IF;
        IF h.value ~ '[\x01-\x08\x0a-\x1f\x7f]' THEN
            RAISE EXCEPTION 'idem: the value of header % is not a valid header value', h.name USING ERRCODE = 'IDEM2';
        END IF;
"
    };
}

/// The end of `idem_complete`: the header appended in idem's stored form, then the record
/// completed through `idem_complete_claim` with the answer in that form, on the database's clock
/// (with the status as its last argument, `$status`, since version 7).
macro_rules! complete_the_claim {
    ($status:literal) => {
        concat!(
            r"        v_heads := v_heads
            || int4send(octet_length(h.name)) || convert_to(h.name, 'UTF8')
            || int4send(octet_length(convert_to(h.value, 'UTF8'))) || convert_to(h.value, 'UTF8');
        v_count := v_count + 1;
    END LOOP;
    PERFORM idem_complete_claim(
        v_scope, v_key, v_token,
        '\x4944523100'::bytea || int2send(p_status::smallint) || int2send(v_count::smallint) || v_heads
            || COALESCE(p_body, '\x'::bytea),
        v_now, v_now + v_ttl, v_now + v_keep,
        encode(substr(sha256(int8send(octet_length(v_scope)::bigint) || convert_to(v_scope, 'UTF8')
            || convert_to(v_key, 'UTF8')), 1, 16), 'hex')",
            $status,
            "
    );
END
$fn$;
"
        )
    };
}

/// `idem_complete` (`jsonb` headers) as versions 6 and 7 made it (`$create`): a token that does not
/// read is one `IDEM3`, and `$status` as in [`complete_the_claim!`].
macro_rules! complete_before_10 {
    ($create:literal, $status:literal) => {
        concat!(
            $create,
            " FUNCTION idem_complete(p_token TEXT, p_status INTEGER, p_headers JSONB, p_body BYTEA)
RETURNS void
LANGUAGE plpgsql
AS $fn$
DECLARE
",
            complete_variables!(),
            "    h       RECORD;
BEGIN
    IF p_token IS NULL OR cardinality(parts) <> 6 OR parts[1] <> 'idem1' THEN
        RAISE EXCEPTION 'idem: this is not an Idempotency-Token' USING ERRCODE = 'IDEM3';
    END IF;
    BEGIN
        v_scope := convert_from(decode(parts[2], 'hex'), 'UTF8');
        v_key := convert_from(decode(parts[3], 'hex'), 'UTF8');
        v_token := decode(parts[4], 'hex');
        v_ttl := parts[5]::bigint;
        v_keep := parts[6]::bigint;
    EXCEPTION WHEN OTHERS THEN
        RAISE EXCEPTION 'idem: this is not an Idempotency-Token' USING ERRCODE = 'IDEM3';
    END;
",
            complete_status_check!(),
            "    IF p_headers IS NOT NULL AND jsonb_typeof(p_headers) <> 'object' THEN
        RAISE EXCEPTION 'idem: headers must be a JSON object of names to a value or an array of values'
            USING ERRCODE = 'IDEM2';
    END IF;
",
            complete_headers_loop!(),
            complete_the_claim!($status),
            pin!("idem_complete(TEXT, INTEGER, JSONB, BYTEA)"),
        )
    };
}

/// The migrations, in order. A released migration never changes: a change is a new one.
///
/// 1. `idem_records`, with its indexes on the two retention deadlines.
/// 2. The checkpoints of each record's current run, as two arrays that line up position by
///    position (`checkpoint_names[i]` names `checkpoint_values[i]`), in the order each name was
///    first written. A row always has both, empty when there are none.
/// 3. `idem_scope_salt`: the store's one scope salt, in a table of its own that retention never
///    touches. A single row (`id = 1`, so that a second one cannot be inserted); `NULL` in
///    `older_records_until` if the store held no records when the salt was made.
/// 4. `waiters`: how many waits a record's claims have had, so that the changes of records
///    nobody waits on do not `NOTIFY` (see `WAIT_ON` in the store).
/// 5. `idem_complete_claim`: completes a record in the caller's own transaction, under the row's
///    lock, if the token is the current claim's; otherwise raises `IDEM1`, which aborts that
///    transaction, so a holder that lost its claim cannot commit its business writes. Its
///    `search_path` is pinned to the schema that holds the tables (then `pg_temp`), whatever the
///    caller's connection is set to. The answer is kept at least as long as the claim promised.
/// 6. `idem_complete(token, status, headers, body)`: the same, for an upstream in any language,
///    from the `Idempotency-Token` the gateway sends it (`InTransaction::completion_token`). It
///    reads the record, the claim and the retention from the token (a retention shorter than the
///    claim's is raised to it, so a token altered to expire its key at once cannot), keeps the
///    headers of the default allow-list (string values only), refuses statuses that are not
///    stored (`IDEM2`) and tokens that are not one (`IDEM3`), and writes the answer in idem's
///    stored form, uncompressed and unsealed, on the database's clock.
/// 7. What a record keeps for the operator who reads the store (`Store::list`, `idem inspect`):
///    the request's `method` and `path`, the `trace_id` of its latest run, whether that run was
///    `recovered`, and the answer's `status`; an index on `created_at`, for listing newest first.
///    `idem_complete_claim` gains an overload that stores the status (a ninth argument, last);
///    the eight-argument one stays, as deployed callers call it, and leaves the status unknown.
///    The roles that may execute the old one, and only they, may execute the new one.
///    `idem_complete` calls the new one, so that the status it is given is kept.
/// 8. `idem_claim_insert`: a new key's claim (the insert of `CLAIM`, in `sql.rs`), as a function
///    the claim statement calls only when its read found no record, so that a replay is a plain
///    read that never opens the table for writing. It runs with the caller's rights (invoker) and
///    resolves `idem_records` as the caller's statement does; `EXECUTE` is granted to `PUBLIC`
///    explicitly, so that default privileges that revoke it cannot stop the store's own role.
/// 9. The store's `identity` beside its salt: 16 random bytes that every claim checks in its own
///    statement (`CLAIM`), so that an instance that read the salt of a store that has since lost
///    its data (or a schema made anew) finds out before it claims anything. A salt that exists
///    gets one here; a new one is made with one (`SCOPE_SALT_INSERT`).
/// 10. Least privilege for the upstream, and `IDEM1`/`IDEM2`/`IDEM3` that name their cause.
///     `idem_complete` becomes `SECURITY DEFINER`: it runs with its owner's rights (the role that
///     migrated), so that an upstream needs `EXECUTE` on it and no right on `idem_records`; its
///     `search_path` stays pinned (the schema, then `pg_temp`: no object of the caller's stands in
///     for the store's), and it only ever reaches this schema's records. `EXECUTE` is revoked from
///     `PUBLIC`; the operator grants it (`docs/stores.md`, "PostgreSQL roles"). An overload takes
///     the headers as text, so that headers that are not JSON are `IDEM2`, not a cast error in the
///     caller's statement; the roles that may execute the `jsonb` one may execute it. A token's
///     fields are checked one by one (`IDEM3` naming the field, a retention out of range among
///     them), too many header values are `IDEM2`. `idem_claim_lost` raises the `IDEM1` of a claim
///     that is not current with its cause (completed already by this claim, in this transaction
///     or before; taken over; released; no record of the key in this schema: deleted, or a token of
///     another store), for both `idem_complete_claim`s.
const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        "
CREATE TABLE idem_records (
    scope        TEXT   NOT NULL,
    key          TEXT   NOT NULL,
    state        TEXT   NOT NULL CHECK (state IN ('in-flight', 'completed', 'unknown')),
    fingerprint  BYTEA  NOT NULL,
    digest       BYTEA  NOT NULL,
    token        BYTEA,
    lease_until  BIGINT,
    response     BYTEA,
    created_at   BIGINT NOT NULL,
    completed_at BIGINT,
    expires_at   BIGINT,
    purge_at     BIGINT NOT NULL,
    replays      BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, key)
);
-- Stored answers are compressed already: out of line, without compressing them again.
ALTER TABLE idem_records ALTER COLUMN response SET STORAGE EXTERNAL;
CREATE INDEX idem_records_purge_at ON idem_records (purge_at);
CREATE INDEX idem_records_expires_at ON idem_records (expires_at) WHERE response IS NOT NULL;
",
    ),
    (
        2,
        // Constant defaults: the table is not rewritten (PostgreSQL 11 and later keep the default in
        // the catalog for the rows that exist), so its lock is only held for a moment. No CHECK that
        // the arrays line up: it would be evaluated (and the values read) on every update of a row,
        // renewals included; one statement writes both at the same position, and a reader reports
        // arrays that do not line up as a corrupt record.
        "
ALTER TABLE idem_records
    ADD COLUMN checkpoint_names  TEXT[]  NOT NULL DEFAULT '{}',
    ADD COLUMN checkpoint_values BYTEA[] NOT NULL DEFAULT '{}';
",
    ),
    (
        3,
        // No CHECK on the salt's length: it is checked where it is read (a salt of another length
        // is a corrupt store), rather than tying the table to the length of today's salts.
        "
CREATE TABLE idem_scope_salt (
    id                  SMALLINT PRIMARY KEY CHECK (id = 1),
    salt                BYTEA    NOT NULL,
    created_at          BIGINT   NOT NULL,
    older_records_until BIGINT
);
",
    ),
    (
        4,
        // A constant default: the table is not rewritten.
        "
ALTER TABLE idem_records ADD COLUMN waiters INTEGER NOT NULL DEFAULT 0;
",
    ),
    (
        5,
        concat!(
            "\n",
            complete_claim!("CREATE", without status, claim_not_current!()),
            "-- Pinned to the schema that holds the tables now (not to a search_path whose \"$user\" would be
-- the caller's own schema), then pg_temp, so that no caller's objects stand in for them.
",
            pin!("idem_complete_claim(TEXT, TEXT, BYTEA, BYTEA, BIGINT, BIGINT, BIGINT, TEXT)"),
        ),
    ),
    (
        6,
        concat!("\n", complete_before_10!("CREATE", "")),
    ),
    (
        7,
        // Constant defaults (or none): the table is not rewritten, and a record written before
        // reads with an empty origin, not recovered, without a status. Building the index holds a
        // lock that makes writes wait; for a large table, build it beforehand with `CREATE INDEX
        // CONCURRENTLY idem_records_created_at ON idem_records (created_at)`, and this skips it.
        // `CREATE OR REPLACE` keeps `idem_complete`'s grants, and drops its pinned `search_path`,
        // which is pinned again.
        concat!(
            "
ALTER TABLE idem_records
    ADD COLUMN method    TEXT    NOT NULL DEFAULT '',
    ADD COLUMN path      TEXT    NOT NULL DEFAULT '',
    ADD COLUMN trace_id  TEXT,
    ADD COLUMN recovered BOOLEAN NOT NULL DEFAULT false,
    ADD COLUMN status    INTEGER;
CREATE INDEX IF NOT EXISTS idem_records_created_at ON idem_records (created_at);
",
            complete_claim!("CREATE", with status, claim_not_current!()),
            "DO $pin$
DECLARE
    grantee TEXT;
BEGIN
    EXECUTE format(
        'ALTER FUNCTION idem_complete_claim(TEXT, TEXT, BYTEA, BYTEA, BIGINT, BIGINT, BIGINT, TEXT, INTEGER) SET search_path = %I, pg_temp',
        current_schema()
    );
    -- The old one's grants, where they were changed (by default anyone may execute both).
    IF (SELECT proacl IS NOT NULL FROM pg_proc
        WHERE oid = 'idem_complete_claim(TEXT, TEXT, BYTEA, BYTEA, BIGINT, BIGINT, BIGINT, TEXT)'::regprocedure) THEN
        REVOKE EXECUTE ON FUNCTION idem_complete_claim(TEXT, TEXT, BYTEA, BYTEA, BIGINT, BIGINT, BIGINT, TEXT, INTEGER)
            FROM PUBLIC;
    END IF;
    FOR grantee IN
        SELECT DISTINCT CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END
        FROM pg_proc p, aclexplode(p.proacl) a
        WHERE p.oid = 'idem_complete_claim(TEXT, TEXT, BYTEA, BYTEA, BIGINT, BIGINT, BIGINT, TEXT)'::regprocedure
          AND a.privilege_type = 'EXECUTE'
    LOOP
        EXECUTE format(
            'GRANT EXECUTE ON FUNCTION idem_complete_claim(TEXT, TEXT, BYTEA, BYTEA, BIGINT, BIGINT, BIGINT, TEXT, INTEGER) TO %s',
            grantee
        );
    END LOOP;
END $pin$;
",
            complete_before_10!("CREATE OR REPLACE", ",\n        p_status"),
        ),
    ),
    (
        8,
        "
CREATE FUNCTION idem_claim_insert(
    p_scope TEXT, p_key TEXT, p_fingerprint BYTEA, p_digest BYTEA, p_token BYTEA, p_lease_until BIGINT,
    p_created_at BIGINT, p_purge_at BIGINT, p_expires_at BIGINT, p_method TEXT, p_path TEXT, p_trace_id TEXT
) RETURNS BOOLEAN LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    INSERT INTO idem_records
        (scope, key, state, fingerprint, digest, token, lease_until, created_at, purge_at, expires_at, replays,
         method, path, trace_id)
    VALUES (p_scope, p_key, 'in-flight', p_fingerprint, p_digest, p_token, p_lease_until, p_created_at, p_purge_at,
            p_expires_at, 0, p_method, p_path, p_trace_id)
    ON CONFLICT (scope, key) DO NOTHING;
    RETURN FOUND;
END
$fn$;
GRANT EXECUTE ON FUNCTION idem_claim_insert(TEXT, TEXT, BYTEA, BYTEA, BYTEA, BIGINT, BIGINT, BIGINT, BIGINT, TEXT, TEXT, TEXT)
    TO PUBLIC;
",
    ),
    (
        9,
        "
ALTER TABLE idem_scope_salt ADD COLUMN identity BYTEA;
UPDATE idem_scope_salt SET identity = decode(md5(random()::text || clock_timestamp()::text), 'hex');
",
    ),
    (
        10,
        concat!(
            r#"
-- Raises the IDEM1 of a claim that is not current, naming why: called by idem_complete_claim
-- when its update found no record in flight under the token.
CREATE FUNCTION idem_claim_lost(p_scope TEXT, p_key TEXT, p_token BYTEA) RETURNS void
LANGUAGE plpgsql
AS $fn$
DECLARE
    r    RECORD;
    hint TEXT := 'this transaction must not commit: it is aborted, and its writes roll back';
BEGIN
    SELECT state, token IS NOT DISTINCT FROM p_token AS ours, xmin = pg_current_xact_id()::xid AS here
    INTO r FROM idem_records WHERE scope = p_scope AND key = p_key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idem: there is no record of this key in schema %: it was deleted (by an operator, or purged after it expired), or the token is from a gateway whose store is another schema', current_schema()
            USING ERRCODE = 'IDEM1', HINT = hint;
    ELSIF r.ours AND r.state = 'completed' AND r.here THEN
        RAISE EXCEPTION 'idem: this claim completed its record already, in this transaction: complete a run once'
            USING ERRCODE = 'IDEM1', HINT = hint;
    ELSIF r.ours AND r.state = 'completed' THEN
        RAISE EXCEPTION 'idem: this claim completed its record already, in a transaction that committed before: complete a run once'
            USING ERRCODE = 'IDEM1', HINT = hint;
    ELSIF r.state = 'unknown' THEN
        RAISE EXCEPTION 'idem: the claim was released (the gateway gave the run up, or an operator deleted the key while it ran): the key''s next run is flagged Idempotency-Recovered'
            USING ERRCODE = 'IDEM1', HINT = hint;
    ELSIF NOT r.ours AND r.state = 'completed' THEN
        RAISE EXCEPTION 'idem: another run took the key over (this run''s lease ran out) and completed it'
            USING ERRCODE = 'IDEM1', HINT = hint || '; the run that took the key answers the client';
    ELSIF NOT r.ours THEN
        RAISE EXCEPTION 'idem: another run took the key over (this run''s lease ran out) and holds it now'
            USING ERRCODE = 'IDEM1', HINT = hint || '; the run that holds the key answers the client';
    ELSE
        RAISE EXCEPTION 'idem: the claim on this record is no longer current (its record is %)', r.state
            USING ERRCODE = 'IDEM1', HINT = hint;
    END IF;
END
$fn$;
GRANT EXECUTE ON FUNCTION idem_claim_lost(TEXT, TEXT, BYTEA) TO PUBLIC;
"#,
            complete_claim!("CREATE OR REPLACE", without status, "PERFORM idem_claim_lost(p_scope, p_key, p_token);"),
            complete_claim!("CREATE OR REPLACE", with status, "PERFORM idem_claim_lost(p_scope, p_key, p_token);"),
            r"CREATE OR REPLACE FUNCTION idem_complete(p_token TEXT, p_status INTEGER, p_headers JSONB, p_body BYTEA)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
AS $fn$
DECLARE
",
            complete_variables!(),
            r"    v_field TEXT;
    h       RECORD;
BEGIN
    IF p_token IS NULL OR cardinality(parts) <> 6 OR parts[1] <> 'idem1' THEN
        RAISE EXCEPTION 'idem: this is not an Idempotency-Token (one is idem1.SCOPE.KEY.TOKEN.TTL.KEEP, as the gateway sent it)'
            USING ERRCODE = 'IDEM3';
    END IF;
    -- Each field on its own, so that the error names it. A retention is milliseconds from now
    -- that the database's clock can add (never the bigint overflow of an altered token).
    BEGIN
        v_field := 'scope (its second field)';
        v_scope := convert_from(decode(parts[2], 'hex'), 'UTF8');
        v_field := 'key (its third field)';
        v_key := convert_from(decode(parts[3], 'hex'), 'UTF8');
        v_field := 'claim (its fourth field)';
        v_token := decode(parts[4], 'hex');
        v_field := 'ttl (its fifth field)';
        v_ttl := parts[5]::bigint;
        v_field := 'tombstone retention (its sixth field)';
        v_keep := parts[6]::bigint;
    EXCEPTION WHEN OTHERS THEN
        RAISE EXCEPTION 'idem: this is not an Idempotency-Token: its % is not valid (%)', v_field, SQLERRM
            USING ERRCODE = 'IDEM3';
    END;
    IF v_ttl < 0 OR v_ttl > 9223372036854775807 - v_now THEN
        RAISE EXCEPTION 'idem: the Idempotency-Token''s ttl (its fifth field), % ms, is out of range', v_ttl
            USING ERRCODE = 'IDEM3';
    END IF;
    IF v_keep < 0 OR v_keep > 9223372036854775807 - v_now THEN
        RAISE EXCEPTION 'idem: the Idempotency-Token''s tombstone retention (its sixth field), % ms, is out of range', v_keep
            USING ERRCODE = 'IDEM3';
    END IF;
",
            complete_status_check!(),
            r"    IF p_headers IS NOT NULL AND jsonb_typeof(p_headers) <> 'object' THEN
        RAISE EXCEPTION 'idem: headers must be a JSON object of names to a value or an array of values, not a JSON %', jsonb_typeof(p_headers)
            USING ERRCODE = 'IDEM2';
    END IF;
",
            complete_headers_loop!(),
            r"        IF v_count = 32767 THEN
            RAISE EXCEPTION 'idem: too many header values (at most 32767 are stored)' USING ERRCODE = 'IDEM2';
        END IF;
",
            complete_the_claim!(",\n        p_status"),
            r#"-- The headers as text (what a caller's untyped parameter or literal is): headers that are not
-- JSON are IDEM2, rather than the cast's error in the caller's statement.
CREATE FUNCTION idem_complete(p_token TEXT, p_status INTEGER, p_headers TEXT, p_body BYTEA)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
AS $fn$
DECLARE
    v_headers JSONB;
BEGIN
    BEGIN
        v_headers := p_headers::jsonb;
    EXCEPTION WHEN invalid_text_representation THEN
        RAISE EXCEPTION 'idem: the headers are not JSON (%): pass a JSON object of names to a value or an array of values', SQLERRM
            USING ERRCODE = 'IDEM2';
    END;
    PERFORM idem_complete(p_token, p_status, v_headers, p_body);
END
$fn$;
DO $pin$
DECLARE
    grantee TEXT;
    f       TEXT;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'idem_claim_lost(TEXT, TEXT, BYTEA)',
        'idem_complete_claim(TEXT, TEXT, BYTEA, BYTEA, BIGINT, BIGINT, BIGINT, TEXT)',
        'idem_complete_claim(TEXT, TEXT, BYTEA, BYTEA, BIGINT, BIGINT, BIGINT, TEXT, INTEGER)',
        'idem_complete(TEXT, INTEGER, JSONB, BYTEA)',
        'idem_complete(TEXT, INTEGER, TEXT, BYTEA)'
    ] LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
    END LOOP;
    -- Whoever may complete with jsonb headers may with text ones; nobody else (PUBLIC neither).
    FOR grantee IN
        SELECT DISTINCT quote_ident(pg_get_userbyid(a.grantee))
        FROM pg_proc p, aclexplode(p.proacl) a
        WHERE p.oid = 'idem_complete(TEXT, INTEGER, JSONB, BYTEA)'::regprocedure
          AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION idem_complete(TEXT, INTEGER, TEXT, BYTEA) TO %s', grantee);
    END LOOP;
    REVOKE EXECUTE ON FUNCTION idem_complete(TEXT, INTEGER, JSONB, BYTEA) FROM PUBLIC;
    REVOKE EXECUTE ON FUNCTION idem_complete(TEXT, INTEGER, TEXT, BYTEA) FROM PUBLIC;
END $pin$;
"#,
        ),
    ),
];

/// The newest schema version this crate knows.
pub(crate) const VERSION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].0;

/// Reads the schema's version with plain reads (no DDL, no lock: a current schema needs only the
/// rights a use of the store needs) and, when it is behind, migrates it if the role can; when the
/// role cannot, the error names each right it lacks, and says to run `idem migrate` with a role
/// that has them.
pub(crate) async fn prepare(pool: &Pool, target: &str, schema: Option<&str>) -> Result<(), PostgresError> {
    let client = connection(pool, target).await?;
    let found = privileges::read_version(&**client, target, schema).await?;
    if found.version > VERSION {
        return Err(newer(target, found.version));
    }
    if found.version == VERSION {
        return Ok(());
    }
    let missing = privileges::missing_for_migration(&**client, target, &found).await?;
    if !missing.is_empty() {
        return Err(PostgresError::MigrationNeeded {
            target: target.to_owned(),
            schema: found.schema,
            role: found.role,
            found: found.version,
            needed: VERSION,
            missing: missing.join(", "),
        });
    }
    drop(client);
    migrate(pool, target, schema).await
}

fn newer(target: &str, found: i32) -> PostgresError {
    PostgresError::NewerSchema {
        target: target.to_owned(),
        found,
        supported: VERSION,
    }
}

async fn connection(pool: &Pool, target: &str) -> Result<deadpool_postgres::Object, PostgresError> {
    pool.get().await.map_err(|err| PostgresError::Connect {
        target: target.to_owned(),
        source: match err {
            PoolError::Backend(err) => Box::new(err),
            err => Box::new(err),
        },
    })
}

/// Brings the schema up to [`VERSION`], creating `schema` first if it is given and missing, under
/// the migration lock.
async fn migrate(pool: &Pool, target: &str, schema: Option<&str>) -> Result<(), PostgresError> {
    let mut client = connection(pool, target).await?;
    let failed = |step: &str| {
        let step = step.to_owned();
        move |err: tokio_postgres::Error| PostgresError::Migrate {
            target: target.to_owned(),
            step,
            source: Box::new(err) as Box<dyn StdError + Send + Sync>,
        }
    };
    let tx = client.transaction().await.map_err(failed("starting a transaction"))?;
    // A migration waits for the lock and for the tables as long as it takes: the session's
    // timeouts (set for the store's own statements) must not cut it halfway.
    tx.batch_execute(
        "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0; SET LOCAL idle_in_transaction_session_timeout = 0",
    )
        .await
        .map_err(failed("lifting the session's timeouts"))?;
    tx.batch_execute(&format!("SELECT pg_advisory_xact_lock({MIGRATION_LOCK})"))
        .await
        .map_err(failed("taking the migration lock"))?;
    if let Some(schema) = schema {
        let exists: bool = tx
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)",
                &[&schema],
            )
            .await
            .map_err(failed("looking up the schema"))?
            .get(0);
        // Only when missing: `CREATE SCHEMA IF NOT EXISTS` needs the CREATE privilege on the
        // database even when the schema exists.
        if !exists {
            tx.batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
                .await
                .map_err(failed(&format!("creating the schema {schema}")))?;
        }
        // The connection's search_path names the schema already; setting it again makes sure a
        // schema created just now is the one the tables go into.
        tx.batch_execute(&format!("SET LOCAL search_path TO \"{schema}\""))
            .await
            .map_err(failed("setting the search_path"))?;
    }
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS idem_schema_migrations (
             version    INTEGER     PRIMARY KEY,
             applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
         )",
    )
    .await
    .map_err(failed("creating idem_schema_migrations"))?;
    let found: i32 = tx
        .query_one("SELECT COALESCE(MAX(version), 0) FROM idem_schema_migrations", &[])
        .await
        .map_err(failed("reading idem_schema_migrations"))?
        .get(0);
    if found > VERSION {
        return Err(newer(target, found));
    }
    for &(version, sql) in MIGRATIONS.iter().filter(|(version, _)| *version > found) {
        let step = format!("migration {version}");
        tx.batch_execute(sql).await.map_err(failed(&step))?;
        tx.execute("INSERT INTO idem_schema_migrations (version) VALUES ($1)", &[&version])
            .await
            .map_err(failed(&step))?;
        tracing::info!(server = %target, schema = schema.unwrap_or(""), version, "applied idem schema migration");
    }
    tx.commit().await.map_err(failed("committing the migration"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::MIGRATIONS;

    /// A released migration never changes, though its text is assembled from pieces that later
    /// migrations share: a database that ran version N has exactly what a fresh one gets.
    #[test]
    fn released_migrations_never_change() {
        // The SHA-256 of each version's text as released.
        let released: &[(i32, &str)] = &[
            (1, "04416637b14c78a3ec3f97d840b0a2f8724e5f9155941174be9abebad9925c5c"),
            (2, "640ec4b6b62cfcfcad7e988ee546bb9d3266e2220871e16b7d2ac541a571184f"),
            (3, "0ce1c4ad8fa2bafcfb6bcb8f0b68a0eaaa1d028ebac5e2c1e92dee1a44ee90c2"),
            (4, "bffaeef50a0602192ef3bc28502495cfa530c49d09449806284002457f96649b"),
            (5, "42878489eeb180280fa3a5c6935c5108934afa236c4b209f6e8f3e25d319986e"),
            (6, "a9ec8e85db380fd6d9a5b7ca6988407af56a1085fd985bc67d5341639205b3d7"),
            (7, "cbfb2aa4c5df5297e5d1374e1ce3c1db9060d2a138dd8b8d6d9a796b3c41538f"),
            (8, "a03166c98ab92a11826aa5348b88b23e049f912f7bb2d2329498b7d2dd07dec8"),
            (9, "c09563ea556105849cfe540eac454cfeea3c5d7bf471b7075ffb911d81bf8910"),
            (10, "7c790d2f373d4cfb49d93e398a16befc179c4198c64d0119c14c7bb5f3b9e5da"),
        ];
        let texts: Vec<(i32, String)> = MIGRATIONS
            .iter()
            .map(|&(version, sql)| {
                let digest = Sha256::digest(sql.as_bytes());
                (version, digest.iter().map(|byte| format!("{byte:02x}")).collect())
            })
            .collect();
        let released: Vec<(i32, String)> = released.iter().map(|&(v, d)| (v, d.to_owned())).collect();
        assert_eq!(
            texts, released,
            "a released migration's text changed: add a new migration instead"
        );
    }
}
