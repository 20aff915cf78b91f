-- dead -> ready with a fresh budget of attempts. KEYS: lease hash, running index.
-- ARGV: injected_now, reason
local t = now(ARGV[1])
if redis.call('HGET', KEYS[1], 'state') ~= 'dead' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'ready', 'attempts', 0, 'takeovers', 0,
           'updated_at', fmt(t), 'reason', ARGV[2])
redis.call('HDEL', KEYS[1], 'not_before', 'settling', 'swept_by', 'cancel', 'eta')
watch(KEYS[2], KEYS[1], t)
index_lease(KEYS[1], 'dead', 'ready', fmt(t))
return 1
