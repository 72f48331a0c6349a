#!/usr/bin/env python3
"""bench/new_key_cost.py: what a new key's two Lua scripts cost Redis itself (issue 24).

A new key is two scripts: idem's `begin` (on a key that does not exist) and `complete`; the crate
`idempotent` 2.0.0's claim and complete scripts. This runs each, pipelined, on CALLS fresh keys
and prints Redis's own accounting of them (`usec_per_call` of EVALSHA from `INFO commandstats`,
reset before each phase; median of ROUNDS rounds), which leaves out the network and the client,
and what one completed record then takes (`OBJECT ENCODING`, `MEMORY USAGE` of its hash; idem's
answer is a key of its own beside it):

  idem          BEGIN and COMPLETE of crates/idem-redis/src/scripts.rs, with the prelude's
                helpers each uses (as the store sends them; the same selection as
                script_cost.py), and values of the store's sizes: a 113-byte encoded fingerprint,
                a 123-byte origin (a keyed scope, a UUID key, POST /pay), a 200-byte answer
  idem-short    the same scripts with the fingerprint and origin cut to 60 bytes each: every
                field of the hash then fits Redis's `hash-max-listpack-value` (64), and the hash
                is a listpack instead of a hash table (what a compact record layout would buy)
  idempotent    `idempotent` 2.0.0's valkey/claim.lua and valkey/complete.lua, read from the
                crate's source in the cargo registry (build bench/ first), with a 150-byte entry
                and a 400-byte completed one

Usage: python3 bench/new_key_cost.py [REDIS_URL]   (default redis://127.0.0.1:6379; needs
redis-py: pip install redis). It resets the server's command statistics; its keys are deleted at
the end. Settings (environment): ROUNDS (5), CALLS (15000).
"""

import glob
import os
import statistics
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_cost import SCRIPTS, connect, with_helpers  # noqa: E402

try:
    import redis
except ImportError:
    sys.exit("new_key_cost.py: redis-py is missing: pip install redis")

ROUNDS = int(os.environ.get("ROUNDS", "5"))
CALLS = int(os.environ.get("CALLS", "15000"))
NOW = 1767225600000
DAY = 86400000


def evalsha_usec(r):
    return r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]


def idem_round(r, begin, complete, fingerprint, origin):
    tag = uuid.uuid4().hex[:10]
    keys = [tuple("{%s-%d}%s" % (tag, i, part) for part in "rbs") for i in range(CALLS)]
    begin_sha, complete_sha = r.script_load(begin), r.script_load(complete)
    r.config_resetstat()
    pipe = r.pipeline(transaction=False)
    for i, k in enumerate(keys):
        pipe.evalsha(begin_sha, 3, *k, "b%d" % i, NOW, NOW + 60000, b"\x01" * 16, b"\xcd" * 32, fingerprint,
                     NOW + 7 * DAY, "{%s-%d}w" % (tag, i), "PUBLISH", NOW + DAY, origin, "")
    replies = pipe.execute()
    if replies[0][2] != b"acquired":
        sys.exit(f"new_key_cost.py: idem's begin did not claim a new key: {replies[0]!r}")
    begin_usec = evalsha_usec(r)
    r.config_resetstat()
    pipe = r.pipeline(transaction=False)
    for i, k in enumerate(keys):
        pipe.evalsha(complete_sha, 3, *k, "c%d" % i, b"\x01" * 16, b"\xef" * 200, NOW + 5, NOW + DAY,
                     NOW + 7 * DAY, "{%s-%d}w" % (tag, i), "PUBLISH", "", 201)
    replies = pipe.execute()
    if replies[0][2] != 1:
        sys.exit(f"new_key_cost.py: idem's complete did not store the answer: {replies[0]!r}")
    complete_usec = evalsha_usec(r)
    record = (r.object("encoding", keys[0][0]).decode(), r.memory_usage(keys[0][0]), r.memory_usage(keys[0][1]))
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.delete(*k)
    pipe.execute()
    return begin_usec, complete_usec, record


def idempotent_round(r, claim, complete):
    tag = "bench-new-key-cost-" + uuid.uuid4().hex[:10]
    counter = tag + "-ft"
    claim_sha, complete_sha = r.script_load(claim), r.script_load(complete)
    r.config_resetstat()
    pipe = r.pipeline(transaction=False)
    for i in range(CALLS):
        pipe.evalsha(claim_sha, 2, "%s-%d" % (tag, i), counter, b"\x02" * 150, DAY, b"\xab" * 32)
    claims = pipe.execute()
    if claims[0][0] != b"created":
        sys.exit(f"new_key_cost.py: idempotent's claim did not claim a new key: {claims[0]!r}")
    claim_usec = evalsha_usec(r)
    r.config_resetstat()
    pipe = r.pipeline(transaction=False)
    for i in range(CALLS):
        pipe.evalsha(complete_sha, 1, "%s-%d" % (tag, i), b"\x03" * 400, claims[i][1], claims[i][2], DAY,
                     b"\xab" * 32)
    completed = pipe.execute()
    if completed[0] != 0:
        sys.exit(f"new_key_cost.py: idempotent's complete did not store the answer: {completed[0]!r}")
    complete_usec = evalsha_usec(r)
    first = "%s-0" % tag
    record = (r.object("encoding", first).decode(), r.memory_usage(first), 0)
    pipe = r.pipeline(transaction=False)
    for i in range(CALLS):
        pipe.delete("%s-%d" % (tag, i))
    pipe.delete(counter)
    pipe.execute()
    return claim_usec, complete_usec, record


def main():
    r = connect("new_key_cost.py")
    source = SCRIPTS.read_text()
    begin, complete = with_helpers(source, "BEGIN"), with_helpers(source, "COMPLETE")
    crates = glob.glob(os.path.expanduser("~/.cargo/registry/src/*/idempotent-2.0.0/valkey"))
    if not crates:
        sys.exit("new_key_cost.py: no idempotent-2.0.0 in the cargo registry: build bench/ first "
                 "(cd bench && cargo build --release --ignore-rust-version)")
    claim_lua = Path(crates[0], "claim.lua").read_text()
    complete_lua = Path(crates[0], "complete.lua").read_text()
    cases = {
        "idem": lambda: idem_round(r, begin, complete, b"\xab" * 113, b"o" * 123),
        "idem-short": lambda: idem_round(r, begin, complete, b"\xab" * 60, b"o" * 60),
        "idempotent": lambda: idempotent_round(r, claim_lua, complete_lua),
    }
    results = {name: [] for name in cases}
    for _ in range(ROUNDS):
        for name, run in cases.items():
            results[name].append(run())
    print(f"EVALSHA, µs per call by Redis's own accounting (median of {ROUNDS} rounds of {CALLS} new keys),")
    print("and one completed record: its hash's encoding and bytes (+ the answer's own key)")
    print(f"{'case':12} {'claim':>7} {'complete':>9} {'both':>7}  record")
    for name, rounds in results.items():
        claim_usec = statistics.median(b for b, _, _ in rounds)
        complete_usec = statistics.median(c for _, c, _ in rounds)
        both = statistics.median(b + c for b, c, _ in rounds)
        encoding, record_bytes, answer_bytes = rounds[-1][2]
        answer = f" + {answer_bytes}" if answer_bytes else ""
        print(f"{name:12} {claim_usec:7.2f} {complete_usec:9.2f} {both:7.2f}  {encoding}, {record_bytes}{answer} bytes")


if __name__ == "__main__":
    main()
