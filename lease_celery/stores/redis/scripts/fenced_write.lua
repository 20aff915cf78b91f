-- finish (done), release (ready) and kill (dead), fenced on the current lease.
-- ARGV: injected_now, owner, token, new_state, result_json, reason, delay ('' for none),
-- settle_within ('' for settled at once: done/dead only).
local t = now(ARGV[1])
local state, owner, token, expires_at, fence = unpack(redis.call(
  'HMGET', KEYS[1], 'state', 'owner', 'token', 'expires_at', 'fence'))
if not (state == 'running' and owner == ARGV[2] and token == ARGV[3]
        and tonumber(expires_at) > t) then
  return 0
end
local delay = tonumber(ARGV[7] ~= '' and ARGV[7] or '0')
if ARGV[4] == 'done' then
  record(KEYS[2], KEYS[1], t, 'finished', owner, token, fence, nil)
elseif ARGV[4] == 'dead' then
  record(KEYS[2], KEYS[1], t, 'dead', owner, token, fence, ARGV[6])
elseif delay > 0 then
  record(KEYS[2], KEYS[1], t, 'retry', owner, token, fence, (ARGV[6] ~= '' and ARGV[6]
         or 'released') .. '; claimable again in ' .. string.format('%.2f', delay) .. 's')
else
  record(KEYS[2], KEYS[1], t, 'released', owner, token, fence, ARGV[6] ~= '' and ARGV[6] or nil)
end
redis.call('HSET', KEYS[1], 'state', ARGV[4], 'expires_at', fmt(t), 'updated_at', fmt(t))
redis.call('HDEL', KEYS[1], 'swept_by')
if ARGV[4] == 'done' then redis.call('HDEL', KEYS[1], 'checkpoint', 'cancel') end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'reason', ARGV[6])
else redis.call('HDEL', KEYS[1], 'reason') end
if ARGV[4] == 'ready' then
  local claimable = t
  if ARGV[7] ~= '' and tonumber(ARGV[7]) > 0 then
    claimable = t + tonumber(ARGV[7])
    redis.call('HSET', KEYS[1], 'not_before', fmt(claimable))
  end
  watch(KEYS[2], KEYS[1], claimable)
elseif ARGV[8] ~= '' then  -- done/dead, settling until the owner confirms or the deadline
  local deadline = fmt(t + tonumber(ARGV[8]))
  redis.call('HSET', KEYS[1], 'settling', '1', 'expires_at', deadline)
  watch(KEYS[2], KEYS[1], tonumber(deadline))
else
  if ARGV[4] == 'done' then
    drop_task(KEYS[1])
    compact(KEYS[1])
  end
  redis.call('ZREM', KEYS[2], KEYS[1])
  redis.call('ZADD', terminal_index(KEYS[2]), t, KEYS[1])
end
return 1
