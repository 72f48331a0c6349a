#!/usr/bin/env bash
# bench/redis_calls.sh: what Redis does for one new key under load, idem-tower against `idempotent`
# (issue 24): each layer drives a Redis of its own (a private redis-server, started here, so
# nothing else counts), with wrk and new keys, and Redis's own accounting (INFO commandstats and
# INFO stats, reset before the run) is divided by the keys answered:
#
#   scripts µs   EVALSHA's usec, everything the scripts did (their Lua and the commands they called)
#   commands µs  the commands the scripts called (HSET, HMGET, PEXPIRE, ...), by their own usec
#   Lua µs       the difference: the interpreter's share (arguments made into Lua strings, the
#                helpers' closures, the scripts' own code, the reply)
#   calls        the commands the scripts called, per key
#   bytes in/out what crossed the network, per key
#   CPU µs       used_cpu_user + used_cpu_sys: all of Redis's time, the network's included
#
#   bench/redis_calls.sh                       # 5 s per layer
#   DURATION=10s PORT=17600 bench/redis_calls.sh
#
# Needs redis-server and wrk on PATH and the bench servers built (cd bench && cargo build
# --release --ignore-rust-version).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DURATION=${DURATION:-5s}
PORT=${PORT:-17600}
RUN="calls-$(date +%s)-$$"
die() { printf 'redis_calls.sh: %s\n' "$*" >&2; exit 1; }
command -v redis-server >/dev/null || die "no redis-server on PATH (apt-get install redis-server)"
command -v wrk >/dev/null || die "no wrk on PATH (apt-get install wrk)"
# shellcheck source=bench/private_redis.sh
source "$HERE/private_redis.sh"
need_servers tower idempotent

PIDS=()
# Waits for them too, so that a run right after this one finds the port free.
trap 'kill "${PIDS[@]}" 2>/dev/null; wait 2>/dev/null || true' EXIT
start_private_redis redis_calls.sh

# stat SECTION NAME: a number from INFO SECTION.
stat() { rcli info "$1" | tr -d '\r' | awk -F: -v name="$2" '$1 == name {print $2}'; }
# Redis's CPU time so far (used_cpu_user + used_cpu_sys), in microseconds.
cpu_us() { rcli info cpu | tr -d '\r' | awk -F: '/^used_cpu_(user|sys):/ {s += $2} END {printf "%.0f", s * 1e6}'; }

printf '| layer | keys/s | scripts µs | commands µs | Lua µs | calls | bytes in | bytes out | CPU µs |\n'
printf '|---|---:|---:|---:|---:|---:|---:|---:|---:|\n'
port=$((PORT + 1))
for bin in tower idempotent; do
    port=$((port + 1))
    REDIS_URL="redis://127.0.0.1:$PORT" BENCH_PREFIX="$RUN-$bin" "$HERE/target/release/$bin" "$port" >/dev/null 2>&1 &
    PIDS+=($!)
    for _ in $(seq 1 100); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
    cpu_before=$(cpu_us)
    # After the read above: the statistics count the run's commands only (an `INFO` is counted
    # once it has answered, so the one that reads them is not among them), and its bytes (with
    # those of the few `INFO`s that read them, a few kilobytes over the whole run).
    rcli config resetstat >/dev/null
    result=$(wrk -t2 -c32 -d"$DURATION" -s "$HERE/pay.lua" "http://127.0.0.1:$port/pay" -- new "$RUN-$bin" 2>&1)
    commandstats=$(rcli info commandstats | tr -d '\r')
    line=$(grep '^RESULT ' <<<"$result") || die "no RESULT from wrk: $result"
    grep -q 'status_errors=0 ' <<<"$line" || die "$bin answered errors: $line"
    keys=$(sed 's/.*requests=\([0-9]*\).*/\1/' <<<"$line")
    rps=$(sed 's/.*rps=\([0-9.]*\).*/\1/' <<<"$line")
    cpu=$(( $(cpu_us) - cpu_before ))
    bytes_in=$(stat stats total_net_input_bytes)
    bytes_out=$(stat stats total_net_output_bytes)
    awk -F'[:,=]' -v keys="$keys" -v rps="$rps" -v bin="$bin" \
        -v cpu="$cpu" -v bin_in="$bytes_in" -v bin_out="$bytes_out" '
        /^cmdstat_/ {
            name = substr($1, 9); calls = $3; usec = $5
            if (name == "evalsha") { scripts = usec }
            else if (name != "config|resetstat") { commands += usec; count += calls }
        }
        END {
            printf "| %s | %.0f | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f | %.1f |\n", bin, rps,
                scripts / keys, commands / keys, (scripts - commands) / keys, count / keys,
                bin_in / keys, bin_out / keys, cpu / keys
        }' <<<"$commandstats"
    kill "${PIDS[-1]}" 2>/dev/null || true
    rcli flushall >/dev/null
done
