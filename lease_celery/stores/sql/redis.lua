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
-- The attention index (KEYS: the "running" sorted set) holds every hash the sweeper may have
-- to act on, scored by when to look at it next; terminal rows and rows without task info
-- leave it, so a sweep reads only what is due.
local function watch(index, hash, at)
  if redis.call('HEXISTS', hash, 'task') == 1 then redis.call('ZADD', index, at, hash)
  else redis.call('ZREM', index, hash) end
end
-- The terminal index (a sorted set of settled done/dead hashes by when they ended) is what
-- retention prunes, oldest first, without reading the live rows.
local function terminal_index(index)
  return string.sub(index, 1, -8) .. 'terminal'  -- "<prefix>running" -> "<prefix>terminal"
end
-- Rewrite a hash whose task info was just deleted: Redis never turns a hash back into its
-- compact encoding (listpack) once a long value (the task info) made it a hashtable, and a
-- settled row would keep more than twice the memory it needs for as long as it is kept.
local function compact(hash)
  local fields = redis.call('HGETALL', hash)
  redis.call('DEL', hash)
  if #fields > 0 then redis.call('HSET', hash, unpack(fields)) end
end
-- A settled done row needs its task info no more, but keeps the task id (field task_id, short
-- enough for the compact encoding): a duplicate under another task id is answered, one under
-- the same id dropped (lease_celery.answers).
local function drop_task(hash)
  local task = redis.call('HGET', hash, 'task')
  redis.call('HDEL', hash, 'task')
  if task then
    local ok, info = pcall(cjson.decode, task)
    local options = ok and type(info) == 'table' and info.options
    if type(options) == 'table' and type(options.task_id) == 'string' then
      redis.call('HSET', hash, 'task_id', options.task_id)
    end
  end
