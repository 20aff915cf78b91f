-- Delete the hash unless a live lease holds it; the token counter (KEYS[2]) stays.
-- KEYS[3]: the running index.
local t = now(ARGV[1])
local state, expires_at = unpack(redis.call('HMGET', KEYS[1], 'state', 'expires_at'))
if not state or (state == 'running' and tonumber(expires_at) > t) then
  return 0
end
redis.call('ZREM', KEYS[3], KEYS[1])
unindex_lease(KEYS[1], state)
redis.call('DEL', history_key(KEYS[3], KEYS[1]))
return redis.call('DEL', KEYS[1])
