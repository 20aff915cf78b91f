-- KEYS: receipt hash, lease hash. ARGV: injected_now, version, lease_key, lease_token,
-- lease_owner. Only if version matches; -1: the lease is not current.
local t = now(ARGV[1])
if ARGV[3] ~= '' and not lease_current(KEYS[2], ARGV[5], ARGV[4], t) then return -1 end
local version, state = unpack(redis.call('HMGET', KEYS[1], 'version', 'state'))
if version ~= ARGV[2] then return 0 end
index_effect(KEYS[1], state, 'in_flight', fmt(t))
redis.call('HSET', KEYS[1], 'state', 'in_flight', 'lease_key', ARGV[3], 'lease_token', ARGV[4],
           'lease_owner', ARGV[5], 'started_at', fmt(t), 'updated_at', fmt(t))
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HINCRBY', KEYS[1], 'version', 1)
return 1
