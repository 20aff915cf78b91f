-- Retention: delete the oldest settled done/dead hashes last updated before now - ARGV[2], at
-- most ARGV[3], read oldest first from the done and dead indexes (their token counters stay).
-- KEYS[1]: the running index. A row still settling is passed over (it stays in its index,
-- which find() reads), and the next round reads past it, a few rounds at most: rows stuck
-- settling shorten a batch but never stall retention.
local t = now(ARGV[1])
local cutoff = t - tonumber(ARGV[2])
local bound = '(' .. string.format('%.17g', cutoff)
local limit = tonumber(ARGV[3])
local deleted = 0
local passed = {done = 0, dead = 0}
local function oldest(listed)
  return redis.call('ZRANGEBYSCORE', state_index(listed), '-inf', bound, 'WITHSCORES',
                    'LIMIT', passed[listed], limit - deleted)
end
for _ = 1, 4 do
  local done, dead = oldest('done'), oldest('dead')
  if #done == 0 and #dead == 0 then break end
  local i, j = 1, 1
  -- Both lists are oldest first: merged, the batch is the oldest across both.
  while deleted < limit and (i <= #done or j <= #dead) do
    local hash, listed
    if j > #dead or (i <= #done and tonumber(done[i + 1]) <= tonumber(dead[j + 1])) then
      hash, listed, i = done[i], 'done', i + 2
    else
      hash, listed, j = dead[j], 'dead', j + 2
    end
    local state, updated_at, settling = unpack(redis.call(
      'HMGET', hash, 'state', 'updated_at', 'settling'))
    if (state == 'done' or state == 'dead') and settling ~= '1'
        and tonumber(updated_at) < cutoff then
      unindex_lease(hash, state)
      redis.call('DEL', history_key(KEYS[1], hash))
      deleted = deleted + redis.call('DEL', hash)
    elseif state ~= listed then  -- not this index's any more (gone, or moved by hand)
      redis.call('ZREM', state_index(listed), hash)
    else
      passed[listed] = passed[listed] + 1
    end
  end
  if deleted >= limit then break end
end
return deleted
