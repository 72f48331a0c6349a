#!/usr/bin/env bash
# bench/pgbench.sh: idem's PostgreSQL store against the floor, the same statements run by pgbench
# (issue 10: idem ≥ 80 % of pgbench, for new keys and for replays).
#
# In a scratch schema made by `idem migrate` (the store's own tables and indexes), it runs with
# pgbench (-M prepared, as the store's prepare_cached):
#   new.sql     the floor of a new key, the statements the store needs, each committed on its own as
#               the store does: the claim (INSERT ... ON CONFLICT (scope, key) DO NOTHING RETURNING 1)
#               and the completion (the compare-and-set UPDATE on the fencing token, RETURNING waiters,
#               with pg_notify only when someone waits: nobody does here)
#   replay.sql  the floor of a replay: one SELECT of a completed record by (scope, key)
#   claim.sql   the store's own claim statement (CLAIM, read from crates/idem-postgres/src/sql.rs)
#               on a completed record: what a replay costs PostgreSQL, against replay.sql's floor
# and beside each, `idem bench --store postgres://...?schema=...` at the same concurrency (the
# idem-tower layer driven in process over the PostgreSQL store: new keys, then the same replayed).
#
# pgbench holds one connection per client; idem's store is given as many (`pool_size` = clients),
# so that both sides use the same number of PostgreSQL backends.
#
# Settings (environment): PG_URL (postgres://postgres@127.0.0.1:5432/test), CLIENTS ("8 32"),
# DURATION (pgbench seconds per run, 10), REQUESTS (idem bench requests per phase, 10000),
# POOL_SIZE (idem's pool_size for every run instead of the number of clients; `default` for the
# store's own default, 16),
# SKIP_INSTALL=1, SKIP_BUILD=1 (use target/release/idem as built), STRICT=1 (exit 1 when a goal
# is missed), KEEP=1 (keep the scratch schemas and the scripts).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432/test}
CLIENTS=${CLIENTS:-8 32}
DURATION=${DURATION:-10}
REQUESTS=${REQUESTS:-10000}
IDEM_BIN="$ROOT/target/release/idem"
TAG="$(date +%s)_$(od -An -N3 -tx1 /dev/urandom | tr -d ' ')"
PGB_SCHEMA="bench_pgb_$TAG"
IDEM_SCHEMA="bench_idem_$TAG"
THREADS=$(nproc)

say() { printf '\n== %s\n' "$*" >&2; }
die() { printf '\npgbench.sh: error: %s\n' "$*" >&2; exit 1; }

# --- what it needs ------------------------------------------------------------------------------
if ! command -v pgbench >/dev/null || ! command -v psql >/dev/null || ! pgbench --version >/dev/null 2>&1; then
    [ "${SKIP_INSTALL:-0}" = 1 ] && die "pgbench or psql is missing (and SKIP_INSTALL=1)"
    say "installing pgbench and psql from Debian"
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq || die "apt-get update failed"
    # Debian ships pgbench with the server package of a version (postgresql-NN); psql with
    # postgresql-client. postgresql-contrib pulls in the default version's server package.
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq postgresql-client postgresql-contrib >/dev/null \
        || die "apt-get install postgresql-client postgresql-contrib failed"
fi
pgbench --version >/dev/null 2>&1 || die "pgbench does not run: $(pgbench --version 2>&1 | head -1)"

psql "$PG_URL" -qAtc 'SELECT 1' >/dev/null 2>&1 || die "PostgreSQL does not answer at $PG_URL.
Start it with: pg_ctlcluster --skip-systemctl-redirect \$(ls /etc/postgresql) main start"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    say "building idem (release) at the root"
    (cd "$ROOT" && cargo build --release -p idem) || die "cargo build --release -p idem failed"
fi
[ -x "$IDEM_BIN" ] || die "$IDEM_BIN is missing: run without SKIP_BUILD=1"

