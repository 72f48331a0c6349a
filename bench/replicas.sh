#!/usr/bin/env bash
# bench/replicas.sh: what waiting for a replica's acknowledgement costs a keyed request on Redis.
#
# Starts its own Redis primary with one replica on loopback (no persistence, as the tests run
# them), then runs `idem bench` (the idem-tower layer driven in process over the Redis store: new
# keys, then the same keys replayed) against the primary, alternating `replicas=0` (no wait, as
# before) and `replicas=1` (every write followed by WAIT), ROUNDS times each, and prints each run
# and the median ratio of the two for new keys and replays.
#
# Settings (environment): ROUNDS (3), REQUESTS (idem bench requests per phase, 5000), CONCURRENCY
# (8), PORT_BASE (16391: the primary, +1 the replica), SKIP_BUILD=1 (use target/release/idem as
# built).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-5000}
CONCURRENCY=${CONCURRENCY:-8}
PORT_BASE=${PORT_BASE:-16391}
PRIMARY=$PORT_BASE
REPLICA=$((PORT_BASE + 1))
IDEM_BIN="$ROOT/target/release/idem"
TMP=$(mktemp -d)

die() { printf '\nreplicas.sh: error: %s\n' "$*" >&2; exit 1; }
cleanup() {
    redis-cli -p "$REPLICA" shutdown nosave >/dev/null 2>&1 || true
    redis-cli -p "$PRIMARY" shutdown nosave >/dev/null 2>&1 || true
    rm -rf "$TMP"
}
trap cleanup EXIT

command -v redis-server >/dev/null || die "redis-server is missing (apt-get install redis-server)"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    (cd "$ROOT" && cargo build --release -p idem --locked)
fi
[ -x "$IDEM_BIN" ] || die "$IDEM_BIN is missing (build it, or unset SKIP_BUILD)"

common=(--bind 127.0.0.1 --save "" --appendonly no --repl-diskless-sync yes --repl-diskless-sync-delay 0)
redis-server --port "$PRIMARY" "${common[@]}" --daemonize yes --logfile "$TMP/primary.log" --dir "$TMP"
redis-server --port "$REPLICA" "${common[@]}" --replicaof 127.0.0.1 "$PRIMARY" \
    --daemonize yes --logfile "$TMP/replica.log" --dir "$TMP"
for _ in $(seq 1 100); do
    redis-cli -p "$PRIMARY" info replication | grep -q 'state=online' && break
    sleep 0.1
done
redis-cli -p "$PRIMARY" info replication | grep -q 'state=online' || die "the replica did not come online"
# The first writes after a full sync wait for the replica's first acknowledgement.
redis-cli -p "$PRIMARY" set bench:warm 1 >/dev/null
redis-cli -p "$PRIMARY" wait 1 2000 >/dev/null

# One run: prints "new_rps replay_rps new_begin_p50 new_complete_p50" for replicas=$1.
run() {
    local out
    out=$("$IDEM_BIN" bench --store "redis://127.0.0.1:$PRIMARY/?prefix=bench$RANDOM&replicas=$1" \
        --requests "$REQUESTS" --concurrency "$CONCURRENCY" 2>/dev/null)
    echo "$out" | awk '
        $1 == "new"    { new = $3; begin = $6 }
        $1 == "replay" { replay = $3 }
        $1 ~ /^complete/ && !complete { complete = $2 }
        END { print new, replay, begin, complete }'
}

printf '%-6s %-9s %10s %12s %14s %17s\n' round replicas "new req/s" "replay req/s" "begin p50" "complete p50"
declare -a new0 new1 replay0 replay1
for round in $(seq 1 "$ROUNDS"); do
    for replicas in 0 1; do
        read -r new replay begin complete < <(run "$replicas")
        printf '%-6s %-9s %10s %12s %14s %17s\n' "$round" "$replicas" "$new" "$replay" "$begin" "$complete"
        if [ "$replicas" = 0 ]; then new0+=("$new"); replay0+=("$replay"); else new1+=("$new"); replay1+=("$replay"); fi
    done
done

median_ratio() { # median over rounds of $2[i] / $1[i]
    local -n base=$1 with=$2
    for i in "${!base[@]}"; do echo "${with[$i]} ${base[$i]}"; done |
        awk '{ print $1 / $2 }' | sort -g | awk '{ a[NR] = $1 } END { printf "%.2f", a[int((NR + 1) / 2)] }'
}
echo
echo "replicas=1 against replicas=0, median of $ROUNDS rounds: new keys $(median_ratio new0 new1)x, replays $(median_ratio replay0 replay1)x"
