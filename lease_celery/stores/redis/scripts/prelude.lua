-- Redis scripts (Lua, run atomically by the server). KEYS[1] is the lease hash, KEYS[2] the
-- key's token counter, which is kept apart from the hash so that deleting (purging) a lease
-- never lets its token restart. The clock is the server's TIME, read inside the script, unless
-- the store was opened with an injected clock (ARGV[1] non-empty). Times are epoch seconds,
-- written with microsecond precision ('%.6f'); numbers go back to Python as strings, because
-- Redis truncates Lua numbers to integers in replies.
--
-- This prelude (the clock and the helpers every script shares) is put in front of each
-- script; __HISTORY_PER_KEY__ and __HISTORY_RECENT__ are filled in by the store.

local function now(injected)
  if injected ~= '' then return tonumber(injected) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.6f', x) end
-- Counters as text: tostring() would write 1.764694308e+15 (Lua's '%.14g') for a token past
-- an epoch floor.
local function int(x) return string.format('%.0f', tonumber(x)) end

-- The store's epoch (lease_celery.stores.redis.epoch). The store puts two arguments in front
-- of every script's own, taken off here so that ARGV[1] stays each script's injected_now: the
-- epoch record's name, and the epoch id this store object saw ('' only for the scripts that
-- open or reset the epoch, which judge the record themselves). A record that is gone, marked
-- lost, or replaced other than by an operator's reset means the server lost acknowledged
-- writes: the record is marked lost (so that every process refuses, not only this one) and
-- nothing is written. A record replaced by a reset is answered with its id, for the store to
-- take up and send again.
local EPOCH_KEY = table.remove(ARGV, 1)
local EPOCH_SEEN = table.remove(ARGV, 1)
-- The store's key prefix ("<prefix>epoch" -> "<prefix>"): the indexes are named after it.
local PREFIX = string.sub(EPOCH_KEY, 1, -6)
local EPOCH_FLOOR = 0
local function lost_reply(why)
  return redis.error_reply('LEASE_EPOCH_LOST ' .. why)
end
local function mark_lost(why)
  local t = redis.call('TIME')
  redis.call('HSET', EPOCH_KEY, 'state', 'lost', 'lost_why', why, 'lost_at',
             fmt(tonumber(t[1]) + tonumber(t[2]) / 1000000))
  return lost_reply(why)
end
if EPOCH_SEEN ~= '' then
  local id, state, floor, reset, why = unpack(redis.call(
    'HMGET', EPOCH_KEY, 'id', 'state', 'floor', 'reset', 'lost_why'))
  if state == 'lost' then return lost_reply(why or 'marked lost') end
  if not id then
    return mark_lost('the epoch record ' .. EPOCH_SEEN .. ' is gone')
  end
  if id ~= EPOCH_SEEN then
    if reset ~= '1' then
      return mark_lost('the epoch record ' .. EPOCH_SEEN .. ' was replaced by ' .. id
                       .. ', created on an empty store')
    end
    return redis.error_reply('LEASE_EPOCH_CHANGED ' .. id)
  end
  EPOCH_FLOOR = tonumber(floor)
end
-- The next value of a token or fence counter: one more than the last, and above the epoch's
-- floor, so that a counter that restarted (its key lost) never hands out a number an outside
-- resource has already seen.
local function next_counter(name)
  local n = redis.call('INCR', name)
  if n <= EPOCH_FLOOR then
    n = EPOCH_FLOOR + 1
    redis.call('SET', name, int(n))
  end
  return n
end
-- The attention index (KEYS: the "running" sorted set) holds every hash the sweeper may have
-- to act on, scored by when to look at it next; terminal rows and rows without task info
-- leave it, so a sweep reads only what is due.
local function watch(index, hash, at)
  if redis.call('HEXISTS', hash, 'task') == 1 then redis.call('ZADD', index, at, hash)
  else redis.call('ZREM', index, hash) end
end
-- The state indexes, which operator reads use instead of a SCAN (RedisStore.find, stats,
-- effect_find): a sorted set of lease hashes per state ("<prefix>index:lease:<state>") scored
-- by updated_at (the order find() lists in), and the running hashes by expires_at
-- ("<prefix>index:lease:expiry", what stats() counts as expired). A hash is in the index of
-- its state and in no other. Each script that changes a hash's state or updated_at, or a
-- running lease's expires_at, moves its entries itself (index_lease), atomically with the
-- change. The done and dead indexes are also what retention prunes, oldest first, without
-- reading the live rows (they replace the terminal index of the version before, which held
-- the settled done/dead hashes by when they ended: the same score, updated_at).
local LEASE_STATES = {'ready', 'running', 'done', 'dead'}
local EXPIRY_INDEX = PREFIX .. 'index:lease:expiry'
local function state_index(state) return PREFIX .. 'index:lease:' .. state end
-- old: the hash's state before the change (nil: it had no hash); new: after it. updated_at
-- and expires_at as written on the hash ('%.6f' text: the score is the same double).
local function index_lease(hash, old, new, updated_at, expires_at)
  if old and old ~= new then redis.call('ZREM', state_index(old), hash) end
  redis.call('ZADD', state_index(new), updated_at, hash)
  if new == 'running' then redis.call('ZADD', EXPIRY_INDEX, expires_at, hash)
  elseif old == 'running' then redis.call('ZREM', EXPIRY_INDEX, hash) end
