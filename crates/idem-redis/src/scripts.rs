//! The Lua scripts: one per operation, so every operation is one atomic round trip.
//!
//! Every script gets `KEYS[1]` = the record hash, `KEYS[2]` = the body string and `KEYS[3]` = the
//! checkpoints hash, which share a cluster hash tag, and `ARGV[1]` = a nonce, fresh for every
//! call. The wake-up channel (same tag, so `SPUBLISH` reaches the shard that runs the script) and
//! the publish command (`PUBLISH` standalone, `SPUBLISH` on a cluster) come in ARGV too.
//!
//! Every reply starts with the call's nonce (`{nonce, ...}`), and every error the scripts raise
//! about a record with the nonce and the record's key: a reply that reaches another call than the
//! one it answers (a connection whose replies are shifted by one) names another nonce, and is
//! refused instead of being acted on. The nonce is 128 random bits, fresh for every call, so it
//! alone tells the calls apart; a reply does not repeat the record's key, which would only be
//! sent back and parsed on every call (about 95 bytes each way).
//!
//! Times are the caller's Unix milliseconds, compared with the stored ones; native expiry is set
//! *relative* to the caller's `now` (never `PEXPIREAT`), so callers with a fake clock still get
//! coherent expiries. Operations without a `now` (release, renew) shift the record's existing
//! expiry by the change of its `purge_at`, which keeps it relative to the `now` of the begin or
//! complete that set it; `get`, `delete` and `checkpoints` judge the record at the server's clock
//! (`TIME`). A ttl that is not positive deletes the key instead.
//!
//! The checkpoints hash holds `count` (how many names), `name:<i>` (the i-th name first written,
//! from 1) and `value:<name>` (its latest value). It belongs to the run: it outlives a takeover
//! and a release as unknown, and is deleted by `complete`, a forgetting `release`, `delete` and
//! a new claim. Whenever the record's expiry is set or moved while the hash may exist, the hash
//! is given the very same expiry (`PEXPIRETIME` of the record, `PEXPIREAT` of the hash: the one
//! absolute expiry in the scripts, copied from a relative one, never computed), so it never
//! outlives the record.
//!
//! A corrupt record raises an error reply `IDEMCORRUPT <nonce> <record> ...` (see [`CORRUPT`]).
//!
//! One script is about no record: `scope_salt` gets the store's salt hash as its only key, in
//! `KEYS[1]` (so `rec` in its errors), and replies with the same `{nonce, ...}` check.

use std::sync::LazyLock;

use crate::script_load::StoreScript;

/// The error code of the scripts' own errors about stored data they cannot read.
pub(crate) const CORRUPT: &str = "IDEMCORRUPT";

/// Helpers shared by the scripts. `now` must be set before `expire_at` is used.
const PRELUDE: &str = r#"
local rec, body, steps, nonce = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local now
local function answer(...)
  return {nonce, ...}
end
local function corrupt(what)
  error(redis.error_reply('IDEMCORRUPT ' .. nonce .. ' ' .. rec .. ' ' .. what))
end
local function num(value, field)
  local n = tonumber(value)
  if n == nil then
    corrupt('has no valid ' .. field)
  end
  return n
end
-- Raises the error `failed` of a call: as a corrupt record if it was about a key of another type
-- than the store writes (not an outage, which the caller may retry or fail open on), else as it is.
local function raise(failed, what)
  if string.sub(failed.err, 1, 9) == 'WRONGTYPE' then
    corrupt(what)
  end
  error(failed)
end
-- HMGET of the record's fields named.
local function hmget(...)
  local cur = redis.pcall('HMGET', rec, ...)
  if cur.err then
    raise(cur, 'is not a hash')
  end
  return cur
end
-- The stored answer, false if none.
local function stored_body()
  local response = redis.pcall('GET', body)
  if type(response) == 'table' then
    raise(response, 'has an answer that is not a string')
  end
  return response
end
-- Raises if `cur` (an HMGET of the record) has fields but no state: no script writes a record
-- without one, so it is a damaged record, not an absent one.
local function stateless(cur)
  for i = 2, #cur do
    if cur[i] then
      corrupt('has no state')
    end
  end
