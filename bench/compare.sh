#!/usr/bin/env bash
# bench/compare.sh: idem against its peers and the floor (issue 10), in one run.
#
# Starts, on loopback:
#   bare        plain axum, POST /pay -> 201 (also the upstream of nginx and idem serve)
#   nginx       a plain reverse proxy to bare (keepalive to the upstream, access_log off)
#   idem serve  the gateway in front of bare, on Redis
#   idempotent  the handler behind the `idempotent` crate 2.0.0, on Redis
#   tower       the handler behind idem_tower::IdempotencyLayer, on idem_redis::RedisStore
# drives each with wrk (bench/pay.lua) with new keys and with replays of 64 keys, and prints the
# results and the ratios that issue 10 sets as goals. Fails if any request was not answered 2xx.
#
# Settings (environment): DURATION (10s), WARMUP (2s, discarded; 0 to skip), CONNECTIONS (32),
# THREADS (2), REDIS_URL (redis://127.0.0.1:6379), PORT_BASE (18080: uses PORT_BASE+1 .. +6),
# SKIP_INSTALL=1 (do not apt-get), SKIP_BUILD=1 (use the binaries already built),
# STRICT=1 (exit 1 when a goal is missed), KEEP_TMP=1 (keep the logs and configs); with
# SKIP_BUILD=1, IDEM_BIN and BENCH_BIN name other builds (the idem binary, the folder of the
# bench servers) to compare two versions of idem.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-2s}
CONNECTIONS=${CONNECTIONS:-32}
THREADS=${THREADS:-2}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
REDIS_URL=${REDIS_URL%/}
PORT_BASE=${PORT_BASE:-18080}
BARE_PORT=$((PORT_BASE + 1))
NGINX_PORT=$((PORT_BASE + 2))
IDEM_PORT=$((PORT_BASE + 3))
IDEM_ADMIN_PORT=$((PORT_BASE + 4))
IDEMPOTENT_PORT=$((PORT_BASE + 5))
TOWER_PORT=$((PORT_BASE + 6))
# The same idem serve and layer with their replay caches off, for what the cache buys.
NOCACHE_PORT=$((PORT_BASE + 7))
NOCACHE_ADMIN_PORT=$((PORT_BASE + 8))
TOWER_NOCACHE_PORT=$((PORT_BASE + 9))
RUN="bench-$(date +%s)-$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')"
BENCH_BIN=${BENCH_BIN:-"$HERE/target/release"}
IDEM_BIN=${IDEM_BIN:-"$ROOT/target/release/idem"}

say() { printf '\n== %s\n' "$*" >&2; }
die() { printf '\ncompare.sh: error: %s\n' "$*" >&2; exit 1; }

