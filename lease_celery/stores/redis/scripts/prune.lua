-- Retention: delete the oldest settled done/dead hashes ended before now - ARGV[2], at most
-- ARGV[3], read from the terminal index (their token counters stay). KEYS[1]: the running
-- index (the terminal index is named after it).
local t = now(ARGV[1])
local index = terminal_index(KEYS[1])
local cutoff = t - tonumber(ARGV[2])
local deleted = 0
for _, hash in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', '(' .. cutoff, 'LIMIT', 0,
                                 tonumber(ARGV[3]))) do
  redis.call('ZREM', index, hash)
  local state, updated_at, settling = unpack(redis.call(
    'HMGET', hash, 'state', 'updated_at', 'settling'))
  if (state == 'done' or state == 'dead') and settling ~= '1'
      and tonumber(updated_at) < cutoff then
    redis.call('DEL', history_key(KEYS[1], hash))
    deleted = deleted + redis.call('DEL', hash)
  end
end
return deleted
