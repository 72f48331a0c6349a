#!/usr/bin/env bash
# Starts a three-node Redis Cluster on 127.0.0.1:7001-7003 for the tests of idem-redis
# (IDEM_TEST_REDIS_CLUSTER_URL defaults to redis+cluster://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003).
#
# Idempotent: does nothing if the cluster already answers `cluster info` with cluster_state:ok.
# Nothing is persisted (--save "" --appendonly no); node files live in $IDEM_CLUSTER_DIR
# (default /tmp/idem-cluster). Stop it with: for p in 7001 7002 7003; do redis-cli -p $p shutdown nosave; done
set -euo pipefail

PORTS=(7001 7002 7003)
HOST=127.0.0.1
DIR="${IDEM_CLUSTER_DIR:-/tmp/idem-cluster}"

for tool in redis-server redis-cli; do
    command -v "$tool" >/dev/null || { echo "start-cluster.sh needs $tool on PATH (Debian: apt-get install redis-server)" >&2; exit 1; }
done

cluster_ok() {
    redis-cli -h "$HOST" -p "${PORTS[0]}" cluster info 2>/dev/null | tr -d '\r' | grep -qx 'cluster_state:ok'
}

if cluster_ok; then
    echo "Redis Cluster on $HOST:${PORTS[0]} is already up (cluster_state:ok)"
    exit 0
fi

mkdir -p "$DIR"
for port in "${PORTS[@]}"; do
    if redis-cli -h "$HOST" -p "$port" ping >/dev/null 2>&1; then
        continue
    fi
    # A node file from an earlier run names a cluster that no longer exists: start afresh.
    rm -f "$DIR/nodes-$port.conf"
    redis-server --port "$port" --bind "$HOST" --cluster-enabled yes \
        --cluster-config-file "$DIR/nodes-$port.conf" --dir "$DIR" \
        --save "" --appendonly no --daemonize yes --logfile "$DIR/redis-$port.log"
done

for port in "${PORTS[@]}"; do
    for _ in $(seq 1 100); do
        redis-cli -h "$HOST" -p "$port" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
    redis-cli -h "$HOST" -p "$port" ping >/dev/null 2>&1 || { echo "node $HOST:$port did not start; see $DIR/redis-$port.log" >&2; exit 1; }
done

# Slots are assigned once; nodes that already know each other only need time to agree.
assigned=$(redis-cli -h "$HOST" -p "${PORTS[0]}" cluster info | tr -d '\r' | sed -n 's/^cluster_slots_assigned://p')
if [ "${assigned:-0}" = "0" ]; then
    nodes=()
    for port in "${PORTS[@]}"; do nodes+=("$HOST:$port"); done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes
fi

for _ in $(seq 1 300); do
    if cluster_ok; then
        echo "Redis Cluster is up on ${PORTS[*]/#/$HOST:}"
        exit 0
    fi
    sleep 0.1
done
echo "the Redis Cluster did not reach cluster_state:ok within 30 s; see $DIR/redis-*.log" >&2
redis-cli -h "$HOST" -p "${PORTS[0]}" cluster info >&2 || true
exit 1
