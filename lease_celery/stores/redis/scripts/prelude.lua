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
