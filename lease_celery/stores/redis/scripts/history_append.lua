-- One batch of history entries (lease_celery.history). KEYS[1]: the list across keys. ARGV:
-- injected_now (unused), per-key cap, cap across keys, then (lease key, entry JSON) per entry.
local own_cap, all_cap = tonumber(ARGV[2]), tonumber(ARGV[3])
local head = string.sub(KEYS[1], 1, -8) .. 'history:'  -- "<prefix>history" -> its per-key lists
for i = 4, #ARGV, 2 do
  local own = head .. ARGV[i]
  redis.call('RPUSH', own, ARGV[i + 1])
  redis.call('LTRIM', own, -own_cap, -1)
  redis.call('LPUSH', KEYS[1], ARGV[i + 1])
end
redis.call('LTRIM', KEYS[1], 0, all_cap - 1)
return 1