end
-- A ttl is cut to 2^53 ms (285 000 years): Redis refuses one past i64::MAX ms minus its clock,
-- and one that near it, computed in Lua's doubles, passes or not with the rounding of `now`. idem
-- computes no time past the year 9999; a caller that gives one gets an expiry, not an error.
local function set_ttl(key, ttl)
  if ttl > 0 then
    redis.call('PEXPIRE', key, string.format('%d', math.min(ttl, 9007199254740992)))
  else
    redis.call('DEL', key)
  end
end
-- The server's own clock, by which the operations without a caller's `now` judge a record.
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- The record's fields in the order of `RECORD_FIELDS` (decode.rs), false where the hash has none
-- (every one if there is no record): one HMGET, its reply returned as it is.
local function read_record()
  return hmget('state', 'fingerprint', 'token', 'lease_until', 'created_at', 'completed_at',
    'expires_at', 'purge_at', 'replays', 'digest', 'recovered', 'trace_id', 'origin', 'status')
end
-- What `begin` reads: the fields of `CLAIM_FIELDS` (decode.rs), the first of `RECORD_FIELDS`,
-- without what the record keeps for the operator but the run's trace, which a replay's span links
-- to (the rest would cross the network with every replay for nothing).
local function read_claim()
  return hmget('state', 'fingerprint', 'token', 'lease_until', 'created_at', 'completed_at',
    'expires_at', 'purge_at', 'replays', 'digest', 'recovered', 'trace_id')
end
-- Positions in what `read_record` and `read_claim` return.
local STATE, TOKEN, LEASE_UNTIL, EXPIRES_AT, PURGE_AT, DIGEST, RECOVERED = 1, 3, 4, 7, 8, 10, 11
local function expire_at(key, at)
  set_ttl(key, at - now)
end
-- Moves the key's expiry by as much as its purge_at moves; `fallback_now` only if it has none.
local function shift_expiry(key, old_at, new_at, fallback_now)
  local pttl = redis.call('PTTL', key)
  local old = tonumber(old_at)
  if pttl >= 0 and old ~= nil then
    set_ttl(key, pttl + (new_at - old))
  else
    set_ttl(key, new_at - fallback_now)
  end
end
-- Gives the checkpoints hash the record's expiry, to the millisecond (deletes it with the record).
local function expire_steps_with_record()
  local at = redis.call('PEXPIRETIME', rec)
  if at > 0 then
    redis.call('PEXPIREAT', steps, at)
  elseif at == -1 then
    redis.call('PERSIST', steps)
  else
    redis.call('DEL', steps)
  end
end
"#;

/// `begin`. ARGV: nonce, now, lease_until, token, digest, fingerprint, purge_at of the claim,
/// channel, publish command, expires_at of the claim, origin (`origin.rs`), trace id (hex, or
/// empty for none). A new claim deletes whatever checkpoints an earlier record left; a takeover
/// keeps them, with the record's new expiry. A new claim writes the request's `origin` and
/// `trace_id` with `recovered` 0; a takeover writes its own `trace_id` (the run that answers is
/// the one to find) and `recovered` 1, and keeps the `origin` and `created_at` of the claim that
/// made the record (a record written before records kept an origin is given the request's). The claim rule is
/// `StoredRecord::on_begin`'s (idem-core), kept in step with it by `tests/claim_rules.rs`, which runs
/// the rule's table (`claim_rule_cases`) against this script: a record past its purge_at is
/// replaced unless it is a claim whose lease still runs; an abandoned claim or unknown outcome of
/// the same request is taken over only before its expires_at (always, for one written without).
///
/// The record is read once (one `HMGET` of every field it may have), and a replay is that read and
/// the `GET` of its body: no write (the store counts replays itself and adds them later, see
/// [`COUNT_REPLAYS`]). Every `redis.call` costs the script about a microsecond of the server's
/// one thread, so the common paths make as few as they can.
///
/// The store's identity is checked first, in the same script: `KEYS[4]` is the hash that holds
/// it for the record's slot (the salt hash on one server; a copy of the salt in the record's slot
/// on a cluster, `keys::identity_copy_key`) and `ARGV[13]` the identity the caller knows, in hex
/// (empty: no check).
///
/// Returns `{nonce, 'acquired', recovered}`,
/// `{nonce, 'existing', the record's fields (see `read_claim`), body or nil}`, or
/// `{nonce, 'other-store', the identity KEYS[4] holds or ''}` when it holds another one or none.
const BEGIN: &str = r#"
if ARGV[13] ~= '' then
  local held = redis.call('HGET', KEYS[4], 'identity')
  if held ~= ARGV[13] then
    -- Not the store the caller knew (its data was lost): nothing is claimed.
    return answer('other-store', held or '')
  end
