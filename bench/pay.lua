-- wrk script: POST /pay with a small JSON body, a bearer credential and an Idempotency-Key.
--
--   wrk -t2 -c32 -d10s -s bench/pay.lua http://127.0.0.1:PORT/pay -- MODE RUN [KEYS]
--
-- MODE new:    every request gets a fresh key, RUN-n-<thread>-<counter>: never repeated across
--              threads, and RUN (random per run of compare.sh) keeps runs apart.
-- MODE replay: every request gets one of KEYS (default 64) keys RUN-r-0 .. RUN-r-(KEYS-1), which
--              the caller must have sent once before (compare.sh does, with curl), so that each
--              request is a replay of a completed key.
-- RUN may hold no ':' or '/' (the `idempotent` crate refuses them in keys).
--
-- At the end it prints one line that compare.sh reads:
--   RESULT requests=N seconds=S rps=R status_errors=N connect=N read=N write=N timeout=N p50_ms=X p99_ms=Y
-- status_errors counts answers with a status of 400 or more (wrk's own "Non-2xx or 3xx").

local threads = {}

function setup(thread)
   table.insert(threads, thread)
   thread:set("thread_id", #threads)
end

local mode, run, keys
local counter = 0
local body = '{"amount":100,"currency":"EUR","customer":"cus_bench"}'
local headers = {
   ["Content-Type"] = "application/json",
   ["Authorization"] = "Bearer bench",
}

function init(args)
   mode = args[1] or "new"
   run = args[2] or ("run" .. os.time())
   keys = tonumber(args[3] or "64")
   if mode ~= "new" and mode ~= "replay" then
      error("pay.lua: MODE must be new or replay, not " .. tostring(mode))
   end
end

function request()
   counter = counter + 1
   if mode == "new" then
      headers["Idempotency-Key"] = run .. "-n-" .. thread_id .. "-" .. counter
   else
      headers["Idempotency-Key"] = run .. "-r-" .. (counter % keys)
   end
   return wrk.format("POST", nil, headers, body)
end

function done(summary, latency, requests)
   local e = summary.errors
   local seconds = summary.duration / 1e6
   io.write(string.format(
      "RESULT requests=%d seconds=%.3f rps=%.1f status_errors=%d connect=%d read=%d write=%d timeout=%d p50_ms=%.3f p99_ms=%.3f\n",
      summary.requests, seconds, summary.requests / seconds, e.status, e.connect, e.read, e.write, e.timeout,
      latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