end
-- The hash (in state) is deleted.
local function unindex_lease(hash, state)
  if not state then return end
  redis.call('ZREM', state_index(state), hash)
  if state == 'running' then redis.call('ZREM', EXPIRY_INDEX, hash) end
end
-- Effect receipts, the same way: "<prefix>index:effect:<state>" by updated_at (new nil: the
-- receipt is deleted).
local function effect_index(state) return PREFIX .. 'index:effect:' .. state end
local function index_effect(hash, old, new, updated_at)
  if old and old ~= new then redis.call('ZREM', effect_index(old), hash) end
  if new then redis.call('ZADD', effect_index(new), updated_at, hash) end
end
-- A settled done row needs its task info no more, but keeps the task id and the delivery's
-- context (fields task_id and context, short enough for the compact encoding): a delivery of
-- the same id in the same context is dropped, any other answered (lease_celery.answers). The
-- hash is written anew without the task info: Redis never turns a hash back into its compact
-- encoding (listpack) once a long value (the task info) made it a hashtable, and a settled
-- row would keep more than twice the memory it needs for as long as it is kept. (One read and
-- one write, whatever the fields.)
local function drop_task(hash)
  local fields = redis.call('HGETALL', hash)
  local task_id, context = nil, nil
  for i = 1, #fields, 2 do
    if fields[i] == 'task' then
      local ok, info = pcall(cjson.decode, fields[i + 1])
      local options = ok and type(info) == 'table' and info.options
      if type(options) == 'table' and type(options.task_id) == 'string' then
        task_id = options.task_id
        if type(info.context) == 'string' then context = info.context end
      end
    end
  end
  local kept = {}
  for i = 1, #fields, 2 do
    local name = fields[i]
    if name ~= 'task' and not (task_id and (name == 'task_id' or name == 'context')) then
      kept[#kept + 1] = name
      kept[#kept + 1] = fields[i + 1]
    end
  end
  if task_id then
    kept[#kept + 1] = 'task_id'
    kept[#kept + 1] = task_id
  end
  if context then
    kept[#kept + 1] = 'context'
    kept[#kept + 1] = context
  end
  redis.call('DEL', hash)
  if #kept > 0 then redis.call('HSET', hash, unpack(kept)) end
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
    .. ',"token":' .. (tonumber(token) and int(token) or 'null')
    .. ',"fence":' .. (tonumber(fence) and int(fence) or 'null')
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
-- finish (done), release (ready) and kill (dead), fenced on the current lease
-- (fenced_write.lua, finish_and_claim.lua): the lease hash and the attention index;
-- new_state, result_json, reason, delay ('' for none), settle_within ('' for settled
-- at once: done/dead only). Returns 1, or 0 when the lease is not current.
local function write_fenced(hash, index, t, by_owner, by_token, new_state, result,
                            reason, delay_text, settle_within, task, given_back)
  local state, owner, token, expires_at, fence = unpack(redis.call(
    'HMGET', hash, 'state', 'owner', 'token', 'expires_at', 'fence'))
  if not (state == 'running' and owner == by_owner and token == by_token
          and tonumber(expires_at) > t) then
    return 0
  end
  local delay = tonumber(delay_text ~= '' and delay_text or '0')
  if new_state == 'done' then
    record(index, hash, t, 'finished', owner, token, fence, nil)
  elseif new_state == 'dead' then
    record(index, hash, t, 'dead', owner, token, fence, reason)
  elseif delay > 0 then
    record(index, hash, t, 'retry', owner, token, fence, (reason ~= '' and reason
           or 'released') .. '; claimable again in ' .. string.format('%.2f', delay) .. 's')
  else
    record(index, hash, t, 'released', owner, token, fence, reason ~= '' and reason or nil)
  end
  -- One write and one delete of the hash's fields (each command costs the server more than a
  -- field): the new state, result and reason; ready: when it is claimable again; done/dead with
  -- settle_within: settling until the owner confirms or the deadline.
  local set = {'state', new_state, 'updated_at', fmt(t)}
  local gone = {'swept_by'}
  if new_state == 'done' then gone[#gone + 1] = 'checkpoint'; gone[#gone + 1] = 'cancel' end
  if result ~= '' then set[#set + 1] = 'result'; set[#set + 1] = result
  elseif new_state == 'dead' then gone[#gone + 1] = 'result' end  -- never an earlier failure's
  if reason ~= '' then set[#set + 1] = 'reason'; set[#set + 1] = reason
  else gone[#gone + 1] = 'reason' end
  local expires_at, watch_at = fmt(t), nil
  if new_state == 'ready' then
    -- A release: the message that claims the key next (a retry's, a replacement's), and the
    -- attempt taken back when the claim ended in the task's own control flow.
    if task ~= '' then set[#set + 1] = 'task'; set[#set + 1] = task end
    if given_back == '1' then redis.call('HINCRBY', hash, 'attempts', -1) end
    watch_at = t
    if delay > 0 then
      watch_at = t + delay
      set[#set + 1] = 'not_before'; set[#set + 1] = fmt(watch_at)
    end
  elseif settle_within ~= '' then
    expires_at = fmt(t + tonumber(settle_within))
    watch_at = tonumber(expires_at)
    set[#set + 1] = 'settling'; set[#set + 1] = '1'
  end
  set[#set + 1] = 'expires_at'; set[#set + 1] = expires_at
  redis.call('HSET', hash, unpack(set))
  redis.call('HDEL', hash, unpack(gone))
  index_lease(hash, 'running', new_state, fmt(t))
  if watch_at then
    watch(index, hash, watch_at)
  else  -- settled at once
    if new_state == 'done' then drop_task(hash) end
    redis.call('ZREM', index, hash)
  end
  return 1
end
-- The claim (claim.lua, claim_limited.lua): take a lease hash that is free (no row, ready and
-- past its backoff, or running with an expired lease: a takeover). grp and slot: a limited
-- claim's group and slot token (nil: none). Returns the claim's reply, or false.
local function claim_lease(lease_hash, counter, fence_key, index, owner, ttl, task, nonce, t,
                           grp, slot)
  local state, expires_at, not_before, previous_owner, previous_token, attempts, takeovers,
        cancel = unpack(redis.call('HMGET', lease_hash, 'state', 'expires_at', 'not_before',
                                   'owner', 'token', 'attempts', 'takeovers', 'cancel'))
  local takeover = state == 'running' and tonumber(expires_at) <= t
  local ready = state == 'ready' and (not not_before or tonumber(not_before) <= t)
  if state and not ready and not takeover then
    return false
  end
  local token = next_counter(counter)
  local fence = next_counter(fence_key)  -- the store-wide fence
  local deadline = fmt(t + tonumber(ttl))
  attempts = int((tonumber(attempts) or 0) + 1)
  takeovers = int((tonumber(takeovers) or 0) + (takeover and 1 or 0))
  -- One write and one delete: each command a script sends costs the server more than a field.
  local set = {'state', 'running', 'owner', owner, 'token', int(token), 'expires_at', deadline,
               'updated_at', fmt(t), 'fence', int(fence), 'nonce', nonce,
               'attempts', attempts, 'takeovers', takeovers}
  local gone = {'result', 'not_before', 'settling', 'swept_by', 'eta', 'task_id', 'context'}
  if task ~= '' then set[#set + 1] = 'task'; set[#set + 1] = task
  else gone[#gone + 1] = 'task' end  -- never a previous delivery's
  if grp then
    set[#set + 1] = 'grp'; set[#set + 1] = grp
    set[#set + 1] = 'slot'; set[#set + 1] = int(slot)
  else gone[#gone + 1] = 'grp'; gone[#gone + 1] = 'slot' end
  redis.call('HSET', lease_hash, unpack(set))
  redis.call('HDEL', lease_hash, unpack(gone))
  -- The attention index (watch(), knowing whether the hash has task info now).
  if task ~= '' then redis.call('ZADD', index, deadline, lease_hash)
  else redis.call('ZREM', index, lease_hash) end
  index_lease(lease_hash, state, 'running', fmt(t), deadline)
  if takeover then
    record(index, lease_hash, t, 'taken_over', owner, token, fence, 'the lease of '
           .. (previous_owner or '?') .. ' (token ' .. (previous_token or '?') .. ') had lapsed')
  else
    record(index, lease_hash, t, 'claimed', owner, token, fence, nil)
  end
  return {int(token), deadline, int(fence), attempts, takeovers, cancel or ''}
end
-- Key-group limits (lease_celery.limits). A group's slots set holds the lease hashes granted
-- a slot; the running count is those still running in the group with an unexpired lease
-- (the others leave the set as they are met: a slot is freed with its lease, by any script).
local function group_running(slots, grp, t, except)
  local n = 0
  for _, member in ipairs(redis.call('SMEMBERS', slots)) do
    local state, expires_at, g = unpack(redis.call('HMGET', member, 'state', 'expires_at',
                                                   'grp'))
    if state == 'running' and g == grp and tonumber(expires_at) > t then
      if member ~= except then n = n + 1 end
    else
      redis.call('SREM', slots, member)
    end
  end
  return n
end
-- The limit or interval in force: an operator's (0: lifted), else the task's; nil for none.
local function in_force(group_hash, task_field, set_field)
  local task_value, set_value = unpack(redis.call('HMGET', group_hash, task_field, set_field))
  local value = tonumber(set_value ~= nil and set_value ~= false and set_value or task_value)
  if value == nil or value == 0 then return nil end
  return value
end