end
now = num(ARGV[2], 'now')
local lease_until, token, digest, fingerprint = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local claim_purge_at, channel, publish, claim_expires_at = ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local origin, trace_id = ARGV[11], ARGV[12]
local cur = read_claim()
local state = cur[STATE]
if not state then
  stateless(cur)
end
if state == 'in-flight' and cur[TOKEN] == token then
  -- This very claim was already made: a retry after the reply was lost.
  return answer('acquired', tonumber(cur[RECOVERED]) or 0)
end
local lease_ended = state == 'in-flight' and num(cur[LEASE_UNTIL], 'lease_until') <= now
if state and num(cur[PURGE_AT], 'purge_at') <= now and (state ~= 'in-flight' or lease_ended) then
  -- Past purge_at the record is as good as absent; whoever waits on it must look again.
  redis.call('DEL', rec, body, steps)
  redis.call(publish, channel, 'replaced')
  state = false
end
if not state then
  -- Nothing to clear: a record's body and checkpoints never outlive it (they expire no later, and
  -- every script that deletes it deletes them).
  redis.call('HSET', rec, 'fingerprint', fingerprint, 'digest', digest, 'created_at', ARGV[2], 'replays', 0,
    'state', 'in-flight', 'token', token, 'lease_until', lease_until, 'expires_at', claim_expires_at,
    'purge_at', claim_purge_at, 'recovered', 0, 'origin', origin, 'trace_id', trace_id)
  expire_at(rec, num(claim_purge_at, 'purge_at'))
  return answer('acquired', 0)
end
local same = cur[DIGEST] == digest
-- Past its ttl a key without an answer is expired, as an answered one is: never run again.
local expired = cur[EXPIRES_AT] and num(cur[EXPIRES_AT], 'expires_at') <= now
if same and not expired and (state == 'unknown' or lease_ended) then
  redis.call('HSET', rec, 'state', 'in-flight', 'token', token, 'lease_until', lease_until,
    'expires_at', claim_expires_at, 'purge_at', claim_purge_at, 'recovered', 1, 'trace_id', trace_id)
  if redis.call('HEXISTS', rec, 'origin') == 0 then
    -- Written before records kept their origin: named now, so that `list` finds the recovered run.
    redis.call('HSET', rec, 'origin', origin)
  end
  expire_at(rec, num(claim_purge_at, 'purge_at'))
  expire_steps_with_record()
  redis.call(publish, channel, 'taken-over')
  return answer('acquired', 1)
end
-- An answer past expires_at is not returned, even in the moment before its key expires.
local response = false
if state == 'completed' and now < num(cur[EXPIRES_AT], 'expires_at') then
  response = stored_body()
end
return answer('existing', cur, response)
"#;

/// Adds replays counted by a store to the record, if it still exists (a count never makes a key
/// of its own, which would have no expiry). ARGV: nonce, how many. Returns `{nonce, 1}`, or
/// `{nonce, 0}` if there is no record.
const COUNT_REPLAYS: &str = r#"
if redis.call('HEXISTS', rec, 'state') == 0 then
  return answer(0)
end
num(ARGV[2], 'count')
redis.call('HINCRBY', rec, 'replays', ARGV[2])
return answer(1)
"#;

