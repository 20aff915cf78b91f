-- Redis scripts (Lua, run atomically by the server). KEYS[1] is the lease hash, KEYS[2] the
-- key's token counter, which is kept apart from the hash so that deleting (purging) a lease
-- never lets its token restart. The clock is the server's TIME, read inside the script, unless
-- the store was opened with an injected clock (ARGV[1] non-empty). Times are epoch seconds,
-- written with microsecond precision ('%.6f'); numbers go back to Python as strings, because
-- Redis truncates Lua numbers to integers in replies.

-- name: clock
local function now(injected)
  if injected ~= '' then return tonumber(injected) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.6f', x) end
local function lease_current(lease_hash, owner, token, t)
  local state, o, tok, expires_at = unpack(redis.call(
    'HMGET', lease_hash, 'state', 'owner', 'token', 'expires_at'))
  return state == 'running' and o == owner and tok == token and tonumber(expires_at) > t
end

-- name: claim
-- KEYS: lease hash, token counter, store-wide fence counter, running index (a sorted set of
-- running lease hashes by deadline, so a sweep reads only what expired). ARGV: injected_now,
-- owner, ttl
-- ARGV[4]: task JSON ('' for none); ARGV[5]: this claim call's nonce.
local t = now(ARGV[1])
local state, expires_at, not_before = unpack(redis.call(
  'HMGET', KEYS[1], 'state', 'expires_at', 'not_before'))
local takeover = state == 'running' and tonumber(expires_at) <= t
local ready = state == 'ready' and (not not_before or tonumber(not_before) <= t)
if state and not ready and not takeover then
  return false
end
local token = redis.call('INCR', KEYS[2])
local fence = redis.call('INCR', KEYS[3])  -- the store-wide fence
local deadline = fmt(t + tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], 'state', 'running', 'owner', ARGV[2], 'token', token,
           'expires_at', deadline, 'updated_at', fmt(t), 'fence', fence, 'nonce', ARGV[5])
redis.call('ZADD', KEYS[4], tonumber(deadline), KEYS[1])
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
local takeovers = redis.call('HINCRBY', KEYS[1], 'takeovers', takeover and 1 or 0)
redis.call('HDEL', KEYS[1], 'result', 'not_before')
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'task', ARGV[4])
else redis.call('HDEL', KEYS[1], 'task') end  -- never a previous delivery's
return {tostring(token), deadline, tostring(fence), tostring(attempts), tostring(takeovers)}

-- name: renew
-- KEYS[1]: the running index, then one lease hash per lease; ARGV: injected_now, ttl, then
-- (owner, token) per lease.
local t = now(ARGV[1])
local out = {}
for i = 2, #KEYS do
  local key, n = KEYS[i], i - 1
  local state, owner, token, expires_at = unpack(redis.call(
    'HMGET', key, 'state', 'owner', 'token', 'expires_at'))
  if state == 'running' and owner == ARGV[1 + 2 * n] and token == ARGV[2 + 2 * n]
      and tonumber(expires_at) > t then
    local deadline = fmt(t + tonumber(ARGV[2]))
    redis.call('HSET', key, 'expires_at', deadline, 'updated_at', fmt(t))
    redis.call('ZADD', KEYS[1], tonumber(deadline), key)
    out[n] = deadline
  else
    out[n] = ''
  end
end
return out

-- name: settle
-- finish (done), release (ready) and kill (dead), fenced on the current lease.
-- ARGV: injected_now, owner, token, new_state, result_json, reason, delay ('' for none)
local t = now(ARGV[1])
local state, owner, token, expires_at = unpack(redis.call(
  'HMGET', KEYS[1], 'state', 'owner', 'token', 'expires_at'))
if not (state == 'running' and owner == ARGV[2] and token == ARGV[3]
        and tonumber(expires_at) > t) then
  return 0
end
redis.call('HSET', KEYS[1], 'state', ARGV[4], 'expires_at', fmt(t), 'updated_at', fmt(t))
redis.call('ZREM', KEYS[2], KEYS[1])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'reason', ARGV[6])
else redis.call('HDEL', KEYS[1], 'reason') end
if ARGV[7] ~= '' and tonumber(ARGV[7]) > 0 then
  redis.call('HSET', KEYS[1], 'not_before', fmt(t + tonumber(ARGV[7])))
end
return 1

-- name: force_release
-- An operator's override: running -> ready whoever holds it. KEYS: lease hash, running index.
-- ARGV: injected_now, reason
local t = now(ARGV[1])
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return 0 end
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('HSET', KEYS[1], 'state', 'ready', 'expires_at', fmt(t), 'updated_at', fmt(t),
           'reason', ARGV[2])