end
-- The history list of a lease hash ("<prefix>lease:<key>" -> "<prefix>history:<key>"), from
-- the running index's name ("<prefix>running"): it goes when the hash goes.
local function history_key(index, hash)
  local prefix = string.sub(index, 1, -8)
  return prefix .. 'history:' .. string.sub(hash, #prefix + 7)
end
-- The store writes each key's transitions into its history in the script that makes them:
-- atomic with the transition, no round trip of its own. (Events that are no transition of the
-- row come from lease_celery.history, through history_append.) The entry is the JSON that
-- RedisStore reads back; times keep their microseconds (cjson would round them to 14 digits).
local function json_text(s)
  if s == nil or s == false then return 'null' end
  return cjson.encode(tostring(s))
end
local function record(index, hash, t, event, owner, token, fence, detail)
  local prefix = string.sub(index, 1, -8)
  local entry = '{"key":' .. json_text(string.sub(hash, #prefix + 7)) .. ',"at":' .. fmt(t)
    .. ',"event":' .. json_text(event) .. ',"owner":' .. json_text(owner)
    .. ',"token":' .. (tonumber(token) and tostring(token) or 'null')
    .. ',"fence":' .. (tonumber(fence) and tostring(fence) or 'null')
    .. ',"detail":' .. json_text(detail) .. '}'
  -- Trimmed only once over their caps (the list across keys in steps of a tenth): a trim
  -- per entry was two more commands on every claim and finish.
  local own = history_key(index, hash)
  if redis.call('RPUSH', own, entry) > __HISTORY_PER_KEY__ then
    redis.call('LTRIM', own, -__HISTORY_PER_KEY__, -1)
  end
  if redis.call('LPUSH', prefix .. 'history', entry) > __HISTORY_RECENT__ * 1.1 then
    redis.call('LTRIM', prefix .. 'history', 0, __HISTORY_RECENT__ - 1)
  end
end
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
local state, expires_at, not_before, previous_owner, previous_token = unpack(redis.call(
  'HMGET', KEYS[1], 'state', 'expires_at', 'not_before', 'owner', 'token'))
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
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
local takeovers = redis.call('HINCRBY', KEYS[1], 'takeovers', takeover and 1 or 0)
redis.call('HDEL', KEYS[1], 'result', 'not_before', 'settling', 'swept_by')
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'task', ARGV[4])
else redis.call('HDEL', KEYS[1], 'task') end  -- never a previous delivery's
redis.call('HDEL', KEYS[1], 'task_id')
watch(KEYS[4], KEYS[1], tonumber(deadline))
redis.call('ZREM', terminal_index(KEYS[4]), KEYS[1])
if takeover then
  record(KEYS[4], KEYS[1], t, 'taken_over', ARGV[2], token, fence, 'the lease of '
         .. (previous_owner or '?') .. ' (token ' .. (previous_token or '?') .. ') had lapsed')
else
  record(KEYS[4], KEYS[1], t, 'claimed', ARGV[2], token, fence, nil)
end
return {tostring(token), deadline, tostring(fence), tostring(attempts), tostring(takeovers),
        redis.call('HGET', KEYS[1], 'cancel') or ''}

-- name: renew
-- A running lease, or a finished one whose owner is still settling it.
-- KEYS[1]: the running index, then one lease hash per lease; ARGV: injected_now, ttl, then
-- (owner, token) per lease.
local t = now(ARGV[1])
local out = {}
for i = 2, #KEYS do
  local key, n = KEYS[i], i - 1
  local state, owner, token, expires_at = unpack(redis.call(
    'HMGET', key, 'state', 'owner', 'token', 'expires_at'))
  local settling = redis.call('HGET', key, 'settling')
  if (state == 'running' or settling == '1') and owner == ARGV[1 + 2 * n]
      and token == ARGV[2 + 2 * n] and tonumber(expires_at) > t then
    local deadline = fmt(t + tonumber(ARGV[2]))
    redis.call('HSET', key, 'expires_at', deadline, 'updated_at', fmt(t))
    watch(KEYS[1], key, tonumber(deadline))
    out[n] = {deadline, redis.call('HGET', key, 'cancel') or ''}  -- an operator's cancel
  else
    out[n] = {'', ''}
  end
end
return out

-- name: fenced_write
-- finish (done), release (ready) and kill (dead), fenced on the current lease.
-- ARGV: injected_now, owner, token, new_state, result_json, reason, delay ('' for none),
-- settle_within ('' for settled at once: done/dead only).
local t = now(ARGV[1])
local state, owner, token, expires_at, fence = unpack(redis.call(
  'HMGET', KEYS[1], 'state', 'owner', 'token', 'expires_at', 'fence'))
if not (state == 'running' and owner == ARGV[2] and token == ARGV[3]
        and tonumber(expires_at) > t) then
  return 0
end
local delay = tonumber(ARGV[7] ~= '' and ARGV[7] or '0')
if ARGV[4] == 'done' then
  record(KEYS[2], KEYS[1], t, 'finished', owner, token, fence, nil)
elseif ARGV[4] == 'dead' then
  record(KEYS[2], KEYS[1], t, 'dead', owner, token, fence, ARGV[6])
elseif delay > 0 then
  record(KEYS[2], KEYS[1], t, 'retry', owner, token, fence, (ARGV[6] ~= '' and ARGV[6]
         or 'released') .. '; claimable again in ' .. string.format('%.2f', delay) .. 's')
else
  record(KEYS[2], KEYS[1], t, 'released', owner, token, fence, ARGV[6] ~= '' and ARGV[6] or nil)
end
redis.call('HSET', KEYS[1], 'state', ARGV[4], 'expires_at', fmt(t), 'updated_at', fmt(t))
redis.call('HDEL', KEYS[1], 'swept_by')
if ARGV[4] == 'done' then redis.call('HDEL', KEYS[1], 'checkpoint', 'cancel') end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'reason', ARGV[6])
else redis.call('HDEL', KEYS[1], 'reason') end
if ARGV[4] == 'ready' then
  local claimable = t
  if ARGV[7] ~= '' and tonumber(ARGV[7]) > 0 then
    claimable = t + tonumber(ARGV[7])
    redis.call('HSET', KEYS[1], 'not_before', fmt(claimable))
  end
  watch(KEYS[2], KEYS[1], claimable)
elseif ARGV[8] ~= '' then  -- done/dead, settling until the owner confirms or the deadline
  local deadline = fmt(t + tonumber(ARGV[8]))
  redis.call('HSET', KEYS[1], 'settling', '1', 'expires_at', deadline)
  watch(KEYS[2], KEYS[1], tonumber(deadline))
else
  if ARGV[4] == 'done' then
    drop_task(KEYS[1])
    compact(KEYS[1])
  end
  redis.call('ZREM', KEYS[2], KEYS[1])
  redis.call('ZADD', terminal_index(KEYS[2]), t, KEYS[1])
end
return 1

-- name: settle_many
-- The owners confirm that Celery stored the outcomes. KEYS[1]: the running index, then one
-- lease hash per lease; ARGV: injected_now, then (owner, token) per lease. A row this owner
-- already settled answers 1 too (a re-sent call).
local t = now(ARGV[1])
local out = {}
for i = 2, #KEYS do
  local key, n = KEYS[i], i - 1
  local state, owner, token, settling = unpack(redis.call(
    'HMGET', key, 'state', 'owner', 'token', 'settling'))
  local ours = owner == ARGV[2 * n] and token == ARGV[1 + 2 * n]
  if ours and settling == '1' then
    redis.call('HDEL', key, 'settling')
    redis.call('HSET', key, 'updated_at', fmt(t))
    if state == 'done' then
      drop_task(key)
      compact(key)
    end
    redis.call('ZREM', KEYS[1], key)
    redis.call('ZADD', terminal_index(KEYS[1]), t, key)
    out[n] = 1
  elseif ours and (state == 'done' or state == 'dead') then
    out[n] = 1
  else
    out[n] = 0
  end
end
return out

-- name: claim_settlement
-- A finished key whose owner neither confirmed nor renewed its settle phase before the
-- deadline is gone: this delivery completes it (same token; the owner becomes the completer).
-- KEYS: lease hash, running index. ARGV: injected_now, owner, ttl, nonce.
local t = now(ARGV[1])
local settling, expires_at, previous_owner, state = unpack(redis.call(
  'HMGET', KEYS[1], 'settling', 'expires_at', 'owner', 'state'))
if settling ~= '1' or tonumber(expires_at) > t then return false end
local deadline = fmt(t + tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'expires_at', deadline, 'updated_at', fmt(t),
           'nonce', ARGV[4])
redis.call('HDEL', KEYS[1], 'swept_by')
watch(KEYS[2], KEYS[1], tonumber(deadline))
local token, fence, attempts, takeovers = unpack(redis.call(
  'HMGET', KEYS[1], 'token', 'fence', 'attempts', 'takeovers'))
record(KEYS[2], KEYS[1], t, 'completed', ARGV[2], token, fence, 'its owner '
       .. (previous_owner or '?') .. ' left the ' .. (state or '?')
       .. ' key unsettled: completed by this delivery')
return {token, deadline, fence or '0', attempts or '0', takeovers or '0'}

-- name: force_release
-- An operator's override: running -> ready whoever holds it. KEYS: lease hash, running index.
-- ARGV: injected_now, reason
local t = now(ARGV[1])
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return 0 end
local owner, token, fence = unpack(redis.call('HMGET', KEYS[1], 'owner', 'token', 'fence'))
record(KEYS[2], KEYS[1], t, 'released', owner, token, fence, ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'ready', 'expires_at', fmt(t), 'updated_at', fmt(t),
           'reason', ARGV[2])
redis.call('HDEL', KEYS[1], 'not_before', 'swept_by')
watch(KEYS[2], KEYS[1], t)
return 1

-- name: requeue
-- dead -> ready with a fresh budget of attempts. KEYS: lease hash, running index.
-- ARGV: injected_now, reason
local t = now(ARGV[1])
if redis.call('HGET', KEYS[1], 'state') ~= 'dead' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'ready', 'attempts', 0, 'takeovers', 0,
           'updated_at', fmt(t), 'reason', ARGV[2])
