#!/usr/bin/env python3
"""bench/script_cost.py: what a replay's Lua script costs Redis itself (issue 10).

Runs, pipelined, each of these scripts on the same completed record and prints Redis's own
accounting of them (`INFO commandstats`, `usec_per_call` of EVALSHA after `CONFIG RESETSTAT`; the
median and the minimum of ROUNDS rounds of CALLS calls), which leaves out the network and the
client:

  empty       `return 1`: the price of calling any script
  idempotent  the replay path of the crate `idempotent` 2.0.0's claim script (`HMGET` of four
              fields of one hash, returned as they are)
  idem        the `begin` script of the idem Redis store (BEGIN of
              crates/idem-redis/src/scripts.rs after the prelude's helpers it uses, read from the
              source as the store puts it together) on a record and answer of the store's sizes,
              as a replay runs it

  before      with BEFORE=path/to/an/older/scripts.rs: that build's `begin`, in the same rounds

Usage: python3 bench/script_cost.py [REDIS_URL]   (default redis://127.0.0.1:6379; needs redis-py:
pip install redis). It resets the server's command statistics; its keys are deleted at the end.
Settings (environment): ROUNDS (5), CALLS (20000), BEFORE (say
`git show REV:crates/idem-redis/src/scripts.rs > /tmp/scripts.rs; BEFORE=/tmp/scripts.rs`).
"""

import os
import re
import statistics
import sys
import uuid
from pathlib import Path

try:
    import redis
except ImportError:
    sys.exit("script_cost.py: redis-py is missing: pip install redis")

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "crates/idem-redis/src/scripts.rs"
ROUNDS = int(os.environ.get("ROUNDS", "5"))
CALLS = int(os.environ.get("CALLS", "20000"))
# The bench scripts' clock (2026-01-01) and a day, in Unix milliseconds.
NOW = 1767225600000
DAY = 86400000

IDEMPOTENT_REPLAY = """
local values = redis.call('HMGET', KEYS[1], 'status', 'run_id', 'ft', 'data')
if values[4] then
    return {values[1], values[2], values[3], values[4]}
end
return 1
"""


def script(source, name):
    found = re.search(r'const %s: &str = r#"(.*?)"#;' % name, source, re.S)
    if not found:
        sys.exit(f"script_cost.py: no {name} in {SCRIPTS}")
    return found.group(1)


def with_helpers(source, name):
    """The script `name` as the store sends it: the prelude's helpers it uses, then its body (the
    selection of `with_helpers` in scripts.rs; an older scripts.rs without it gets the whole
    prelude, as that build sent it)."""
    prelude, body = script(source, "PRELUDE"), script(source, name)
    if "fn with_helpers" not in source:
        return prelude + body
    helpers = []  # [text, names]
    for line in prelude.split("\n")[:-1]:
        if helpers and helpers[-1][1] and (line.startswith("--") or line.startswith("local ")):
            helpers.append(["", []])
        if not helpers:
            helpers.append(["", []])
        if line.startswith("local "):
            declared = line[len("local "):]
            declared = declared[len("function "):] if declared.startswith("function ") else declared
            declared = re.split(r"[=(]", declared)[0]
            helpers[-1][1] = [n.strip() for n in declared.split(",")]
        helpers[-1][0] += line + "\n"
    code = lambda lua: "\n".join(l.split("--")[0] for l in lua.split("\n"))
    needed, kept = code(body), []
    for i in range(len(helpers) - 1, -1, -1):
        text, names = helpers[i]
        if i < 2 or any(re.search(r"(?<![A-Za-z0-9_])%s(?![A-Za-z0-9_])" % re.escape(n), needed) for n in names):
            kept.append(text)
            needed += code(text)
    return "".join(reversed(kept)) + body


def connect(tool):
    """A client of the Redis at the URL given as first argument (default the local one); exits,
    naming `tool`, if it does not answer."""
    url = sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379"
    r = redis.Redis.from_url(url)
    try:
        r.ping()
    except redis.RedisError as err:
        sys.exit(f"{tool}: Redis does not answer at {url}: {err}")
    return r


def timed(r, sha, calls):
    """Runs the script `sha` once for each argument list of `calls` (its number of keys, its keys,
    its arguments), pipelined, after resetting the server's statistics; returns the replies and
    Redis's µs per call."""
    r.config_resetstat()
    pipe = r.pipeline(transaction=False)
    for args in calls:
        pipe.evalsha(sha, *args)
    replies = pipe.execute()
    return replies, r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]


def delete(r, names):
    """Deletes the keys `names`, pipelined."""
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.delete(name)
    pipe.execute()


def main():
    r = connect("script_cost.py")
    source = SCRIPTS.read_text()
    tag = "{bench-script-cost-%s}" % uuid.uuid4().hex[:12]
    rec, body, steps, other = tag + "r", tag + "b", tag + "s", tag + "i"
    now = NOW
    fingerprint, digest = b"\xab" * 113, b"\xcd" * 32
    r.hset(rec, mapping={"state": "completed", "fingerprint": fingerprint, "digest": digest,
                         "created_at": now, "completed_at": now + 1, "expires_at": now + 86400000,
                         "purge_at": now + 7 * 86400000, "replays": 0})
    r.set(body, b"\xef" * 128)
    r.hset(other, mapping={"status": "complete", "run_id": "0123456789abcdef", "ft": "17",
                           "data": b"\xef" * 400})
    idem_args = ["nonce-0123456789", now + 10, now + 60000, b"\x00" * 16, digest, fingerprint,
                 now + 7 * 86400000, tag + "c", "PUBLISH"]
    cases = {
        "empty": ("return 1", [rec], []),
        "idempotent": (IDEMPOTENT_REPLAY, [other], []),
        "idem": (with_helpers(source, "BEGIN"), [rec, body, steps], idem_args),
    }
    if os.environ.get("BEFORE"):
        older = Path(os.environ["BEFORE"]).read_text()
        cases["before"] = (with_helpers(older, "BEGIN"), [rec, body, steps], idem_args)
    try:
        for name in ("idem", "before"):
            if name in cases:
                reply = r.eval(cases[name][0], 3, rec, body, steps, *idem_args)
                if reply[1] != b"existing" or reply[3] != b"\xef" * 128:
                    sys.exit(f"script_cost.py: {name}'s begin did not replay the record: {reply!r}")
        costs = {name: [] for name in cases}
        for _ in range(ROUNDS):
            for name, (code, keys, args) in cases.items():
                calls = ((len(keys), *keys, *args) for _ in range(CALLS))
                costs[name].append(timed(r, r.script_load(code), calls)[1])
    finally:
        r.delete(rec, body, steps, other)
    print(f"EVALSHA, µs per call by Redis's own accounting ({ROUNDS} rounds of {CALLS} pipelined calls)")
    print(f"{'script':12} {'median':>8} {'min':>8}")
    for name, values in costs.items():
        print(f"{name:12} {statistics.median(values):8.2f} {min(values):8.2f}")


if __name__ == "__main__":
    main()
