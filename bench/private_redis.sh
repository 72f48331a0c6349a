# bench/private_redis.sh: sourced by the scripts that measure a layer on a Redis of its own
# (redis_calls.sh, instructions.sh), so that nothing else counts in what Redis reports. The caller
# sets HERE, PORT, a die() and an array PIDS whose processes its EXIT trap kills.

# need_servers BIN...: fails unless these bench servers are built.
need_servers() {
    local bin
    for bin in "$@"; do
        [ -x "$HERE/target/release/$bin" ] \
            || die "no $HERE/target/release/$bin: cd bench && cargo build --release --ignore-rust-version"
    done
}

# rcli ARGS...: redis-cli on the private server.
rcli() { redis-cli -p "$PORT" "$@"; }

# start_private_redis SCRIPT: a redis-server on PORT that keeps nothing on disk, added to PIDS;
# fails, naming SCRIPT, if something already answers there or it does not start.
start_private_redis() {
    rcli ping >/dev/null 2>&1 && die "something already answers on port $PORT: PORT=<another> bench/$1"
    redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no >/dev/null 2>&1 &
    PIDS+=($!)
    local _
    for _ in $(seq 1 50); do rcli ping >/dev/null 2>&1 && break; sleep 0.1; done
    rcli ping >/dev/null || die "the private redis-server on port $PORT did not start"
}