TMP=$(mktemp -d /tmp/idem-pgbench.XXXXXX)
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    if [ "${KEEP:-0}" != 1 ]; then
        psql "$PG_URL" -qc "DROP SCHEMA IF EXISTS $PGB_SCHEMA CASCADE; DROP SCHEMA IF EXISTS $IDEM_SCHEMA CASCADE" \
            >/dev/null 2>&1 || echo "could not drop the schemas $PGB_SCHEMA and $IDEM_SCHEMA" >&2
        [ "$status" -eq 0 ] && rm -rf "$TMP"
    fi
    [ -d "$TMP" ] && echo "scripts and outputs kept in $TMP" >&2
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# pgbench connects with the URL; the scratch schema comes first on its search_path.
PGB_URL="$PG_URL"
case $PGB_URL in *\?*) PGB_URL="$PGB_URL&" ;; *) PGB_URL="$PGB_URL?" ;; esac
PGB_URL="${PGB_URL}options=-csearch_path%3D$PGB_SCHEMA"
IDEM_URL="$PG_URL"
case $IDEM_URL in *\?*) IDEM_URL="$IDEM_URL&" ;; *) IDEM_URL="$IDEM_URL?" ;; esac
IDEM_URL="${IDEM_URL}schema=$IDEM_SCHEMA"

# --- the scratch table: the store's own schema, made by `idem migrate` ---------------------------
say "creating $PGB_SCHEMA with idem migrate, and 10000 completed records"
"$IDEM_BIN" migrate --store "${IDEM_URL%schema=*}schema=$PGB_SCHEMA" >/dev/null \
    || die "idem migrate could not create the scratch schema $PGB_SCHEMA"
psql "$PG_URL" -v ON_ERROR_STOP=1 -q >/dev/null <<EOF || die "filling the scratch schema failed"
SET search_path TO $PGB_SCHEMA;
-- The store's salt and identity, which every claim checks.
INSERT INTO idem_scope_salt (id, salt, created_at, identity)
VALUES (1, decode(repeat('11', 32), 'hex'), 1767225600000, decode(repeat('22', 16), 'hex'));
-- The records the replay scripts read: completed, with an answer.
INSERT INTO idem_records
    (scope, key, state, fingerprint, digest, token, lease_until, response, created_at, completed_at,
     expires_at, purge_at, replays)
SELECT 'hmac-sha256-bench-scope-0123456789abcdef0123456789abcdef', 'r-' || i, 'completed',
       decode(repeat('ab', 113), 'hex'), decode(repeat('cd', 32), 'hex'), NULL, NULL,
       decode(repeat('ef', 128), 'hex'), 1767225600000, 1767225600001, 1767312000000, 1767830400000, 0
FROM generate_series(0, 9999) AS i;
ANALYZE idem_records;
EOF

# No ':' in the SQL text but pgbench's variables: pgbench reads ":name" even inside a string literal.
# The values have the sizes of the store's: an encoded fingerprint is 113 bytes, its digest 32, a
# fencing token 16, a notification payload 32 characters; the answer (encoded, compressed) 128.
SCOPE="'hmac-sha256-bench-scope-0123456789abcdef0123456789abcdef'"
KEY_NEW="'n-' || :run::text || '-' || :client_id::text || '-' || :k::text"
cat >"$TMP/new.sql" <<EOF
\\set k random(1, 9000000000000000000)
INSERT INTO idem_records
    (scope, key, state, fingerprint, digest, token, lease_until, created_at, purge_at, replays, method, path,
     trace_id)
VALUES ($SCOPE, $KEY_NEW, 'in-flight', decode(repeat('ab', 113), 'hex'), decode(repeat('cd', 32), 'hex'),
        '\\x00112233445566778899aabbccddeeff'::bytea, 1767225660000, 1767225600000, 1767830400000, 0, 'POST',
        '/payments', '0af7651916cd43dd8448eb211c80319c')