redis.call('HDEL', KEYS[1], 'not_before', 'settling', 'swept_by', 'cancel')
watch(KEYS[2], KEYS[1], t)
redis.call('ZREM', terminal_index(KEYS[2]), KEYS[1])
return 1

-- name: history_append
-- One batch of history entries (lease_celery.history). KEYS[1]: the list across keys. ARGV:
-- injected_now (unused), per-key cap, cap across keys, then (lease key, entry JSON) per entry.
local own_cap, all_cap = tonumber(ARGV[2]), tonumber(ARGV[3])
local head = string.sub(KEYS[1], 1, -8) .. 'history:'  -- "<prefix>history" -> its per-key lists
for i = 4, #ARGV, 2 do
  local own = head .. ARGV[i]
  redis.call('RPUSH', own, ARGV[i + 1])
  redis.call('LTRIM', own, -own_cap, -1)
  redis.call('LPUSH', KEYS[1], ARGV[i + 1])
end
redis.call('LTRIM', KEYS[1], 0, all_cap - 1)
return 1

-- name: checkpoint
-- Fenced like finish: only the current holder's progress is written. KEYS: lease hash.
-- ARGV: injected_now, owner, token, checkpoint JSON.
if not lease_current(KEYS[1], ARGV[2], ARGV[3], now(ARGV[1])) then return 0 end
redis.call('HSET', KEYS[1], 'checkpoint', ARGV[4])
return 1

-- name: cancel
-- A live holder is asked to stop (its next renewal returns the reason); a key nobody holds
-- (no hash, ready, an expired lease) goes dead at once, keeping its token. Done and dead keys
-- are left alone. KEYS: lease hash, running index, token counter. ARGV: injected_now, reason.
local t = now(ARGV[1])
local state, expires_at = unpack(redis.call('HMGET', KEYS[1], 'state', 'expires_at'))
if state == 'running' and tonumber(expires_at) > t then
  redis.call('HSET', KEYS[1], 'cancel', ARGV[2])
  return 1
end
if state and state ~= 'ready' and state ~= 'running' then return 0 end
if not state then
  redis.call('HSET', KEYS[1], 'token', redis.call('GET', KEYS[3]) or '0', 'attempts', 0,
             'takeovers', 0, 'fence', 0)