redis.call('HDEL', KEYS[1], 'not_before')
return 1

-- name: requeue
-- dead -> ready with a fresh budget of attempts. ARGV: injected_now, reason
local t = now(ARGV[1])
if redis.call('HGET', KEYS[1], 'state') ~= 'dead' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'ready', 'attempts', 0, 'takeovers', 0,
           'updated_at', fmt(t), 'reason', ARGV[2])
redis.call('HDEL', KEYS[1], 'not_before')
return 1

-- name: sweep
-- Mark the expired generations found in the running index (once per token), at most ARGV[2];
-- each leaves the index (a later claim puts the key back). KEYS[1]: the running index.
local t = now(ARGV[1])
local marked = {}
for _, hash in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', t, 'LIMIT', 0,
                                 tonumber(ARGV[2]))) do
  local state, expires_at, token, swept, task = unpack(redis.call(
    'HMGET', hash, 'state', 'expires_at', 'token', 'swept_token', 'task'))
  if state == 'running' and tonumber(expires_at) > t then
    redis.call('ZADD', KEYS[1], tonumber(expires_at), hash)  -- renewed meanwhile: keep it
  else
    redis.call('ZREM', KEYS[1], hash)
    if state == 'running' and task and swept ~= token then
      redis.call('HSET', hash, 'swept_token', token)
      table.insert(marked, hash)
    end
  end
end
return marked

-- name: sweep_unmark
-- The re-publish failed: let the next sweep try this expired generation again.
-- KEYS: lease hash, running index. ARGV: injected_now, token
local state, swept, expires_at = unpack(redis.call(
  'HMGET', KEYS[1], 'state', 'swept_token', 'expires_at'))
if swept ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], 'swept_token')
if state == 'running' then redis.call('ZADD', KEYS[2], tonumber(expires_at), KEYS[1]) end
return 1

-- name: purge_old
-- Delete one done/dead hash last updated before now - ARGV[2] (its token counter stays).
local t = now(ARGV[1])
local state, updated_at = unpack(redis.call('HMGET', KEYS[1], 'state', 'updated_at'))
if (state == 'done' or state == 'dead') and tonumber(updated_at) < t - tonumber(ARGV[2]) then
  return redis.call('DEL', KEYS[1])
end
return 0

-- name: purge
-- Delete the hash unless a live lease holds it; the token counter (KEYS[2]) stays.
-- KEYS[3]: the running index.
local t = now(ARGV[1])
local state, expires_at = unpack(redis.call('HMGET', KEYS[1], 'state', 'expires_at'))
if not state or (state == 'running' and tonumber(expires_at) > t) then
  return 0
end
redis.call('ZREM', KEYS[3], KEYS[1])
return redis.call('DEL', KEYS[1])

-- name: effect_insert
-- KEYS[1]: the receipt hash, KEYS[2]: the lease hash. ARGV: injected_now, fingerprint,
-- lease_key, lease_token, lease_owner ('' for none). -1: the lease is not current.
local t = now(ARGV[1])
if ARGV[3] ~= '' and not lease_current(KEYS[2], ARGV[5], ARGV[4], t) then return -1 end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'fingerprint', ARGV[2], 'state', 'in_flight', 'lease_key', ARGV[3],
           'lease_token', ARGV[4], 'lease_owner', ARGV[5], 'started_at', fmt(t),
           'attempts', 1, 'version', 1, 'updated_at', fmt(t))
return 1

-- name: effect_update
-- ARGV: injected_now, version, state, result_json ('' for none). Only if version matches.
local t = now(ARGV[1])
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'updated_at', fmt(t))
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[4])
else redis.call('HDEL', KEYS[1], 'result') end
redis.call('HINCRBY', KEYS[1], 'version', 1)
return 1

-- name: effect_restart
-- KEYS: receipt hash, lease hash. ARGV: injected_now, version, lease_key, lease_token,
-- lease_owner. Only if version matches; -1: the lease is not current.
local t = now(ARGV[1])
if ARGV[3] ~= '' and not lease_current(KEYS[2], ARGV[5], ARGV[4], t) then return -1 end
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'in_flight', 'lease_key', ARGV[3], 'lease_token', ARGV[4],
           'lease_owner', ARGV[5], 'started_at', fmt(t), 'updated_at', fmt(t))
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HINCRBY', KEYS[1], 'version', 1)
return 1

-- name: effect_delete
-- ARGV: injected_now, version. Only if version matches.
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[2] then return 0 end
return redis.call('DEL', KEYS[1])

-- name: now
local t = now(ARGV[1])
return fmt(t)
