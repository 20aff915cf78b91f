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
-- One write and one delete of the hash's fields (each command costs the server more than a
-- field): the new state, result and reason; ready: when it is claimable again; done/dead with
-- settle_within: settling until the owner confirms or the deadline.
local set = {'state', ARGV[4], 'updated_at', fmt(t)}
local gone = {'swept_by'}
if ARGV[4] == 'done' then gone[#gone + 1] = 'checkpoint'; gone[#gone + 1] = 'cancel' end
if ARGV[5] ~= '' then set[#set + 1] = 'result'; set[#set + 1] = ARGV[5] end
if ARGV[6] ~= '' then set[#set + 1] = 'reason'; set[#set + 1] = ARGV[6]
else gone[#gone + 1] = 'reason' end
local expires_at, watch_at = fmt(t), nil
if ARGV[4] == 'ready' then
  watch_at = t
  if delay > 0 then
    watch_at = t + delay
    set[#set + 1] = 'not_before'; set[#set + 1] = fmt(watch_at)
  end
elseif ARGV[8] ~= '' then
  expires_at = fmt(t + tonumber(ARGV[8]))
  watch_at = tonumber(expires_at)
  set[#set + 1] = 'settling'; set[#set + 1] = '1'
end
set[#set + 1] = 'expires_at'; set[#set + 1] = expires_at
redis.call('HSET', KEYS[1], unpack(set))
redis.call('HDEL', KEYS[1], unpack(gone))
index_lease(KEYS[1], 'running', ARGV[4], fmt(t))
if watch_at then
  watch(KEYS[2], KEYS[1], watch_at)
else  -- settled at once
  if ARGV[4] == 'done' then drop_task(KEYS[1]) end
  redis.call('ZREM', KEYS[2], KEYS[1])
end
return 1
