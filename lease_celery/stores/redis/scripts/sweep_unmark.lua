-- The re-publish failed: let the next sweep try this row again.
-- KEYS: lease hash, running index. ARGV: injected_now, token
local token, swept = unpack(redis.call('HMGET', KEYS[1], 'token', 'swept_by'))
if token ~= ARGV[2] or not swept then return 0 end
redis.call('HDEL', KEYS[1], 'swept_by')
redis.call('ZADD', KEYS[2], 0, KEYS[1])
return 1
