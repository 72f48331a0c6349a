#!/usr/bin/env bash
# bench/list_limit.sh: what `idem list` costs on Redis as --limit grows: RECORDS completed records
# written straight into a private redis-server (as the Redis store lays them out), then the CPU
# time (user + system) of `idem list --limit L` for each L in LIMITS. The list scans every record
# whatever the limit; what the limit may change is the cost of keeping the newest L.
#
#   bash bench/list_limit.sh                                  # 50 000 records, limits 1000 and 50000
#   RECORDS=200000 LIMITS="1000 100000" PORT=17610 bash bench/list_limit.sh
#   IDEM_BIN=target/release/idem bash bench/list_limit.sh
#
# Needs redis-server, redis-cli and python3 on PATH and a built idem (IDEM_BIN, default
# target/debug/idem).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RECORDS=${RECORDS:-50000}
LIMITS=${LIMITS:-"1000 $RECORDS"}
PORT=${PORT:-17610}
PREFIX=bench-list
IDEM_BIN=${IDEM_BIN:-$HERE/../target/debug/idem}
die() { printf 'list_limit.sh: %s\n' "$*" >&2; exit 1; }
command -v redis-server >/dev/null || die "no redis-server on PATH (apt-get install redis-server)"
command -v python3 >/dev/null || die "no python3 on PATH"
[ -x "$IDEM_BIN" ] || die "no $IDEM_BIN: cargo build -p idem (or set IDEM_BIN)"
# shellcheck source=bench/private_redis.sh
source "$HERE/private_redis.sh"

PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; wait 2>/dev/null || true' EXIT
start_private_redis list_limit.sh

# The records, in RESP for `redis-cli --pipe`: each hash named as RecordKeys::new names it (the
# sha256 of the scope's and the key's lengths and bytes), with the fields `idem list` reads.
python3 - "$RECORDS" "$PREFIX" <<'EOF' | rcli --pipe >/dev/null
import hashlib, struct, sys, time
records, prefix = int(sys.argv[1]), sys.argv[2]
now = int(time.time() * 1000)
out = sys.stdout.buffer
def resp(*args):
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(parts)
scope = "anonymous"
for i in range(records):
    key = "bench-%08d" % i
    h = hashlib.sha256()
    for part in (scope, key):
        h.update(struct.pack(">Q", len(part)) + part.encode())
    name = "%s:{%s}:rec" % (prefix, h.hexdigest())
    path = "/pay"
    origin = "".join("%d:%s" % (len(p), p) for p in (scope, key, "POST", path))
    # Created in random-looking order, so that the newest are not met last.
    created = now - 3_600_000 + (i * 7919) % 3_600_000
    out.write(resp("HSET", name, "state", "completed", "created_at", created,
                   "completed_at", created, "expires_at", now + 86_400_000,
                   "purge_at", now + 7 * 86_400_000, "replays", 0, "recovered", 0,
                   "origin", origin, "trace_id", "", "status", 201))
EOF
[ "$(rcli dbsize)" -ge "$RECORDS" ] || die "the records were not all written"

printf '| records | --limit | CPU s (user + sys) | lines listed |\n|---|---|---|---|\n'
for limit in $LIMITS; do
    lines=$( { /usr/bin/time -f '%U %S' -o /tmp/list_limit.$$ \
        "$IDEM_BIN" list --store "redis://127.0.0.1:$PORT/?prefix=$PREFIX" --limit "$limit" 2>/dev/null || true; } | wc -l)
    cpu=$(awk '{printf "%.2f", $1 + $2}' /tmp/list_limit.$$)
    rm -f /tmp/list_limit.$$
    printf '| %s | %s | %s | %s |\n' "$RECORDS" "$limit" "$cpu" "$((lines - 1))"
done
