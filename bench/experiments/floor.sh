#!/usr/bin/env bash
# bench/experiments/floor.sh: how fast could idem-tower take new keys if its Redis record had the
# `idempotent` crate's shape? (issue 24). Builds the bench's `tower` server once more with
# record-floor.patch (beside this script) applied, in a throw-away worktree of HEAD, and
# alternates three servers on one Redis, new keys only:
#
#   main        this checkout's bench/target/release/tower
#   floor       the same layer on the cut-down record (a 5-field claim, the answer in the hash,
#               no tombstone, no wake-up): what the record's shape costs, measured, not estimated
#   idempotent  the peer, bench/target/release/idempotent
#
# Each round drives each server with wrk -t2 -c32 for DURATION (8s) after a 2 s warm-up of its own
# keys, and prints req/s, the server's own CPU per request (/proc) and Redis's (INFO cpu); then the
# median of each over the rounds, and each layer's req/s against the peer's.
#
#   bash bench/experiments/floor.sh [ROUNDS]      # 5 rounds by default
#
# Settings: DURATION (8s), REDIS_URL (redis://127.0.0.1:6379), PORT_BASE (19600: uses +0..+2),
# FLOOR_TARGET (/tmp/idem-floor-target: the floor build's cargo target, kept between runs).
# Needs the bench servers built (cd bench && cargo build --release --ignore-rust-version), wrk, git.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROOT=$(dirname "$HERE")
ROUNDS=${1:-5}
DURATION=${DURATION:-8s}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
PORT_BASE=${PORT_BASE:-19600}
FLOOR_TARGET=${FLOOR_TARGET:-/tmp/idem-floor-target}
RUN="floor-$(date +%s)-$$"
die() { printf 'floor.sh: %s\n' "$*" >&2; exit 1; }

for bin in tower idempotent; do
    [ -x "$HERE/target/release/$bin" ] \
        || die "no bench/target/release/$bin: cd bench && cargo build --release --ignore-rust-version"
done
redis-cli -u "$REDIS_URL" ping 2>/dev/null | grep -q PONG || die "Redis does not answer at $REDIS_URL"

WORKTREE=$(mktemp -d /tmp/idem-floor.XXXXXX)
PIDS=()
cleanup() {
    kill "${PIDS[@]}" 2>/dev/null || true
    redis-cli -u "$REDIS_URL" --scan --pattern "$RUN*" | xargs -r -n 500 redis-cli -u "$REDIS_URL" unlink >/dev/null
    git -C "$ROOT" worktree remove --force "$WORKTREE" 2>/dev/null || rm -rf "$WORKTREE"
}
trap cleanup EXIT

echo "building the floor: HEAD with bench/experiments/record-floor.patch, in $WORKTREE" >&2
git -C "$ROOT" worktree add --detach -q "$WORKTREE" HEAD
git -C "$WORKTREE" apply "$HERE/experiments/record-floor.patch"
(cd "$WORKTREE/bench" && CARGO_TARGET_DIR="$FLOOR_TARGET" cargo build -q --release --ignore-rust-version --bin tower) \
    || die "the floor build failed (does the patch still match crates/idem-redis/src/scripts.rs?)"

NAMES=(main floor idempotent)
declare -A BIN=([main]="$HERE/target/release/tower" [floor]="$FLOOR_TARGET/release/tower"
    [idempotent]="$HERE/target/release/idempotent")
declare -A PORT=() PID=()
for i in "${!NAMES[@]}"; do
    name=${NAMES[$i]}
    PORT[$name]=$((PORT_BASE + i))
    BENCH_PREFIX="$RUN-$name" REDIS_URL="$REDIS_URL" "${BIN[$name]}" "${PORT[$name]}" >"$WORKTREE/$name.log" 2>&1 &
    PID[$name]=$!
    PIDS+=($!)
    for _ in $(seq 1 150); do
        curl -s -o /dev/null "http://127.0.0.1:${PORT[$name]}/" && break
        sleep 0.1
    done
done

# Seconds of CPU so far: of a process (user + system), and of Redis (INFO cpu).
cpu() { awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.2f", ($12 + $13) / hz }' "/proc/$1/stat"; }
redis_cpu() { redis-cli -u "$REDIS_URL" info cpu | awk -F: '/^used_cpu_(user|sys):/ { s += $2 } END { printf "%.6f", s }'; }

declare -A RPS=() OWN=() REDIS=()
for round in $(seq 1 "$ROUNDS"); do
    for name in "${NAMES[@]}"; do
        url="http://127.0.0.1:${PORT[$name]}/pay"
        wrk -t2 -c32 -d2s -s "$HERE/pay.lua" "$url" -- new "$RUN-$name-w$round" >/dev/null 2>&1
        redis_before=$(redis_cpu)
        own_before=$(cpu "${PID[$name]}")
        result=$(wrk -t2 -c32 -d"$DURATION" -s "$HERE/pay.lua" "$url" -- new "$RUN-$name-$round" 2>&1)
        own_after=$(cpu "${PID[$name]}")
        redis_after=$(redis_cpu)
        line=$(grep '^RESULT ' <<<"$result") || die "no RESULT from wrk against $name: $result"
        grep -q 'status_errors=0 ' <<<"$line" || die "$name answered errors: $line"
        requests=$(sed 's/.*requests=\([0-9]*\).*/\1/' <<<"$line")
        rps=$(sed 's/.*rps=\([0-9.]*\).*/\1/' <<<"$line")
        own=$(awk -v a="$own_before" -v b="$own_after" -v n="$requests" 'BEGIN {printf "%.1f", (b - a) * 1e6 / n}')
        redis=$(awk -v a="$redis_before" -v b="$redis_after" -v n="$requests" 'BEGIN {printf "%.1f", (b - a) * 1e6 / n}')
        printf 'round %s %-10s %6.0f req/s, %5s µs own CPU, %5s µs Redis CPU per key\n' "$round" "$name" "$rps" "$own" "$redis"
        RPS[$name]+="$rps " OWN[$name]+="$own " REDIS[$name]+="$redis "
    done
done

median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR] = $1} END {printf "%.1f", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
echo
echo "| server | new keys req/s (median) | own CPU µs/key | Redis CPU µs/key | vs idempotent |"
echo "|---|---:|---:|---:|---:|"
peer=$(median "${RPS[idempotent]}")
for name in "${NAMES[@]}"; do
    rps=$(median "${RPS[$name]}")
    printf '| %s | %.0f | %s | %s | %s× |\n' "$name" "$rps" "$(median "${OWN[$name]}")" "$(median "${REDIS[$name]}")" \
        "$(awk -v a="$rps" -v b="$peer" 'BEGIN {printf "%.2f", a / b}')"
done