/// `complete`. ARGV: nonce, token, response, completed_at (the `now` of the expiries),
/// expires_at, purge_at, channel, publish command, `again` if an earlier call of this claim may
/// have stored the answer unseen (else empty), and the answer's status. Deletes the run's
/// checkpoints (if it recorded any: the record's `stepped`, set by `checkpoint`), keeps the token
/// as `completed_by` and the status as `status`; `recovered` stays, saying whether the run that
/// answered was recovered. Returns `{nonce, 1}`, or `{nonce, 0}` if the token is not
/// the current claim (with `again`: nor the claim whose answer is stored, which is then left as
/// it is).
const COMPLETE: &str = r#"
local token, response, channel, publish = ARGV[2], ARGV[3], ARGV[7], ARGV[8]
local cur = hmget('state', 'token', 'completed_by', 'stepped')
if ARGV[9] == 'again' and cur[1] == 'completed' and cur[3] == token then
  -- This claim's own answer, stored by a call whose outcome the caller never saw: written once
  -- more (the same value), so that this call writes and its acknowledgement covers the answer.
  redis.call('HSET', rec, 'completed_by', token)
  return answer(1)
end
if cur[1] ~= 'in-flight' or cur[2] ~= token then
  return answer(0)
end
now = num(ARGV[4], 'completed_at')
if cur[4] then
  redis.call('DEL', steps)
end
redis.call('HDEL', rec, 'token', 'lease_until', 'stepped')
redis.call('HSET', rec, 'state', 'completed', 'completed_at', ARGV[4], 'expires_at', ARGV[5], 'purge_at', ARGV[6],
  'completed_by', token, 'status', ARGV[10])
local body_ttl = num(ARGV[5], 'expires_at') - now
if body_ttl > 0 then
  redis.call('SET', body, response, 'PX', string.format('%d', math.min(body_ttl, 9007199254740992)))
else
  redis.call('DEL', body)
end
expire_at(rec, num(ARGV[6], 'purge_at'))
redis.call(publish, channel, 'completed')
return answer(1)
"#;

/// `release`. ARGV: nonce, token, `forget` or `unknown`, purge_at (for `unknown`), channel,
/// publish command, expires_at (for `unknown`). `forget` deletes the checkpoints with the record;
/// `unknown` keeps them for the next run, with the record's new expiry, and keeps what the record
/// says about its run (`origin`, `trace_id`, `recovered`). Returns `{nonce, 1}`, or
/// `{nonce, 0}` if fenced.
const RELEASE: &str = r#"
local token, mode, channel, publish = ARGV[2], ARGV[3], ARGV[5], ARGV[6]
local cur = hmget('state', 'token', 'purge_at')
if cur[1] ~= 'in-flight' or cur[2] ~= token then
  return answer(0)
end
if mode == 'forget' then
  redis.call('DEL', rec, body, steps)
else
  local purge_at = num(ARGV[4], 'purge_at')
  redis.call('HDEL', rec, 'token', 'lease_until')
  redis.call('HSET', rec, 'state', 'unknown', 'expires_at', ARGV[7], 'purge_at', ARGV[4])
  redis.call('DEL', body)
  shift_expiry(rec, cur[3], purge_at, server_now())
  expire_steps_with_record()
end
redis.call(publish, channel, 'released')
return answer(1)
"#;

/// `renew`. ARGV: nonce, token, lease_until, purge_at for a claim written without an expires_at
/// (the old rule). A claim with one keeps its purge_at, moved to the new lease's end if that is
/// later. Moves the checkpoints' expiry with the record's. Returns `{nonce, 1}`, or
/// `{nonce, 0}` if fenced.
const RENEW: &str = r#"
local token = ARGV[2]
local cur = hmget('state', 'token', 'purge_at', 'expires_at')
if cur[1] ~= 'in-flight' or cur[2] ~= token then
  return answer(0)
end
local new_purge_at = ARGV[4]
if cur[4] then
  new_purge_at = cur[3]
  if num(ARGV[3], 'lease_until') > num(cur[3], 'purge_at') then
    new_purge_at = ARGV[3]
  end
end
local purge_at = num(new_purge_at, 'purge_at')
redis.call('HSET', rec, 'lease_until', ARGV[3], 'purge_at', new_purge_at)
shift_expiry(rec, cur[3], purge_at, server_now())
expire_steps_with_record()
return answer(1)
"#;

