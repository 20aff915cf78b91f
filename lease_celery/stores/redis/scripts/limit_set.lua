-- Store.set_limit: an operator's limit and rate for a group. KEYS: group hash, the set of
-- groups. ARGV: injected_now, then pairs of field and value: '\0' deletes the field (back
-- to the task's), anything else is written ('0' and '' lift the limit and the rate).
local t = now(ARGV[1])
redis.call('SADD', KEYS[2], ARGV[#ARGV])
for i = 2, #ARGV - 1, 2 do
  if ARGV[i + 1] == '\0' then redis.call('HDEL', KEYS[1], ARGV[i])
  else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
  if ARGV[i] == 'set_interval' then redis.call('HDEL', KEYS[1], 'tat') end
end
redis.call('HSET', KEYS[1], 'updated_at', fmt(t))
return 1
