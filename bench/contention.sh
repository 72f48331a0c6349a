#!/usr/bin/env bash
# bench/contention.sh: one slow run slows no other key (issue 43), measured. Runs the contention
# storm of crates/idem/tests/contention.rs with its long plan (IDEM_CONTENTION=long): two
# `idem serve` gateways on one store before a payments upstream that writes a ledger row in a
# PostgreSQL transaction (on PostgreSQL with --in-transaction, calling idem_complete in it); 40 new
# keys/s and 10 payments/s; for 60 s (the storm) one payment in ten holds its transaction 3-15 s
# and gets 10-20 copies sent at once to both gateways (--lease 5s --wait 10s: copies of the longest
# holds get 409 key-in-flight); the same traffic with no hold runs 30 s before the storm and 30 s
# after it (the baseline).
#
# Prints, per store, a markdown table: unrelated keys' req/s, p50, p99, max and errors in each
# phase, the slow keys' answers; then the lock waits of idem's connections (PostgreSQL), the ledger
# and the verdict (the test's assertions: 0 errors, p99 within 2x the baseline's, each slow key run
# once, no 503, no lock waits). The servers must run (`bash .ci/services`).
#
# Settings (environment): STORES ("postgres redis sqlite"), PROFILE (release; `dev` for a quick
# look with debug builds), PLAN (long; `short` is what `bash .ci/test` runs), IDEM_STORM_SEED (replays
# a run's holds and copies), LOGS (a directory for each store's whole output; temporary by default).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
STORES=${STORES:-postgres redis sqlite}
PROFILE=${PROFILE:-release}
PLAN=${PLAN:-long}
LOGS=${LOGS:-$(mktemp -d -t contention.XXXXXX)}
mkdir -p "$LOGS"

case "$PROFILE" in
    release) profile=(--release) ;;
    dev) profile=() ;;
    *) echo "contention.sh: PROFILE=$PROFILE: say release or dev" >&2; exit 2 ;;
esac

cd "$ROOT"
cargo test "${profile[@]}" --locked -p idem --all-features --test contention --no-run >&2
status=0
for store in $STORES; do
    case "$store" in
        postgres) test=contention_on_postgres_in_transaction ;;
        redis) test=contention_on_redis ;;
        sqlite) test=contention_on_sqlite ;;
        *) echo "contention.sh: unknown store $store (postgres, redis, sqlite)" >&2; exit 2 ;;
    esac
    printf '\n== %s (%s plan, %s build)\n\n' "$store" "$PLAN" "$PROFILE"
    if IDEM_CONTENTION=$PLAN cargo test "${profile[@]}" --locked -p idem --all-features --test contention \
        -- --exact "$test" --nocapture --test-threads=1 >"$LOGS/$store.log" 2>&1; then
        verdict="pass"
    else
        verdict="FAIL"
        status=1
    fi
    # The figures and the failed conditions; not the gateways' logs nor the backtrace.
    awk -v test="$test" '
        /^contention on / { on = 1 }
        /^test [a-z_]+ \.\.\. / { on = 0 }
        /^stack backtrace:/ { skip = 1 }
        /^---- idem serve stderr/ { skip = 1 }
        /^---- end ----/ { skip = 0; next }
        /^(ok|test result:.*)$/ { next }
        on && !skip && !/^[0-9]{4}-[0-9]{2}-[0-9]{2}T/ && NF { print }
    ' "$LOGS/$store.log"
    printf '\nverdict (%s): %s\n' "$store" "$verdict"
done
echo "(whole outputs: $LOGS)" >&2
exit "$status"