ON CONFLICT (scope, key) DO NOTHING
RETURNING 1;
WITH completed AS (
    UPDATE idem_records
    SET state = 'completed', token = NULL, lease_until = NULL, response = decode(repeat('ef', 128), 'hex'),
        completed_at = 1767225600001, expires_at = 1767312000000, purge_at = 1767830400000,
        checkpoint_names = '{}', checkpoint_values = '{}', status = 201
    WHERE scope = $SCOPE AND key = $KEY_NEW AND token = '\\x00112233445566778899aabbccddeeff'::bytea
      AND state = 'in-flight'
    RETURNING waiters
)
SELECT (SELECT pg_notify('idem_records', '0123456789abcdef0123456789abcdef') WHERE completed.waiters > 0)
FROM completed;
EOF
COLUMNS="state, fingerprint, digest, token, lease_until, response, created_at, completed_at, expires_at, purge_at, replays,
    method, path, trace_id, recovered, status"
cat >"$TMP/replay.sql" <<EOF
\\set i random(0, 9999)
SELECT $COLUMNS
FROM idem_records WHERE scope = $SCOPE AND key = 'r-' || :i::text;
EOF

# The store's own CLAIM, read from crates/idem-postgres/src/sql.rs (so it never drifts from the
# store), with the values of the store's sizes written in for $1..$13 ($13: the store's identity,
# which the claim checks). On a completed record it reads the record and inserts nothing.
CLAIM_SQL=$(sed -n '/^pub(crate) const CLAIM: &str = "$/,/";$/p' "$ROOT/crates/idem-postgres/src/sql.rs" | sed '1d;$s/";$//')
case $CLAIM_SQL in *'$13'*) ;; *) die "cannot read CLAIM (with its parameters \$1..\$13) in crates/idem-postgres/src/sql.rs" ;; esac
CLAIM_VALUES=("$SCOPE" "'r-' || :i::text" "decode(repeat('ab', 113), 'hex')" "decode(repeat('cd', 32), 'hex')"
    "'\\x00112233445566778899aabbccddeeff'::bytea" 1767225660000 1767225600000 1767830400000 1767312000000
    "'POST'" "'/payments'" "'0af7651916cd43dd8448eb211c80319c'"
    "decode(repeat('22', 16), 'hex')")
# From the highest: replacing $1 first would eat the start of $10..$13.
for n in 13 12 11 10 9 8 7 6 5 4 3 2 1; do
    CLAIM_SQL=${CLAIM_SQL//"\$$n"/${CLAIM_VALUES[$((n - 1))]}}
done
case $CLAIM_SQL in *'$'[0-9]*) die "CLAIM in crates/idem-postgres/src/sql.rs has parameters past \$13" ;; esac
printf '\\set i random(0, 9999)\n%s;\n' "$CLAIM_SQL" >"$TMP/claim.sql"

# pgb SCRIPT CLIENTS: transactions (one script run) per second, or dies.
pgb() {
    local out="$TMP/pgbench-$1-$2.txt" jobs=$(( $2 < THREADS ? $2 : THREADS ))
    pgbench -n -M prepared -c "$2" -j "$jobs" -T "$DURATION" -D run="$RANDOM$RANDOM" -f "$TMP/$1.sql" "$PGB_URL" \
        >"$out" 2>&1 || { cat "$out" >&2; die "pgbench $1 at $2 clients failed"; }
    grep -q '^number of failed transactions: 0\b' "$out" || ! grep -q '^number of failed transactions' "$out" \
        || { cat "$out" >&2; die "pgbench $1 at $2 clients had failed transactions"; }
    local tps
    tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time).*/\1/p' "$out")
    [ -n "$tps" ] || { cat "$out" >&2; die "no tps in pgbench's output"; }
    echo "$tps"
}

