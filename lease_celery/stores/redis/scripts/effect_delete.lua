-- ARGV: injected_now, version. Only if version matches.
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[2] then return 0 end
return redis.call('DEL', KEYS[1])