/// `get`. ARGV: nonce. Returns `{nonce, the record's fields (see `read_record`) or nil, body
/// or nil}`, read at one instant and judged at the server's clock: a record past purge_at is absent,
/// an answer past expires_at is dropped, even in the moment before their keys expire.
const GET: &str = r#"
now = server_now()
local cur = read_record()
if not cur[STATE] then
  stateless(cur)
end
if not cur[STATE] or num(cur[PURGE_AT], 'purge_at') <= now then
  return answer(false, false)
end
local response = false
if cur[STATE] == 'completed' and now < num(cur[EXPIRES_AT], 'expires_at') then
  response = stored_body()
end
return answer(cur, response)
"#;

/// `delete`. ARGV: nonce, channel, publish command, the store's deletions channel, the record's
/// digest. Returns `{nonce, the record's fields or
/// nil, body or nil}` as they were, judged at that clock as `get` judges them (a record past
/// purge_at was already absent), and, as `Store::delete` says, deletes the record, its body and its
/// checkpoints, or, for a claim in flight, fences it (no token) and leaves it unknown with the
/// claim's expires_at (its purge_at for a claim written without one) and its expiry, its
/// checkpoints deleted. A record whose fields cannot be read is deleted all the same and returned
/// as it is, for the caller to report; one whose keys hold another type than the store writes is
/// deleted all the same, and the script raises [`CORRUPT`]. Wakes whoever waits on the record,
/// and announces the delete to every instance's replay cache with a plain `PUBLISH` of the digest
/// on the deletions channel (a cluster passes it to every node, whatever the record's slot).
const DELETE: &str = r#"
now = server_now()
local channel, publish = ARGV[2], ARGV[3]
redis.call('PUBLISH', ARGV[4], ARGV[5])
local fields, response = false, false
-- Whether `err`, what `pcall` gave of a read that failed (the error's text), is the reads' own
-- error about a key of the record of another type than the store writes; any other error is
-- raised again as it was.
local function wrong_type(err)
  local text = type(err) == 'table' and err.err or tostring(err)
  if string.find(text, 'IDEMCORRUPT ' .. nonce .. ' ', 1, true) == 1 then
    return true
  end
  error(redis.error_reply(text))
end
if redis.call('EXISTS', rec) == 1 then
  local readable, cur = pcall(read_record)
  local purge_at, expires_at, live
  if readable then
    purge_at, expires_at = tonumber(cur[PURGE_AT]), tonumber(cur[EXPIRES_AT])
    live = not cur[STATE] or purge_at == nil or now < purge_at
    if live then
      fields = cur
      if cur[STATE] == 'completed' and (expires_at == nil or now < expires_at) then
        readable, response = pcall(stored_body)
        if not readable then
          wrong_type(response)
        end
      end
    end
  else
    wrong_type(cur)
  end
  if not readable then
    -- A key of the record holds another type than the store writes: deleted all the same.
    redis.call(publish, channel, 'deleted')
    redis.call('DEL', rec, body, steps)
    corrupt('held a key of another type than the store writes, and is deleted')
  end
  redis.call(publish, channel, 'deleted')
  if live and cur[STATE] == 'in-flight' and cur[TOKEN] and purge_at ~= nil then
    redis.call('HDEL', rec, 'token', 'lease_until', 'stepped')
    redis.call('HSET', rec, 'state', 'unknown', 'expires_at', cur[EXPIRES_AT] or cur[PURGE_AT])
    redis.call('DEL', body, steps)
    return answer(fields, response)
  end
end
redis.call('DEL', rec, body, steps)
return answer(fields, response)
"#;

/// `claim_state`, and the polls of `wait`. ARGV: nonce, token. Returns `{nonce, 2}` if the
/// record is in flight under the token, `{nonce, 1}` if it was completed under it
/// (`completed_by`), `{nonce, 0}` otherwise.
const CLAIM_STATE: &str = r#"
local cur = hmget('state', 'token', 'completed_by')
if cur[1] == 'in-flight' and cur[2] == ARGV[2] then
  return answer(2)
end
if cur[1] == 'completed' and cur[3] == ARGV[2] then
  return answer(1)
end
return answer(0)
"#;

/// `checkpoint`. ARGV: nonce, token, name, value. Records the checkpoint if the record is in flight
/// under this token: a new name goes after the others, a known one keeps its place and takes the
/// new value; the hash then expires with the record. Returns `{nonce, 1}`, or
/// `{nonce, 0}` if fenced (no record, another claim, or no claim in flight).
const CHECKPOINT: &str = r#"
local token, name, value = ARGV[2], ARGV[3], ARGV[4]
local cur = hmget('state', 'token')
if cur[1] ~= 'in-flight' or cur[2] ~= token then
  return answer(0)
end
if redis.call('HSET', steps, 'value:' .. name, value) == 1 then
  local position = redis.call('HINCRBY', steps, 'count', 1)
  redis.call('HSET', steps, 'name:' .. position, name)
  -- So that `complete` deletes the hash only when there is one.
  redis.call('HSET', rec, 'stepped', 1)
end
expire_steps_with_record()
return answer(1)
"#;

/// `checkpoints`. ARGV: nonce. Returns `{nonce, {name1, value1, name2, value2, ...}}` in the
/// order the names were first written, judged at the server's clock as `get` judges the record:
/// none unless the record is in flight or unknown and not past its purge_at.
const CHECKPOINTS: &str = r#"
now = server_now()
local cur = hmget('state', 'purge_at')
if (cur[1] ~= 'in-flight' and cur[1] ~= 'unknown') or num(cur[2], 'purge_at') <= now then
  return answer({})
end
local count = redis.call('HGET', steps, 'count')
count = count and num(count, 'checkpoint count') or 0
local flat = {}
for i = 1, count do
  local name = redis.call('HGET', steps, 'name:' .. i)
  local value = name and redis.call('HGET', steps, 'value:' .. name)
  if not value then
    corrupt('has lost checkpoint ' .. i .. ' of ' .. count)
  end
  flat[#flat + 1] = name
  flat[#flat + 1] = value
end
return answer(flat)
"#;

/// `scope_salt`. KEYS[1] = the salt hash (no other key). ARGV: nonce, the candidate identity (hex);
/// to make the salt if there is none, also salt, created_at and older_records_until (empty for
/// none). Makes it only if the key does not exist, in the same step as it looks, so of racing
/// callers exactly one makes it; the key is given no expiry. A salt that exists counts one more
/// `reads`, so that the call always writes: its acknowledgement by a replica then proves the
/// replica has the salt, even when another instance made it a moment ago (a salt lost in a
/// failover would rename every scope); a salt made before salts had an identity is given the
/// candidate's. Returns `{nonce, HGETALL of the key}` as it is afterwards (an empty hash if there
/// is still none).
const SCOPE_SALT: &str = r#"
if ARGV[3] and redis.call('EXISTS', rec) == 0 then
  redis.call('HSET', rec, 'salt', ARGV[3], 'created_at', ARGV[4], 'identity', ARGV[2])
  if ARGV[5] ~= '' then
    redis.call('HSET', rec, 'older_records_until', ARGV[5])
  end
elseif redis.call('EXISTS', rec) == 1 then
  redis.call('HINCRBY', rec, 'reads', 1)
  redis.call('HSETNX', rec, 'identity', ARGV[2])
end
return answer(redis.call('HGETALL', rec))
"#;

/// `copy_identity` (a cluster's): KEYS[1] = the copy of the salt in one slot
/// (`keys::identity_copy_key`). ARGV: nonce, the identity the copy held when a claim found it
/// stale (empty: none), then identity, salt, created_at, older_records_until (empty for none), as
/// the salt hash holds them. Replaces the copy (no expiry) only if it still holds what the claim
/// saw: an instance that read an older salt hash never overwrites a copy another instance has
/// just written from a newer one. Returns `{nonce, 1}`, or `{nonce, 0}` if the copy changed.
const COPY_IDENTITY: &str = r#"
if (redis.call('HGET', rec, 'identity') or '') ~= ARGV[2] then
  return answer(0)
end
redis.call('DEL', rec)
redis.call('HSET', rec, 'identity', ARGV[3], 'salt', ARGV[4], 'created_at', ARGV[5])
if ARGV[6] ~= '' then
  redis.call('HSET', rec, 'older_records_until', ARGV[6])
end
return answer(1)
"#;

/// `identity`. KEYS[1] = the salt hash. ARGV: nonce. Returns `{nonce, its identity or false}`.
const IDENTITY: &str = r#"
return answer(redis.call('HGET', rec, 'identity'))
"#;

fn script(index: usize, body: &str) -> StoreScript {
    StoreScript::new(index, &with_helpers(body))
}

/// `body` after the prelude's helpers that it uses, directly or through another helper, in the
/// prelude's order. Every `local function` is a closure made on every call of the script, so a
/// script carries only the helpers it calls.
///
/// Each top-level `local` statement of [`PRELUDE`] is a helper, with the comment lines just
/// above it; it is kept if one of the names it declares occurs, as a whole word, in the body or
/// in a helper kept after it (a Lua local is visible only below its declaration, so a helper
/// uses only helpers above it). Comments do not count (no string in the scripts holds `--`). The
/// first one (`rec`, `body`, `steps`, `nonce`) and `now` are kept always.
fn with_helpers(body: &str) -> String {
    let helpers = helpers();
    let mut needed = code(body);
    let mut kept = vec![false; helpers.len()];
    for (i, helper) in helpers.iter().enumerate().rev() {
        if i < 2 || helper.names.iter().any(|name| mentions(&needed, name)) {
            kept[i] = true;
            needed.push_str(&code(&helper.text));
        }
    }
    let mut script = String::new();
    for (helper, _) in helpers.iter().zip(&kept).filter(|(_, kept)| **kept) {
        script.push_str(&helper.text);
    }
    script.push_str(body);
    script
}

/// `lua` without its comments.
fn code(lua: &str) -> String {
    let mut code = String::with_capacity(lua.len());
    for line in lua.lines() {
        code.push_str(line.split("--").next().unwrap_or_default());
        code.push('\n');
    }
    code
}

/// A top-level statement of [`PRELUDE`], with the comments above it, and the names it declares.
struct Helper {
    text: String,
    names: Vec<String>,
}

fn helpers() -> Vec<Helper> {
    let mut helpers = Vec::new();
    let mut text = String::new();
    let mut names = Vec::new();
    for line in PRELUDE.lines() {
        // A top-level comment or `local` after a declaration starts the next helper.
        if (line.starts_with("--") || line.starts_with("local ")) && !names.is_empty() {
            helpers.push(Helper {
                text: std::mem::take(&mut text),
                names: std::mem::take(&mut names),
            });
        }
        if let Some(declared) = line.strip_prefix("local ") {
            let declared = declared.strip_prefix("function ").unwrap_or(declared);
            let declared = declared.split(['=', '(']).next().unwrap_or_default();
            names = declared.split(',').map(|name| name.trim().to_owned()).collect();
        }
        text.push_str(line);
        text.push('\n');
    }
    helpers.push(Helper { text, names });
    helpers
}

/// Whether `name` occurs in `text` as a whole Lua identifier.
fn mentions(text: &str, name: &str) -> bool {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(name).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + name.len()..].chars().next();
        !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
    })
}

