-- A running lease, or a finished one whose owner is still settling it.
-- KEYS[1]: the running index, then one lease hash per lease; ARGV: injected_now, ttl, then
-- (owner, token) per lease.
local t = now(ARGV[1])
local out = {}
for i = 2, #KEYS do
  local key, n = KEYS[i], i - 1
  local state, owner, token, expires_at = unpack(redis.call(
    'HMGET', key, 'state', 'owner', 'token', 'expires_at'))
  local settling = redis.call('HGET', key, 'settling')
  if (state == 'running' or settling == '1') and owner == ARGV[1 + 2 * n]
      and token == ARGV[2 + 2 * n] and tonumber(expires_at) > t then
    local deadline = fmt(t + tonumber(ARGV[2]))
    redis.call('HSET', key, 'expires_at', deadline, 'updated_at', fmt(t))
    watch(KEYS[1], key, tonumber(deadline))
    index_lease(key, state, state, fmt(t), deadline)
    out[n] = {deadline, redis.call('HGET', key, 'cancel') or ''}  -- an operator's cancel
  else
    out[n] = {'', ''}
  end
end
return out
