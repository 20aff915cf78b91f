-- The owners confirm that Celery stored the outcomes. KEYS[1]: the running index, then one
-- lease hash per lease; ARGV: injected_now, then (owner, token) per lease. A row this owner
-- already settled answers 1 too (a re-sent call).
local t = now(ARGV[1])
local out = {}
for i = 2, #KEYS do
  local key, n = KEYS[i], i - 1
  local state, owner, token, settling = unpack(redis.call(
    'HMGET', key, 'state', 'owner', 'token', 'settling'))
  local ours = owner == ARGV[2 * n] and token == ARGV[1 + 2 * n]
  if ours and settling == '1' then
    redis.call('HDEL', key, 'settling')
    redis.call('HSET', key, 'updated_at', fmt(t))
    if state == 'done' then
      drop_task(key)
    end
    redis.call('ZREM', KEYS[1], key)
    index_lease(key, state, state, fmt(t))
    out[n] = 1
  elseif ours and (state == 'done' or state == 'dead') then
    out[n] = 1
  else
    out[n] = 0
  end
end
return out