pub(crate) static BEGIN_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(0, BEGIN));
pub(crate) static COMPLETE_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(1, COMPLETE));
pub(crate) static RELEASE_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(2, RELEASE));
pub(crate) static RENEW_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(3, RENEW));
pub(crate) static GET_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(4, GET));
pub(crate) static DELETE_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(5, DELETE));
pub(crate) static CLAIM_STATE_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(6, CLAIM_STATE));
pub(crate) static CHECKPOINT_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(7, CHECKPOINT));
pub(crate) static CHECKPOINTS_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(8, CHECKPOINTS));
pub(crate) static COUNT_REPLAYS_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(9, COUNT_REPLAYS));
pub(crate) static SCOPE_SALT_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(10, SCOPE_SALT));
pub(crate) static COPY_IDENTITY_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(11, COPY_IDENTITY));
pub(crate) static IDENTITY_SCRIPT: LazyLock<StoreScript> = LazyLock::new(|| script(12, IDENTITY));

#[cfg(test)]
mod tests {
    use super::*;
    use crate::script_load::SCRIPTS;

    const ALL: [(&str, &str); 13] = [
        ("begin", BEGIN),
        ("complete", COMPLETE),
        ("release", RELEASE),
        ("renew", RENEW),
        ("get", GET),
        ("delete", DELETE),
        ("claim_state", CLAIM_STATE),
        ("checkpoint", CHECKPOINT),
        ("checkpoints", CHECKPOINTS),
        ("count_replays", COUNT_REPLAYS),
        ("scope_salt", SCOPE_SALT),
        ("copy_identity", COPY_IDENTITY),
        ("identity", IDENTITY),
    ];