end
redis.call('HSET', KEYS[1], 'state', 'dead', 'reason', ARGV[2], 'cancel', ARGV[2],
           'expires_at', fmt(t), 'updated_at', fmt(t))
local owner, token, fence = unpack(redis.call('HMGET', KEYS[1], 'owner', 'token', 'fence'))
record(KEYS[2], KEYS[1], t, 'dead', owner, token, fence, ARGV[2])
redis.call('HDEL', KEYS[1], 'not_before', 'settling', 'swept_by')
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('ZADD', terminal_index(KEYS[2]), t, KEYS[1])
return 1

-- name: sweep
-- Mark and return the hashes the sweeper may act on, read from the attention index (at most
-- ARGV[2]): a running lease or a settle phase past its deadline (its owner is gone), or a ready
-- row nobody claimed ARGV[3] (grace) seconds after it became claimable (its message was lost).
-- A marked row is looked at again a grace period later, so a sweeper that dies between this
-- mark and its re-publish leaves a mark that expires. Rows not due yet are re-scored to when
-- they will be, and terminal rows leave the index. KEYS[1]: the index. ARGV[4]: this call.
local t = now(ARGV[1])
local grace = tonumber(ARGV[3])
local marked = {}
for _, hash in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', t, 'LIMIT', 0,
                                 tonumber(ARGV[2]))) do
  local state, expires_at, settling, task, not_before, updated_at = unpack(redis.call(
    'HMGET', hash, 'state', 'expires_at', 'settling', 'task', 'not_before', 'updated_at'))
  local due_at = nil  -- when the row is due; nil: never (leaves the index)
  if task and (state == 'running' or settling == '1') then
    due_at = tonumber(expires_at)
  elseif task and state == 'ready' then
    due_at = tonumber(not_before or updated_at) + grace
  end
  if not due_at then
    redis.call('ZREM', KEYS[1], hash)
  elseif due_at > t then
    redis.call('ZADD', KEYS[1], due_at, hash)
  else
    redis.call('ZADD', KEYS[1], t + grace, hash)
    redis.call('HSET', hash, 'swept_by', ARGV[4])
    table.insert(marked, hash)
  end
end
return marked

-- name: sweep_unmark
-- The re-publish failed: let the next sweep try this row again.
-- KEYS: lease hash, running index. ARGV: injected_now, token
local token, swept = unpack(redis.call('HMGET', KEYS[1], 'token', 'swept_by'))
if token ~= ARGV[2] or not swept then return 0 end
redis.call('HDEL', KEYS[1], 'swept_by')
redis.call('ZADD', KEYS[2], 0, KEYS[1])
return 1

-- name: purge_old
-- Delete one settled done/dead hash last updated before now - ARGV[2] (its token counter
-- stays). KEYS: lease hash, running index.
local t = now(ARGV[1])
local state, updated_at, settling = unpack(redis.call(
  'HMGET', KEYS[1], 'state', 'updated_at', 'settling'))
if (state == 'done' or state == 'dead') and settling ~= '1'
    and tonumber(updated_at) < t - tonumber(ARGV[2]) then
  redis.call('ZREM', terminal_index(KEYS[2]), KEYS[1])
  redis.call('DEL', history_key(KEYS[2], KEYS[1]))
  return redis.call('DEL', KEYS[1])
end
return 0

-- name: prune
-- Retention: delete the oldest settled done/dead hashes ended before now - ARGV[2], at most
-- ARGV[3], read from the terminal index (their token counters stay). KEYS[1]: the running
-- index (the terminal index is named after it).
local t = now(ARGV[1])
local index = terminal_index(KEYS[1])
local cutoff = t - tonumber(ARGV[2])
local deleted = 0
for _, hash in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', '(' .. cutoff, 'LIMIT', 0,
                                 tonumber(ARGV[3]))) do
  redis.call('ZREM', index, hash)
  local state, updated_at, settling = unpack(redis.call(
    'HMGET', hash, 'state', 'updated_at', 'settling'))
  if (state == 'done' or state == 'dead') and settling ~= '1'
      and tonumber(updated_at) < cutoff then
    redis.call('DEL', history_key(KEYS[1], hash))
    deleted = deleted + redis.call('DEL', hash)
  end
end
return deleted

-- name: purge
-- Delete the hash unless a live lease holds it; the token counter (KEYS[2]) stays.
-- KEYS[3]: the running index.
local t = now(ARGV[1])
local state, expires_at = unpack(redis.call('HMGET', KEYS[1], 'state', 'expires_at'))
if not state or (state == 'running' and tonumber(expires_at) > t) then
  return 0
end
redis.call('ZREM', KEYS[3], KEYS[1])
redis.call('ZREM', terminal_index(KEYS[3]), KEYS[1])
redis.call('DEL', history_key(KEYS[3], KEYS[1]))
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
