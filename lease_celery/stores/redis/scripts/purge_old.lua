-- Delete one settled done/dead hash last updated before now - ARGV[2] (its token counter
-- stays). KEYS: lease hash, running index.
local t = now(ARGV[1])
local state, updated_at, settling = unpack(redis.call(
  'HMGET', KEYS[1], 'state', 'updated_at', 'settling'))
if (state == 'done' or state == 'dead') and settling ~= '1'
    and tonumber(updated_at) < t - tonumber(ARGV[2]) then
  unindex_lease(KEYS[1], state)
  redis.call('DEL', history_key(KEYS[2], KEYS[1]))
  return redis.call('DEL', KEYS[1])
end
return 0