    #[test]
    fn the_prelude_splits_into_its_declarations() {
        let names: Vec<String> = helpers().into_iter().flat_map(|helper| helper.names).collect();
        assert_eq!(
            names,
            [
                "rec",
                "body",
                "steps",
                "nonce",
                "now",
                "answer",
                "corrupt",
                "num",
                "raise",
                "hmget",
                "stored_body",
                "stateless",
                "set_ttl",
                "server_now",
                "read_record",
                "read_claim",
                "STATE",
                "TOKEN",
                "LEASE_UNTIL",
                "EXPIRES_AT",
                "PURGE_AT",
                "DIGEST",
                "RECOVERED",
                "expire_at",
                "shift_expiry",
                "expire_steps_with_record",
            ]
        );
        let whole: String = helpers().into_iter().map(|helper| helper.text).collect();
        assert_eq!(whole.trim_end(), PRELUDE.trim_end(), "nothing of the prelude is lost");
    }

    #[test]
    fn every_script_has_every_helper_it_names_and_no_other() {
        for (what, body) in ALL {
            let script = with_helpers(body);
            for helper in helpers().iter().skip(2) {
                let defined = script.contains(helper.text.as_str());
                let named = helper
                    .names
                    .iter()
                    .any(|name| mentions(&code(&script.replacen(helper.text.as_str(), "", 1)), name));
                assert_eq!(defined, named, "{what}: helper {:?}", helper.names);
            }
        }
    }

