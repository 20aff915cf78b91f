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
index_lease(KEYS[1], 'running', 'ready', fmt(t))
return 1
