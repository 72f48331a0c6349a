# bench/warm.sh: sourced by the scripts that drive gateways with pay.lua's replays (ab.sh,
# experiments/split_threads.sh). The caller sets LOGS (the servers' logs) and a die().

# wait_for_port PORT: waits up to 15 s until something answers HTTP on 127.0.0.1:PORT (the caller
# finds out what did not start when it warms it).
wait_for_port() {
    local _
    for _ in $(seq 1 150); do
        curl -s -o /dev/null "http://127.0.0.1:$1/" && return
        sleep 0.1
    done
}

# warm_replays PORT PREFIX: completes the keys of pay.lua's replays (PREFIX-0 .. PREFIX-63) once
# each through the gateway on PORT; all must be answered 201.
warm_replays() {
    local i code
    for i in $(seq 0 63); do
        code=$(curl -s -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/json' \
            -H 'Authorization: Bearer bench' -H "Idempotency-Key: $2-$i" \
            -d '{"amount":100,"currency":"EUR","customer":"cus_bench"}' "http://127.0.0.1:$1/pay")
        [ "$code" = 201 ] || die "port $1 answered $code to a warming request (logs in $LOGS)"
    done
}