    #[test]
    fn a_new_key_runs_only_the_helpers_it_calls() {
        let complete = code(&with_helpers(COMPLETE));
        for unused in [
            "read_record",
            "read_claim",
            "server_now",
            "shift_expiry",
            "expire_steps_with_record",
        ] {
            assert!(!mentions(&complete, unused), "complete carries {unused}");
        }
        let begin = code(&with_helpers(BEGIN));
        assert!(!mentions(&begin, "read_record") && !mentions(&begin, "server_now"));
        assert!(mentions(&begin, "read_claim") && mentions(&begin, "expire_steps_with_record"));
    }

    #[test]
    fn mentions_matches_whole_words_only() {
        assert!(mentions("x = num(a)", "num"));
        assert!(!mentions("x = number(a)", "num"));
        assert!(!mentions("x = a_num", "num"));
        assert!(mentions("num", "num"));
    }

    #[test]
    fn every_script_has_a_place_of_its_own_in_the_loads() {
        let scripts = [
            &BEGIN_SCRIPT,
            &COMPLETE_SCRIPT,
            &RELEASE_SCRIPT,
            &RENEW_SCRIPT,
            &GET_SCRIPT,
            &DELETE_SCRIPT,
            &CLAIM_STATE_SCRIPT,
            &CHECKPOINT_SCRIPT,
            &CHECKPOINTS_SCRIPT,
            &COUNT_REPLAYS_SCRIPT,
            &SCOPE_SALT_SCRIPT,
            &COPY_IDENTITY_SCRIPT,
            &IDENTITY_SCRIPT,
        ];
        let mut places: Vec<usize> = scripts.iter().map(|script| script.index()).collect();
        places.sort_unstable();
        assert_eq!(places, (0..SCRIPTS).collect::<Vec<_>>());
    }
}
