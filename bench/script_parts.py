#!/usr/bin/env python3
"""bench/script_parts.py: what the parts of a new key's scripts cost Redis itself (issue 24).

Where `new_key_cost.py` prices idem's two scripts whole, this prices their parts, on an idle
server, by Redis's own accounting (`usec_per_call` of EVALSHA from `INFO commandstats`, reset
before each phase; CALLS fresh keys pipelined, median of ROUNDS rounds):

  empty, complete's arguments   a script that only returns, given complete's 3 keys and 10 arguments
  empty, 1 key and 1 argument   the same script given one key and the nonce: what arguments cost
  + HMGET                       the empty script and one HMGET of four fields of a missing key
  + PUBLISH                     the empty script and one PUBLISH to a channel nobody listens on
  + 10 closures                 the empty script and ten `local function`s, as the prelude makes
  complete                      COMPLETE of crates/idem-redis/src/scripts.rs on a claimed key
  complete - PUBLISH            the same without its wake-up PUBLISH
  complete - HDEL               the same without its HDEL of the claim's fields
  complete - both               without either

Usage: python3 bench/script_parts.py [REDIS_URL]   (default redis://127.0.0.1:6379; needs
redis-py). It resets the server's command statistics; its keys are deleted at the end. Settings
(environment): ROUNDS (5), CALLS (15000).
"""

import os
import statistics
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_cost import DAY, NOW, SCRIPTS, connect, delete, timed, with_helpers  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "5"))
CALLS = int(os.environ.get("CALLS", "15000"))
PUBLISH = "redis.call(publish, channel, 'completed')\n"
HDEL = "redis.call('HDEL', rec, 'token', 'lease_until', 'stepped')\n"
EMPTY = "return {ARGV[1], 1}"


def names(tag, i):
    return tuple("{%s-%d}%s" % (tag, i, part) for part in "rbs")


def begin_args(tag, i):
    return (3, *names(tag, i), "b%d" % i, NOW, NOW + 60000, b"\x01" * 16, b"\xcd" * 32, b"\xab" * 113,
            NOW + 7 * DAY, "{%s-%d}w" % (tag, i), "PUBLISH", NOW + DAY, b"o" * 123, "")


def complete_args(tag, i):
    return (3, *names(tag, i), "c%d" % i, b"\x01" * 16, b"\xef" * 200, NOW + 5, NOW + DAY, NOW + 7 * DAY,
            "{%s-%d}w" % (tag, i), "PUBLISH", "", 201)


def one_key_args(tag, i):
    return (1, names(tag, i)[0], "c%d" % i)


def run(r, script, args, claimed):
    """µs per call of `script`; with `claimed`, on keys that `begin` claimed first (not timed)."""
    tag = uuid.uuid4().hex[:10]
    if claimed:
        begin = r.script_load(with_helpers(SCRIPTS.read_text(), "BEGIN"))
        replies, _ = timed(r, begin, (begin_args(tag, i) for i in range(CALLS)))
        if replies[0][1] != b"acquired":
            sys.exit(f"script_parts.py: begin did not claim a new key: {replies[0]!r}")
    replies, usec = timed(r, r.script_load(script), (args(tag, i) for i in range(CALLS)))
    if replies[0][1] != 1:
        sys.exit(f"script_parts.py: a script did not succeed: {replies[0]!r}")
    delete(r, (name for i in range(CALLS) for name in names(tag, i)))
    return usec


def main():
    r = connect("script_parts.py")
    complete = with_helpers(SCRIPTS.read_text(), "COMPLETE")
    for part in (PUBLISH, HDEL):
        if part not in complete:
            sys.exit(f"script_parts.py: COMPLETE no longer has {part.strip()!r}: update this script")
    closures = "".join("local function f%d() end\n" % n for n in range(10))
    cases = {
        "empty, complete's arguments": (EMPTY, complete_args, False),
        "empty, 1 key and 1 argument": (EMPTY, one_key_args, False),
        "+ HMGET": ("redis.call('HMGET', KEYS[1], 'state', 'token', 'completed_by', 'stepped')\n" + EMPTY,
                    complete_args, False),
        "+ PUBLISH": ("redis.call('PUBLISH', ARGV[7], 'completed')\n" + EMPTY, complete_args, False),
        "+ 10 closures": (closures + EMPTY, complete_args, False),
        "complete": (complete, complete_args, True),
        "complete - PUBLISH": (complete.replace(PUBLISH, ""), complete_args, True),
        "complete - HDEL": (complete.replace(HDEL, ""), complete_args, True),
        "complete - both": (complete.replace(PUBLISH, "").replace(HDEL, ""), complete_args, True),
    }
    results = {name: [] for name in cases}
    for _ in range(ROUNDS):
        for name, (script, args, claimed) in cases.items():
            results[name].append(run(r, script, args, claimed))
    print(f"EVALSHA, µs per call by Redis's own accounting (median of {ROUNDS} rounds of {CALLS} keys)")
    for name, rounds in results.items():
        spread = " ".join("%.1f" % u for u in rounds)
        print(f"{name:28} {statistics.median(rounds):6.2f}   ({spread})")


if __name__ == "__main__":
    main()
