-- A group as Store.limits lists it. KEYS: group hash, slots set, waiters. ARGV: injected_now,
-- group. Reply: task_limit, task_rate, set_limit, set_rate, updated_at, running, waiting
-- (false for a field not set).
local t = now(ARGV[1])
local fields = redis.call('HMGET', KEYS[1], 'task_limit', 'task_rate', 'set_limit', 'set_rate',
                          'updated_at')
table.insert(fields, tostring(group_running(KEYS[2], ARGV[2], t, '')))
table.insert(fields, tostring(redis.call('ZCARD', KEYS[3])))
return fields
