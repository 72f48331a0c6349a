#!/usr/bin/env python3
"""bench/new_key_cost.py: what a new key's two Lua scripts cost Redis itself (issue 24).

A new key is two scripts: idem's `begin` (on a key that does not exist) and `complete`; the crate
`idempotent` 2.0.0's claim and complete scripts. This runs each, pipelined, on CALLS fresh keys
and prints Redis's own accounting of them (`usec_per_call` of EVALSHA from `INFO commandstats`,
reset before each phase; median of ROUNDS rounds), which leaves out the network and the client,
and what one completed record then takes (`OBJECT ENCODING`, and `MEMORY USAGE ... SAMPLES 0` of
its hash, every field counted; idem's answer is a key of its own beside it):

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
from script_cost import DAY, NOW, SCRIPTS, connect, delete, timed, with_helpers  # noqa: E402

try:
    import redis
except ImportError:
    sys.exit("new_key_cost.py: redis-py is missing: pip install redis")

ROUNDS = int(os.environ.get("ROUNDS", "5"))
CALLS = int(os.environ.get("CALLS", "15000"))
def idem_round(r, begin, complete, fingerprint, origin):
    tag = uuid.uuid4().hex[:10]
    keys = [tuple("{%s-%d}%s" % (tag, i, part) for part in "rbs") for i in range(CALLS)]
    channel = lambda i: "{%s-%d}w" % (tag, i)
    replies, begin_usec = timed(r, r.script_load(begin), (
        (3, *k, "b%d" % i, NOW, NOW + 60000, b"\x01" * 16, b"\xcd" * 32, fingerprint, NOW + 7 * DAY, channel(i),
         "PUBLISH", NOW + DAY, origin, "") for i, k in enumerate(keys)))
    if replies[0][1] != b"acquired":
        sys.exit(f"new_key_cost.py: idem's begin did not claim a new key: {replies[0]!r}")
    replies, complete_usec = timed(r, r.script_load(complete), (
        (3, *k, "c%d" % i, b"\x01" * 16, b"\xef" * 200, NOW + 5, NOW + DAY, NOW + 7 * DAY, channel(i), "PUBLISH", "",
         201) for i, k in enumerate(keys)))
    if replies[0][1] != 1:
        sys.exit(f"new_key_cost.py: idem's complete did not store the answer: {replies[0]!r}")
    record = (r.object("encoding", keys[0][0]).decode(), r.memory_usage(keys[0][0], samples=0),
              r.memory_usage(keys[0][1], samples=0))
    delete(r, (name for k in keys for name in k))
    return begin_usec, complete_usec, record


def idempotent_round(r, claim, complete):
    tag = "bench-new-key-cost-" + uuid.uuid4().hex[:10]
    counter = tag + "-ft"
    names = ["%s-%d" % (tag, i) for i in range(CALLS)]
    claims, claim_usec = timed(r, r.script_load(claim), (
        (2, name, counter, b"\x02" * 150, DAY, b"\xab" * 32) for name in names))
    if claims[0][0] != b"created":
        sys.exit(f"new_key_cost.py: idempotent's claim did not claim a new key: {claims[0]!r}")
    completed, complete_usec = timed(r, r.script_load(complete), (
        (1, name, b"\x03" * 400, claim[1], claim[2], DAY, b"\xab" * 32) for name, claim in zip(names, claims)))
    if completed[0] != 0:
        sys.exit(f"new_key_cost.py: idempotent's complete did not store the answer: {completed[0]!r}")
    record = (r.object("encoding", names[0]).decode(), r.memory_usage(names[0], samples=0), 0)
    delete(r, names + [counter])
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