declare -A R=()
for c in $CLIENTS; do
    say "$c clients: pgbench new.sql, replay.sql, claim.sql (${DURATION}s each)"
    R[pgb_new/$c]=$(pgb new "$c")
    R[pgb_replay/$c]=$(pgb replay "$c")
    R[pgb_claim/$c]=$(pgb claim "$c")
    # The UPDATE of new.sql must have completed every claim: no record left in flight.
    left=$(psql "$PG_URL" -qAtc "SELECT count(*) FROM $PGB_SCHEMA.idem_records WHERE state <> 'completed'")
    [ "$left" = 0 ] || die "$left records of new.sql were left in flight: the script is wrong"
    store="$IDEM_URL"
    case ${POOL_SIZE:-$c} in
        default) ;;
        *) store="$store&pool_size=${POOL_SIZE:-$c}" ;;
    esac
    say "$c clients: idem bench --store $store --requests $REQUESTS --concurrency $c"
    out="$TMP/idem-bench-$c.txt"
    "$IDEM_BIN" bench --store "$store" --requests "$REQUESTS" --concurrency "$c" >"$out" 2>"$out.err" \
        || { cat "$out" "$out.err" >&2; die "idem bench at concurrency $c failed"; }
    cat "$out" >&2
    R[idem_new/$c]=$(awk '$1 == "new" { print $3 }' "$out")
    R[idem_replay/$c]=$(awk '$1 == "replay" { print $3 }' "$out")
    [ -n "${R[idem_new/$c]}" ] && [ -n "${R[idem_replay/$c]}" ] || die "cannot read req/s in idem bench's output ($out)"
    printf 'pgbench new %s, replay %s, claim %s; idem new %s, replay %s\n' "${R[pgb_new/$c]}" \
        "${R[pgb_replay/$c]}" "${R[pgb_claim/$c]}" "${R[idem_new/$c]}" "${R[idem_replay/$c]}" >&2
done

missed=0
pct() {
    awk -v a="$1" -v b="$2" -v goal="$3" 'BEGIN {
        r = a / b
        printf "%.0f %%", 100 * r
        if (goal != "") printf " (%s)", (r >= goal) ? "met" : "**missed**"
        exit (goal == "" || r >= goal) ? 0 : 1
    }'
}
{
    echo
    echo "## idem's PostgreSQL store against pgbench ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, $(psql "$PG_URL" -qAtc 'SHOW server_version'))"
    echo
    echo "pgbench -M prepared -T $DURATION (tps = keys per second); idem bench --requests $REQUESTS (req/s)."
    echo "Goal: idem ≥ 80 % of pgbench, for new keys and for replays."
    echo
    echo "| clients | pgbench new (INSERT; UPDATE) | idem new | idem / pgbench | pgbench replay (1 SELECT) | idem replay | idem / pgbench | pgbench claim (the store's statement) | claim / SELECT |"
    echo "|---:|---:|---:|---|---:|---:|---|---:|---|"
    for c in $CLIENTS; do
        new_ratio=$(pct "${R[idem_new/$c]}" "${R[pgb_new/$c]}" 0.8) || missed=$((missed + 1))
        replay_ratio=$(pct "${R[idem_replay/$c]}" "${R[pgb_replay/$c]}" 0.8) || missed=$((missed + 1))
        printf '| %s | %.0f | %.0f | %s | %.0f | %.0f | %s | %.0f | %s |\n' "$c" \
            "${R[pgb_new/$c]}" "${R[idem_new/$c]}" "$new_ratio" \
            "${R[pgb_replay/$c]}" "${R[idem_replay/$c]}" "$replay_ratio" \
            "${R[pgb_claim/$c]}" "$(pct "${R[pgb_claim/$c]}" "${R[pgb_replay/$c]}" "")"
    done
    echo
    case ${POOL_SIZE:-clients} in
        clients) echo "pgbench holds one connection per client, and idem's pool as many (pool_size = clients)." ;;
        default) echo "pgbench holds one connection per client; idem's pool is the store's default (16)." ;;
        *) echo "pgbench holds one connection per client; idem's pool has $POOL_SIZE (POOL_SIZE)." ;;
    esac
    echo "$missed goal(s) missed."
}

if [ "${STRICT:-0}" = 1 ] && [ "$missed" -gt 0 ]; then
    exit 1
fi
