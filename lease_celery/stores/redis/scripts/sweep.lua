-- Mark and return the hashes the sweeper may act on, read from the attention index (at most
-- ARGV[2]): a running lease or a settle phase past its deadline (its owner is gone), or a ready
-- row nobody claimed ARGV[3] (grace) seconds after it became claimable (its message was lost).
-- A marked row is looked at again a grace period later, so a sweeper that dies between this
-- mark and its re-publish leaves a mark that expires. Rows not due yet are re-scored to when
-- they will be, and terminal rows leave the index. KEYS[1]: the index. ARGV[4]: this call.
local t = now(ARGV[1])
local grace = tonumber(ARGV[3])
local marked = {}
for _, hash in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', t, 'LIMIT', 0,
                                 tonumber(ARGV[2]))) do
  local state, expires_at, settling, task, not_before, updated_at, eta = unpack(redis.call(
    'HMGET', hash, 'state', 'expires_at', 'settling', 'task', 'not_before', 'updated_at',
    'eta'))
  local due_at = nil  -- when the row is due; nil: never (leaves the index)
  if task and (state == 'running' or settling == '1') then
    due_at = tonumber(expires_at)
  elseif task and state == 'ready' then
    -- eta: a row written at publish becomes claimable when its message's countdown ends.
    due_at = tonumber(not_before or eta or updated_at) + grace
  end
  if not due_at then
    redis.call('ZREM', KEYS[1], hash)
  elseif due_at > t then
    redis.call('ZADD', KEYS[1], due_at, hash)
  else
    redis.call('ZADD', KEYS[1], t + grace, hash)
    redis.call('HSET', hash, 'swept_by', ARGV[4])
    table.insert(marked, hash)
  end
end
return marked
