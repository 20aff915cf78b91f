-- ARGV: injected_now, version. Only if version matches.
local version, state = unpack(redis.call('HMGET', KEYS[1], 'version', 'state'))
if version ~= ARGV[2] then return 0 end
index_effect(KEYS[1], state, nil)
return redis.call('DEL', KEYS[1])
