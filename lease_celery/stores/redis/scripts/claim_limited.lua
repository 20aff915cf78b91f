-- The limited claim (Store.claim_limited): the key and a slot of its group, atomically. The
-- verdict is stores.base.group_verdict's rule.
-- KEYS: lease hash, token counter, fence counter, running index, group hash, slots set,
-- waiters (a sorted set of keys by arrival), the waiters' task info, their arrival times,
-- their hand-on times (hashes by key), the set of groups.
-- ARGV: injected_now, owner, ttl, task JSON ('' none), nonce, group, limit ('' none), rate
-- text ('' none), interval ('' none).
local t = now(ARGV[1])
local grp, task = ARGV[6], ARGV[4]
redis.call('SADD', KEYS[11], grp)
redis.call('HSETNX', KEYS[5], 'updated_at', fmt(t))
for field, value in pairs({task_limit = ARGV[7], task_rate = ARGV[8], task_interval = ARGV[9]}) do
  if value ~= '' then redis.call('HSET', KEYS[5], field, value)
  else redis.call('HDEL', KEYS[5], field) end
end
local function unpark()
  redis.call('ZREM', KEYS[7], KEYS[1])
  redis.call('HDEL', KEYS[8], KEYS[1])
  redis.call('HDEL', KEYS[9], KEYS[1])
  redis.call('HDEL', KEYS[10], KEYS[1])
end
local state, expires_at, not_before = unpack(redis.call(
  'HMGET', KEYS[1], 'state', 'expires_at', 'not_before'))
if state and not ((state == 'ready' and (not not_before or tonumber(not_before) <= t))
                  or (state == 'running' and tonumber(expires_at) <= t)) then
  unpark()
  return false  -- the key itself refuses
end
local limit = in_force(KEYS[5], 'task_limit', 'set_limit')
local interval = in_force(KEYS[5], 'task_interval', 'set_interval')
local running = group_running(KEYS[6], grp, t, KEYS[1])
-- Waiters are members by lease hash, so that a key is one waiter.
local place = redis.call('ZSCORE', KEYS[7], KEYS[1])
local ahead
if place then ahead = redis.call('ZCOUNT', KEYS[7], '-inf', '(' .. place)
else ahead = redis.call('ZCARD', KEYS[7]) end
local shown_limit = limit and int(limit) or ''
if limit and running + ahead >= limit then
  if task ~= '' and not place then
    local seq = redis.call('HINCRBY', KEYS[5], 'seq', 1)
    redis.call('ZADD', KEYS[7], seq, KEYS[1])
    redis.call('HSET', KEYS[8], KEYS[1], task)
    redis.call('HSET', KEYS[9], KEYS[1], fmt(t))
  elseif task ~= '' then  -- handed on and refused again: it keeps its place
    redis.call('HDEL', KEYS[10], KEYS[1])
  end
  return {'limit', tostring(redis.call('ZCARD', KEYS[7])), tostring(running), shown_limit, ''}
end
local tat = tonumber(redis.call('HGET', KEYS[5], 'tat'))
if interval and tat and tat > t then
  return {'rate', '0', tostring(running), shown_limit, fmt(tat)}
end
local slot = redis.call('HINCRBY', KEYS[5], 'slots', 1)
local reply = claim_lease(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], task, ARGV[5],
                          t, grp, slot)
redis.call('SADD', KEYS[6], KEYS[1])
redis.call('HSET', KEYS[5], 'updated_at', fmt(t))
if interval then redis.call('HSET', KEYS[5], 'tat', fmt(math.max(tat or t, t) + interval)) end
unpark()
return {'granted', tostring(slot), tostring(running), shown_limit, '', unpack(reply)}
