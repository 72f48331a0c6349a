#!/usr/bin/env bash
# bench/instructions.sh: the instructions each layer's process executes per new key, counted by
# valgrind (callgrind), idem-tower against `idempotent` (issue 24). Unlike req/s and CPU time, the
# count does not move with what else the machine is doing, so it tells a change of a few per cent
# apart from noise; it counts the process's own code only (not the kernel's, not Redis's).
#
# Each layer runs under callgrind with one runtime thread, on a private redis-server started here;
# wrk warms it with new keys, the counters are zeroed, wrk sends new keys for DURATION, the counters
# are dumped, and the total is divided by the requests wrk completed. Two columns:
#
#   Ir/key          every instruction of the process
#   without SHA-256 the same less sha2's compression function: valgrind's CPU has no SHA
#                   extensions, so sha2 runs its portable code here (about 3 500 instructions a
#                   block) where a real x86-64 CPU runs a few hundred
#
#   bench/instructions.sh                          # tower and idempotent, 10 s each
#   BENCH_BIN_B=/path/to/other/release bench/instructions.sh   # also another build's tower
#
# Needs valgrind, redis-server and wrk on PATH, and the bench servers built (cd bench && cargo
# build --release --ignore-rust-version). Settings: DURATION (10s), PORT (17650: Redis; the layers
# use the next ones).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DURATION=${DURATION:-10s}
PORT=${PORT:-17650}
RUN="ins-$(date +%s)-$$"
TMP=$(mktemp -d)
die() { printf 'instructions.sh: %s\n' "$*" >&2; exit 1; }
for tool in valgrind callgrind_control callgrind_annotate redis-server wrk curl; do
    command -v "$tool" >/dev/null || die "no $tool on PATH (apt-get install valgrind redis-server wrk curl)"
done
# shellcheck source=bench/private_redis.sh
source "$HERE/private_redis.sh"
need_servers tower idempotent

PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$TMP"' EXIT
start_private_redis instructions.sh

# count NAME BINARY PORT: prints "NAME | Ir/key | without SHA-256 | keys".
count() {
    local name=$1 bin=$2 port=$3 out="$TMP/$1.callgrind"
    TOKIO_WORKER_THREADS=1 REDIS_URL="redis://127.0.0.1:$PORT" BENCH_PREFIX="$RUN-$name" \
        valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" "$port" >/dev/null 2>"$TMP/$name.log" &
    local pid=$!
    PIDS+=("$pid")
    for _ in $(seq 1 600); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
    curl -s -o /dev/null "http://127.0.0.1:$port/" || die "$name did not start under valgrind: $(tail -5 "$TMP/$name.log")"
    wrk -t1 -c4 -d3s -s "$HERE/pay.lua" "http://127.0.0.1:$port/pay" -- new "$RUN-$name-warm" >/dev/null
    callgrind_control -z "$pid" >/dev/null 2>&1
    local result
    result=$(wrk -t1 -c4 -d"$DURATION" -s "$HERE/pay.lua" "http://127.0.0.1:$port/pay" -- new "$RUN-$name")
    callgrind_control -d "$pid" >/dev/null 2>&1
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    local line keys dump total sha
    line=$(grep '^RESULT ' <<<"$result") || die "no RESULT from wrk against $name: $result"
    grep -q 'status_errors=0 ' <<<"$line" || die "$name answered errors: $line"
    keys=$(sed 's/.*requests=\([0-9]*\).*/\1/' <<<"$line")
    # The dump callgrind_control asked for (the final one, at exit, counts the shutdown too).
    dump=$(ls "$out".* 2>/dev/null | head -1)
    [ -n "$dump" ] || die "callgrind wrote no dump for $name"
    total=$(awk '/^(summary|totals):/ && !found {print $2; found = 1}' "$dump")
    sha=$(callgrind_annotate --inclusive=yes "$dump" 2>/dev/null \
        | awk '/sha2::sha256::compress256 / && !found {gsub(",", "", $1); print $1; found = 1}')
    awk -v name="$name" -v total="$total" -v sha="${sha:-0}" -v keys="$keys" \
        'BEGIN { printf "| %s | %.0f | %.0f | %d |\n", name, total / keys, (total - sha) / keys, keys }'
}

printf '| layer | Ir/key | without SHA-256 | keys |\n|---|---:|---:|---:|\n'
port=$((PORT + 1))
count tower "$HERE/target/release/tower" "$port"
if [ -n "${BENCH_BIN_B:-}" ]; then
    count tower-b "$BENCH_BIN_B/tower" $((port + 1))
fi
count idempotent "$HERE/target/release/idempotent" $((port + 2))
