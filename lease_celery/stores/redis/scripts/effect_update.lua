-- ARGV: injected_now, version, state, result_json ('' for none). Only if version matches.
local t = now(ARGV[1])
local version, state = unpack(redis.call('HMGET', KEYS[1], 'version', 'state'))
if version ~= ARGV[2] then return 0 end
index_effect(KEYS[1], state, ARGV[3], fmt(t))
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'updated_at', fmt(t))
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[4])
else redis.call('HDEL', KEYS[1], 'result') end
redis.call('HINCRBY', KEYS[1], 'version', 1)
return 1
