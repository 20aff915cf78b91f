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
redis.call('HDEL', KEYS[1], 'not_before', 'settling', 'swept_by', 'eta')
redis.call('ZREM', KEYS[2], KEYS[1])
index_lease(KEYS[1], state, 'dead', fmt(t))
return 1
