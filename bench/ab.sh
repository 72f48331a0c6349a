#!/usr/bin/env bash
# bench/ab.sh: one path of two builds of idem, side by side in one run, alternated — for what a
# change costs (compare.sh measures every path of one build against its peers; a change of a few
# per cent is lost in its run-to-run noise, which alternating two builds on the same Redis cancels).
#
#   bench/ab.sh serve|tower new|replay [ROUNDS]
#
# A is this checkout's release build (target/release/idem, bench/target/release/{bare,tower}); B is
# IDEM_BIN_B (an idem binary) or BENCH_BIN_B (a folder with `tower`), built from another commit,
# e.g. `git worktree add /tmp/b REV && (cd /tmp/b && cargo build --release -p idem)`.
# Each round drives A then B with wrk -t2 -c32 for DURATION (5s), new keys or replays of 64 keys,
# and prints their req/s and the server's CPU per request (from /proc: steadier than req/s); then
# the mean req/s and median CPU of each, and A's change to B. EXTRA adds flags to both
# gateways (e.g. EXTRA="--replay-cache-entries 0"); the layer reads IDEM_REPLAY_CACHE_ENTRIES.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
WHAT=${1:?"usage: bench/ab.sh serve|tower new|replay [ROUNDS]"}
MODE=${2:?"usage: bench/ab.sh serve|tower new|replay [ROUNDS]"}
ROUNDS=${3:-4}
DURATION=${DURATION:-5s}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
PORT_BASE=${PORT_BASE:-19200}
RUN="ab-$(date +%s)-$$"
EXTRA=${EXTRA:-}
die() { printf 'ab.sh: %s\n' "$*" >&2; exit 1; }
# shellcheck source=bench/warm.sh
source "$HERE/warm.sh"
case "$MODE" in new | replay) ;; *) die "MODE must be new or replay, not $MODE" ;; esac

PIDS=()
declare -A SERVER=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
LOGS=$(mktemp -d)

case "$WHAT" in
serve)
    A_BIN="$ROOT/target/release/idem"
    B_BIN=${IDEM_BIN_B:?"set IDEM_BIN_B to the other build's idem binary"}
    [ -x "$A_BIN" ] && [ -x "$B_BIN" ] && [ -x "$HERE/target/release/bare" ] \
        || die "build first: cargo build --release -p idem; (cd bench && cargo build --release)"
    "$HERE/target/release/bare" "$PORT_BASE" >"$LOGS/bare" 2>&1 &
    PIDS+=($!)
    for side in a b; do
        bin=$([ $side = a ] && echo "$A_BIN" || echo "$B_BIN")
        port=$((PORT_BASE + $([ $side = a ] && echo 1 || echo 2)))
        # shellcheck disable=SC2086
        "$bin" serve --upstream "http://127.0.0.1:$PORT_BASE" --listen "127.0.0.1:$port" \
            --admin-listen "127.0.0.1:$((port + 10))" --store "$REDIS_URL/?prefix=$RUN-$side" $EXTRA \
            >"$LOGS/$side" 2>&1 &
        PIDS+=($!)
        SERVER[$side]=$!
    done
    ;;
tower)
    B_DIR=${BENCH_BIN_B:?"set BENCH_BIN_B to the other build's bench folder (with tower)"}
    for side in a b; do
        bin=$([ $side = a ] && echo "$HERE/target/release/tower" || echo "$B_DIR/tower")
        [ -x "$bin" ] || die "no $bin: build the bench servers first"
        port=$((PORT_BASE + $([ $side = a ] && echo 1 || echo 2)))
        BENCH_PREFIX="$RUN-$side" REDIS_URL="$REDIS_URL" "$bin" "$port" >"$LOGS/$side" 2>&1 &
        PIDS+=($!)
        SERVER[$side]=$!
    done
    ;;
*) die "WHAT must be serve or tower, not $WHAT" ;;
esac

for port in $((PORT_BASE + 1)) $((PORT_BASE + 2)); do
    wait_for_port "$port"
    # The replays' keys, completed once (pay.lua's RUN-r-0 .. RUN-r-63).
    warm_replays "$port" "$RUN-r"
done

# cpu PID: the process's user + system CPU time so far, in clock ticks.
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
TICK=$(getconf CLK_TCK)
declare -a A=() B=() A_CPU=() B_CPU=()
for round in $(seq 1 "$ROUNDS"); do
    for side in a b; do
        port=$((PORT_BASE + $([ $side = a ] && echo 1 || echo 2)))
        # New keys of their own each round; replays of the 64 keys completed above.
        keys=$([ "$MODE" = new ] && echo "$RUN-$round$side" || echo "$RUN")
        before=$(cpu "${SERVER[$side]}")
        result=$(wrk -t2 -c32 -d"$DURATION" -s "$HERE/pay.lua" "http://127.0.0.1:$port/pay" -- "$MODE" "$keys" 2>&1)
        after=$(cpu "${SERVER[$side]}")
        line=$(grep '^RESULT ' <<<"$result") || die "no RESULT from wrk: $result"
        grep -q 'status_errors=0 ' <<<"$line" || die "errors: $line"
        rps=$(sed 's/.*rps=\([0-9.]*\).*/\1/' <<<"$line")
        requests=$(sed 's/.*requests=\([0-9]*\).*/\1/' <<<"$line")
        # The server's own CPU per request (not Redis', not wrk's): steadier than req/s.
        us=$(awk -v t=$((after - before)) -v hz="$TICK" -v n="$requests" 'BEGIN {printf "%.1f", t / hz * 1e6 / n}')
        echo "round $round $side $rps req/s, $us µs CPU per request"
        if [ $side = a ]; then A+=("$rps"); A_CPU+=("$us"); else B+=("$rps"); B_CPU+=("$us"); fi
    done
done
mean() { printf '%s\n' "$@" | awk '{s += $1} END {printf "%.0f", s / NR}'; }
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {printf "%.1f", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
ma=$(mean "${A[@]}")
mb=$(mean "${B[@]}")
ca=$(median "${A_CPU[@]}")
cb=$(median "${B_CPU[@]}")
echo "$WHAT $MODE${EXTRA:+ ($EXTRA)}: A (this build) $ma req/s, $ca µs CPU per request (median); B $mb req/s, $cb µs; A vs B $(awk -v a="$ma" -v b="$mb" 'BEGIN {printf "%+.1f %%", (a / b - 1) * 100}') req/s, $(awk -v a="$ca" -v b="$cb" 'BEGIN {printf "%+.1f %%", (a / b - 1) * 100}') CPU"