# --- what it needs ------------------------------------------------------------------------------
install_missing() {
    local missing=()
    command -v wrk >/dev/null || missing+=(wrk)
    command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)
    command -v curl >/dev/null || missing+=(curl)
    command -v redis-cli >/dev/null || missing+=(redis-tools)
    [ ${#missing[@]} -eq 0 ] && return
    [ "${SKIP_INSTALL:-0}" = 1 ] && die "missing: ${missing[*]} (and SKIP_INSTALL=1)"
    say "installing ${missing[*]} from Debian"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
}
install_missing
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

redis-cli -u "$REDIS_URL" ping 2>/dev/null | grep -q PONG || die "Redis does not answer at $REDIS_URL.
Start it with: redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    say "building idem (release) at the root"
    (cd "$ROOT" && cargo build --release -p idem) || die "cargo build --release -p idem failed"
    say "building the bench servers (release, own workspace; idempotent 2.0.0 needs --ignore-rust-version)"
    (cd "$HERE" && CARGO_TARGET_DIR="$HERE/target" cargo build --release --ignore-rust-version) \
        || die "building bench/ failed"
fi
for bin in "$IDEM_BIN" "$BENCH_BIN/bare" "$BENCH_BIN/idempotent" "$BENCH_BIN/tower"; do
    [ -x "$bin" ] || die "$bin is missing: run without SKIP_BUILD=1"
done

# --- processes, cleaned up on any exit ---------------------------------------------------------
TMP=$(mktemp -d /tmp/idem-compare.XXXXXX)
declare -A PID=()
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    for name in "${!PID[@]}"; do kill -TERM "${PID[$name]}" 2>/dev/null || true; done
    for name in "${!PID[@]}"; do
        for _ in $(seq 50); do kill -0 "${PID[$name]}" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "${PID[$name]}" 2>/dev/null || true
        wait "${PID[$name]}" 2>/dev/null || true
    done
    # This run's records: every store here used a prefix that starts with $RUN.
    redis-cli -u "$REDIS_URL" --scan --pattern "$RUN*" 2>/dev/null \
        | xargs -r -n 500 redis-cli -u "$REDIS_URL" unlink >/dev/null 2>&1 || true
    if [ "${KEEP_TMP:-0}" = 1 ] || [ "$status" -ne 0 ]; then
        echo "logs and configs kept in $TMP" >&2
    else
        rm -rf "$TMP"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for port in $BARE_PORT $NGINX_PORT $IDEM_PORT $IDEM_ADMIN_PORT $IDEMPOTENT_PORT $TOWER_PORT \
    $NOCACHE_PORT $NOCACHE_ADMIN_PORT $TOWER_NOCACHE_PORT; do
    port_free "$port" || die "port $port is taken (set PORT_BASE to move the ports)"
done

# start NAME PORT COMMAND...: runs it in the background, logs in $TMP/NAME.log, waits until an
# unkeyed POST /pay on PORT answers 201.
start() {
    local name=$1 port=$2
    shift 2
    "$@" >"$TMP/$name.log" 2>&1 &
    PID[$name]=$!
    local code=""
    for _ in $(seq 150); do
        kill -0 "${PID[$name]}" 2>/dev/null || {
            cat "$TMP/$name.log" >&2
            die "$name exited at start (log above)"
        }
        code=$(curl -s -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/json' \
            -d '{}' "http://127.0.0.1:$port/pay" || true)
        [ "$code" = 201 ] && return
        sleep 0.1
    done
    cat "$TMP/$name.log" >&2
    die "$name does not answer 201 on http://127.0.0.1:$port/pay after 15 s (last: '${code}')"
}

# post PORT KEY: one keyed request; prints the status and whether it was a replay.
post() {
    curl -s -o /dev/null -D "$TMP/headers" -w '%{http_code}' -X POST \
        -H 'Content-Type: application/json' -H 'Authorization: Bearer bench' -H "Idempotency-Key: $2" \
        -d '{"amount":100,"currency":"EUR","customer":"cus_bench"}' "http://127.0.0.1:$1/pay"
    grep -qi -- '-replayed: *true' "$TMP/headers" && printf ' replayed' || true
}

# check_layer NAME PORT: the same key twice must be a 201 then a replayed 201, or the layer is
# not in the path and the comparison would be wrong.
check_layer() {
    local key="$RUN-$1-check" first second
    first=$(post "$2" "$key")
    second=$(post "$2" "$key")
    [ "$first" = 201 ] && [ "$second" = "201 replayed" ] \
        || die "$1 is not replaying: first '$first', second '$second' (expected '201', '201 replayed')"
}

# warm_replays NAME PORT: sends the 64 keys of the replay phase once each (all must be 201).
warm_replays() {
    local code
    for i in $(seq 0 63); do
        code=$(post "$2" "$RUN-$1-r-$i")
        [ "$code" = 201 ] || die "$1: warming key $RUN-$1-r-$i answered '$code', not 201"
    done
}

declare -A RPS=() P50=() P99=() REDIS_US=() OWN_US=()
# drive NAME PORT MODE: one wrk run; fails loudly on any error.
# Seconds of CPU Redis has used so far (user + system).
redis_cpu() {
    redis-cli -u "$REDIS_URL" info cpu | awk -F: '/^used_cpu_(user|sys):/ { s += $2 } END { printf "%.6f", s }'
}

# Seconds of CPU process $1 has used so far (user + system; of its own threads, not its children).
proc_cpu() {
    awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.2f", ($12 + $13) / hz }' "/proc/$1/stat"
}

drive() {
    local name=$1 port=$2 mode=$3 out="$TMP/wrk-$1-$3.txt"
    if [ "$WARMUP" != 0 ] && [ "$WARMUP" != 0s ]; then
        # New keys of their own (-warm); replays of the 64 keys already completed.
        local warm_run="$RUN-$name-warm"
        [ "$mode" = replay ] && warm_run="$RUN-$name"
        wrk -t"$THREADS" -c"$CONNECTIONS" -d"$WARMUP" -s "$HERE/pay.lua" "http://127.0.0.1:$port/pay" \
            -- "$mode" "$warm_run" >"$out.warmup" 2>&1 || true
    fi
    say "$name, $mode keys: wrk -t$THREADS -c$CONNECTIONS -d$DURATION"
    local cpu_before cpu_after own_before own_after
    cpu_before=$(redis_cpu)
    own_before=$(proc_cpu "${PID[$name]}")
    wrk -t"$THREADS" -c"$CONNECTIONS" -d"$DURATION" -s "$HERE/pay.lua" "http://127.0.0.1:$port/pay" \
        -- "$mode" "$RUN-$name" >"$out" 2>&1 || { cat "$out" >&2; die "wrk failed against $name"; }
    cpu_after=$(redis_cpu)
    own_after=$(proc_cpu "${PID[$name]}")
    local result
    result=$(grep '^RESULT ' "$out") || { cat "$out" >&2; die "no RESULT line from wrk against $name"; }
    val() { sed -n "s/.* $1=\([0-9.]*\).*/\1/p" <<<"$result"; }
    local errors=$(( $(val status_errors) + $(val connect) + $(val read) + $(val write) + $(val timeout) ))
    if [ "$errors" -ne 0 ] || [ "$(val requests)" -eq 0 ]; then
        cat "$out" >&2
        echo "--- last lines of $name's log:" >&2
        tail -20 "$TMP/${name%%-*}.log" >&2 || true
        die "$name ($mode keys): $errors of $(val requests) requests were not answered 2xx or failed ($result); the comparison would be wrong"
    fi
    RPS[$name/$mode]=$(val rps)
    P50[$name/$mode]=$(val p50_ms)
    P99[$name/$mode]=$(val p99_ms)
    REDIS_US[$name/$mode]=$(awk -v a="$cpu_before" -v b="$cpu_after" -v n="$(val requests)" \
        'BEGIN { printf "%.1f", (b - a) * 1e6 / n }')
    OWN_US[$name/$mode]=$(awk -v a="$own_before" -v b="$own_after" -v n="$(val requests)" \
        'BEGIN { printf "%.0f", (b - a) * 1e6 / n }')
    printf '%s\n' "$result" >&2
}

# --- the run -------------------------------------------------------------------------------------
say "run $RUN: servers on 127.0.0.1:$BARE_PORT..$TOWER_PORT, logs in $TMP"

start bare "$BARE_PORT" "$BENCH_BIN/bare" "$BARE_PORT"

mkdir -p "$TMP/nginx"
cat >"$TMP/nginx.conf" <<EOF
worker_processes auto;
daemon off;
pid $TMP/nginx/nginx.pid;
error_log $TMP/nginx/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $TMP/nginx/body;
    proxy_temp_path $TMP/nginx/proxy;
    fastcgi_temp_path $TMP/nginx/fastcgi;
    uwsgi_temp_path $TMP/nginx/uwsgi;
    scgi_temp_path $TMP/nginx/scgi;
    upstream bare { server 127.0.0.1:$BARE_PORT; keepalive 64; }
    server {
        listen 127.0.0.1:$NGINX_PORT;
        location / {
            proxy_pass http://bare;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
EOF
"$NGINX" -t -q -p "$TMP/nginx" -c "$TMP/nginx.conf" -e "$TMP/nginx/error.log" \
    || die "nginx refuses the generated $TMP/nginx.conf"
start nginx "$NGINX_PORT" "$NGINX" -p "$TMP/nginx" -c "$TMP/nginx.conf" -e "$TMP/nginx/error.log"

start idem "$IDEM_PORT" "$IDEM_BIN" serve --upstream "http://127.0.0.1:$BARE_PORT" \
    --listen "127.0.0.1:$IDEM_PORT" --admin-listen "127.0.0.1:$IDEM_ADMIN_PORT" \
    --store "$REDIS_URL/?prefix=$RUN-idem"
BENCH_PREFIX="$RUN-idempotent" REDIS_URL="$REDIS_URL" \
    start idempotent "$IDEMPOTENT_PORT" "$BENCH_BIN/idempotent" "$IDEMPOTENT_PORT"
BENCH_PREFIX="$RUN-tower" REDIS_URL="$REDIS_URL" \
    start tower "$TOWER_PORT" "$BENCH_BIN/tower" "$TOWER_PORT"
start idem-nocache "$NOCACHE_PORT" "$IDEM_BIN" serve --upstream "http://127.0.0.1:$BARE_PORT" \
    --listen "127.0.0.1:$NOCACHE_PORT" --admin-listen "127.0.0.1:$NOCACHE_ADMIN_PORT" \
    --store "$REDIS_URL/?prefix=$RUN-idem-nocache" --replay-cache-entries 0
BENCH_PREFIX="$RUN-tower-nocache" REDIS_URL="$REDIS_URL" IDEM_REPLAY_CACHE_ENTRIES=0 \
    start tower-nocache "$TOWER_NOCACHE_PORT" "$BENCH_BIN/tower" "$TOWER_NOCACHE_PORT"

for target in idem:$IDEM_PORT idempotent:$IDEMPOTENT_PORT tower:$TOWER_PORT \
    idem-nocache:$NOCACHE_PORT tower-nocache:$TOWER_NOCACHE_PORT; do
    check_layer "${target%%:*}" "${target##*:}"
    warm_replays "${target%%:*}" "${target##*:}"
done

drive bare "$BARE_PORT" new
drive nginx "$NGINX_PORT" new
drive idem "$IDEM_PORT" new
drive idem "$IDEM_PORT" replay
drive idempotent "$IDEMPOTENT_PORT" new
drive idempotent "$IDEMPOTENT_PORT" replay
drive tower "$TOWER_PORT" new
drive tower "$TOWER_PORT" replay
drive idem-nocache "$NOCACHE_PORT" replay
drive tower-nocache "$TOWER_NOCACHE_PORT" replay

rss_kib=$(awk '/^VmRSS:/ { print $2 }' "/proc/${PID[idem]}/status")
hwm_kib=$(awk '/^VmHWM:/ { print $2 }' "/proc/${PID[idem]}/status")

# --- the report ----------------------------------------------------------------------------------
missed=0
# ratio A B GOAL KIND: prints "measured | goal | met" for A/B; KIND is % or x.
ratio() {
    awk -v a="$1" -v b="$2" -v goal="$3" -v kind="$4" 'BEGIN {
        r = a / b
        shown = (kind == "x") ? sprintf("%.2f×", r) : sprintf("%.0f %%", 100 * r)
        want = (kind == "x") ? sprintf("≥ %.1f×", goal) : sprintf("≥ %.0f %%", 100 * goal)
        printf "%s | %s | %s", shown, want, (r >= goal) ? "yes" : "**no**"
        exit (r >= goal) ? 0 : 1
    }'
}
row() {
    local out
    out=$(ratio "${RPS[$2]}" "${RPS[$3]}" "$4" "$5") || missed=$((missed + 1))
    printf '| %s | %s |\n' "$1" "$out"
}

{
    echo
    echo "## idem against its peers ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, run $RUN)"
    echo
    echo "wrk -t$THREADS -c$CONNECTIONS -d$DURATION (after a ${WARMUP} warm-up), POST /pay with a JSON body,"
    echo "\`Authorization: Bearer bench\`, an \`Idempotency-Key\` new per request or one of 64 already completed."
    echo
    echo "| server | keys | req/s | p50 ms | p99 ms | server CPU µs/req | Redis CPU µs/req |"
    echo "|---|---|---:|---:|---:|---:|---:|"
    for k in bare/new nginx/new idem/new idem/replay idem-nocache/replay idempotent/new idempotent/replay \
        tower/new tower/replay tower-nocache/replay; do
        case $k in
            bare/*) label="bare axum (no idempotency)"; keys="ignored" ;;
            nginx/*) label="nginx → bare"; keys="ignored" ;;
            idem/*) label="idem serve → bare, Redis" ;;
            idem-nocache/*) label="idem serve → bare, Redis, replay cache off" ;;
            idempotent/*) label="idempotent 2.0.0 layer, Redis" ;;
            tower/*) label="idem-tower layer, Redis" ;;
            tower-nocache/*) label="idem-tower layer, Redis, replay cache off" ;;
        esac
        case $k in */replay) keys="replays" ;; idem*/new | tower/new) keys="new" ;; esac
        own=${OWN_US[$k]}
        # nginx's work is done by its worker processes, which this does not count.
        [ "${k%%/*}" = nginx ] && own="–"
        printf '| %s | %s | %.0f | %s | %s | %s | %s |\n' "$label" "$keys" "${RPS[$k]}" "${P50[$k]}" "${P99[$k]}" "$own" "${REDIS_US[$k]}"
    done
    echo
    echo "| what | measured | goal | met |"
    echo "|---|---|---|---|"
    row "idem serve on Redis, new keys vs nginx" idem/new nginx/new 0.40 %
    row "idem serve on Redis, replays vs nginx (cache on)" idem/replay nginx/new 1.00 %
    row "idem-tower on Redis, new keys vs idempotent new" tower/new idempotent/new 1.0 x
    row "idem-tower on Redis, replays vs idempotent replays (cache on)" tower/replay idempotent/replay 1.5 x
    printf '| idem serve replays, cache on vs off | %.2f× | – | – |\n' \
        "$(awk -v a="${RPS[idem/replay]}" -v b="${RPS[idem-nocache/replay]}" 'BEGIN { print a / b }')"
    printf '| idem-tower replays, cache on vs off | %.2f× | – | – |\n' \
        "$(awk -v a="${RPS[tower/replay]}" -v b="${RPS[tower-nocache/replay]}" 'BEGIN { print a / b }')"
    rss_met=$(awk -v k="$rss_kib" 'BEGIN { print (k <= 64 * 1024) ? "yes" : "**no**" }')
    [ "$rss_met" = yes ] || missed=$((missed + 1))
    printf '| idem serve RSS after the runs (VmRSS; peak VmHWM %.1f MiB) | %.1f MiB | ≤ 64 MiB | %s |\n' \
        "$(awk -v k="$hwm_kib" 'BEGIN { print k / 1024 }')" "$(awk -v k="$rss_kib" 'BEGIN { print k / 1024 }')" "$rss_met"
    echo
    echo "Every request of every measured run was answered 2xx (wrk: no status ≥ 400, no socket error)."
    echo "$missed goal(s) missed."
}

if [ "${STRICT:-0}" = 1 ] && [ "$missed" -gt 0 ]; then
    exit 1
fi
