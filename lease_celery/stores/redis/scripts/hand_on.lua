-- Store.hand_on for one group: its first waiters for which a slot is free (all of them once
-- the limit is lifted), but those handed on less than a grace period ago; marked handed.
-- KEYS: group hash, slots set, waiters, their task info, arrival times, hand-on times.
-- ARGV: injected_now, group, grace, at most this many. Reply: key hash, task, since, ...
local t = now(ARGV[1])
local limit = in_force(KEYS[1], 'task_limit', 'set_limit')
local free = tonumber(ARGV[4])
if limit then free = math.min(free, limit - group_running(KEYS[2], ARGV[2], t, '')) end
local out = {}
if free <= 0 then return out end
for _, member in ipairs(redis.call('ZRANGE', KEYS[3], 0, free - 1)) do
  local handed = tonumber(redis.call('HGET', KEYS[6], member))
  if not handed or handed <= t - tonumber(ARGV[3]) then
    redis.call('HSET', KEYS[6], member, fmt(t))
    table.insert(out, member)
    table.insert(out, redis.call('HGET', KEYS[4], member) or '')
    table.insert(out, redis.call('HGET', KEYS[5], member) or fmt(t))
  end
end
return out
