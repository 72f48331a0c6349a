#!/usr/bin/env bash
# bench/log_cost.sh: what `idem serve`'s per-request log line costs: the same build twice in front
# of bare axum on Redis, one logging at the default `info` (a line per keyed request, to a file as
# a supervisor would take it), one at `IDEM_LOG=warn` (none), driven alternately with replays of
# 64 keys (the replay cache on). Prints req/s and the gateway's CPU per request for each round.
# Needs the release builds (cargo build --release -p idem; bench: cargo build --release).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
PORT_BASE=${PORT_BASE:-19400}
ROUNDS=${1:-3}
RUN="lc-$(date +%s)-$$"
LOGS=$(mktemp -d)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
"$HERE/target/release/bare" "$PORT_BASE" >"$LOGS/bare" 2>&1 &
PIDS+=($!)
declare -A PID=()
for side in info warn; do
    port=$((PORT_BASE + $([ $side = info ] && echo 1 || echo 2)))
    IDEM_LOG=$side "$ROOT/target/release/idem" serve --upstream "http://127.0.0.1:$PORT_BASE" \
        --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$((port + 10))" \
        --store "$REDIS_URL/?prefix=$RUN-$side" 2>"$LOGS/$side" &
    PIDS+=($!)
    PID[$side]=$!
done
sleep 2
for port in $((PORT_BASE + 1)) $((PORT_BASE + 2)); do
    for i in $(seq 0 63); do
        curl -s -o /dev/null -X POST -H 'Content-Type: application/json' -H 'Authorization: Bearer bench' \
            -H "Idempotency-Key: $RUN-r-$i" -d '{"amount":100,"currency":"EUR","customer":"cus_bench"}' \
            "http://127.0.0.1:$port/pay"
    done
done
TICK=$(getconf CLK_TCK)
for round in $(seq 1 "$ROUNDS"); do
    for side in info warn; do
        port=$((PORT_BASE + $([ $side = info ] && echo 1 || echo 2)))
        before=$(awk '{print $14 + $15}' "/proc/${PID[$side]}/stat")
        line=$(wrk -t2 -c32 -d5s -s "$HERE/pay.lua" "http://127.0.0.1:$port/pay" -- replay "$RUN" 2>&1 | grep '^RESULT ')
        after=$(awk '{print $14 + $15}' "/proc/${PID[$side]}/stat")
        n=$(sed 's/.*requests=\([0-9]*\).*/\1/' <<<"$line")
        rps=$(sed 's/.*rps=\([0-9.]*\).*/\1/' <<<"$line")
        echo "round $round IDEM_LOG=$side: $rps req/s, $(awk -v t=$((after - before)) -v hz="$TICK" -v n="$n" 'BEGIN {printf "%.1f", t / hz * 1e6 / n}') µs CPU per request"
    done
done
