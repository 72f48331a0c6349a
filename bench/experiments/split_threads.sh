#!/usr/bin/env bash
# bench/experiments/split_threads.sh: is `idem serve`'s new-key path cheaper one runtime thread a
# process? (issue 24's "serve thread lead": with TOKIO_WORKER_THREADS=1 one gateway spent less CPU
# per new key than with two threads.) Alternates, on one Redis and one upstream (bench's `bare`):
#
#   one   one gateway with its default runtime (a worker thread per core), driven by two wrk -t1 -c16
#   split two gateways of one worker thread each (thread per core, as nginx runs a process per
#         core), each driven by one wrk -t1 -c16
#
# so the load generator, the connection count and the cores are the same on both sides; prints
# req/s (the two wrk summed), the gateways' CPU per request (/proc) and Redis's (INFO cpu).
#
#   bash bench/experiments/split_threads.sh [ROUNDS]     # 3 rounds by default
#
# Settings: DURATION (8s), MODE (new, or replay), REDIS_URL (redis://127.0.0.1:6379), PORT_BASE
# (19300: uses +0..+3 and +50..+53). Needs target/release/idem and bench/target/release/bare.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROOT=$(dirname "$HERE")
ROUNDS=${1:-3}
DURATION=${DURATION:-8s}
MODE=${MODE:-new}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
PORT_BASE=${PORT_BASE:-19300}
IDEM="$ROOT/target/release/idem"
RUN="split-$(date +%s)-$$"
die() { printf 'split_threads.sh: %s\n' "$*" >&2; exit 1; }
# shellcheck source=bench/warm.sh
source "$HERE/warm.sh"
[ -x "$IDEM" ] && [ -x "$HERE/target/release/bare" ] \
    || die "build first: cargo build --release -p idem; (cd bench && cargo build --release --ignore-rust-version)"
redis-cli -u "$REDIS_URL" ping 2>/dev/null | grep -q PONG || die "Redis does not answer at $REDIS_URL"

LOGS=$(mktemp -d)
PIDS=()
cleanup() {
    kill "${PIDS[@]}" 2>/dev/null || true
    redis-cli -u "$REDIS_URL" --scan --pattern "$RUN*" | xargs -r -n 500 redis-cli -u "$REDIS_URL" unlink >/dev/null
    [ "${KEEP_LOGS:-0}" = 1 ] && echo "logs in $LOGS" >&2 || rm -rf "$LOGS"
}
trap cleanup EXIT

"$HERE/target/release/bare" "$PORT_BASE" >"$LOGS/bare" 2>&1 &
PIDS+=($!)
# gateway PORT [ENV=VALUE...]: starts one in front of bare; prints its pid.
gateway() {
    local port=$1
    shift
    env "$@" "$IDEM" serve --upstream "http://127.0.0.1:$PORT_BASE" --listen "127.0.0.1:$port" \
        --admin-listen "127.0.0.1:$((port + 50))" --store "$REDIS_URL/?prefix=$RUN" >"$LOGS/$port" 2>&1 &
    echo $!
}
ONE=$(gateway $((PORT_BASE + 1)))
SPLIT_A=$(gateway $((PORT_BASE + 2)) TOKIO_WORKER_THREADS=1)
SPLIT_B=$(gateway $((PORT_BASE + 3)) TOKIO_WORKER_THREADS=1)
PIDS+=("$ONE" "$SPLIT_A" "$SPLIT_B")
for port in $((PORT_BASE + 1)) $((PORT_BASE + 2)) $((PORT_BASE + 3)); do
    wait_for_port "$port"
    kill -0 "$ONE" "$SPLIT_A" "$SPLIT_B" 2>/dev/null || die "a gateway exited at start: $(tail -qn1 "$LOGS"/[0-9]*)"
    warm_replays "$port" "$RUN-$port-r"
done

# Seconds of CPU so far: of processes (user + system, summed), and of Redis.
cpu() {
    local total=0 pid
    for pid in "$@"; do
        total=$(awk -v t="$total" -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.2f", t + ($12 + $13) / hz }' "/proc/$pid/stat")
    done
    echo "$total"
}
redis_cpu() { redis-cli -u "$REDIS_URL" info cpu | awk -F: '/^used_cpu_(user|sys):/ { s += $2 } END { printf "%.6f", s }'; }
# drive PORT_1 PORT_2 TAG: two wrk -t1 -c16 at once; prints the requests they completed together.
drive() {
    local keys1="$RUN-$3-1" keys2="$RUN-$3-2"
    if [ "$MODE" = replay ]; then keys1="$RUN-$1"; keys2="$RUN-$2"; fi
    wrk -t1 -c16 -d"$DURATION" -s "$HERE/pay.lua" "http://127.0.0.1:$1/pay" -- "$MODE" "$keys1" >"$LOGS/wrk1" 2>&1 &
    local first=$!
    wrk -t1 -c16 -d"$DURATION" -s "$HERE/pay.lua" "http://127.0.0.1:$2/pay" -- "$MODE" "$keys2" >"$LOGS/wrk2" 2>&1
    wait "$first"
    local total=0 file line
    for file in "$LOGS/wrk1" "$LOGS/wrk2"; do
        line=$(grep '^RESULT ' "$file") || die "no RESULT from wrk: $(cat "$file")"
        grep -q 'status_errors=0 ' <<<"$line" || die "errors: $line"
        total=$((total + $(sed 's/.*requests=\([0-9]*\).*/\1/' <<<"$line")))
    done
    echo "$total"
}

seconds=${DURATION%s}
for round in $(seq 1 "$ROUNDS"); do
    for side in one split; do
        if [ $side = one ]; then pids=("$ONE"); ports=($((PORT_BASE + 1)) $((PORT_BASE + 1)))
        else pids=("$SPLIT_A" "$SPLIT_B"); ports=($((PORT_BASE + 2)) $((PORT_BASE + 3))); fi
        redis_before=$(redis_cpu)
        own_before=$(cpu "${pids[@]}")
        requests=$(drive "${ports[@]}" "$side$round")
        own_after=$(cpu "${pids[@]}")
        redis_after=$(redis_cpu)
        awk -v r="$round" -v s="$side" -v n="$requests" -v d="$seconds" -v a="$own_before" -v b="$own_after" \
            -v ra="$redis_before" -v rb="$redis_after" \
            'BEGIN { printf "round %s %-5s %6.0f req/s, %5.1f µs gateway CPU, %5.1f µs Redis CPU per request\n", r, s, n / d, (b - a) * 1e6 / n, (rb - ra) * 1e6 / n }'
    done
done
