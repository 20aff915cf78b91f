-- KEYS: lease hash, token counter, store-wide fence counter, running index (a sorted set of
-- running lease hashes by deadline, so a sweep reads only what expired). ARGV: injected_now,
-- owner, ttl
-- ARGV[4]: task JSON ('' for none); ARGV[5]: this claim call's nonce.
local t = now(ARGV[1])
local state, expires_at, not_before, previous_owner, previous_token = unpack(redis.call(
  'HMGET', KEYS[1], 'state', 'expires_at', 'not_before', 'owner', 'token'))
local takeover = state == 'running' and tonumber(expires_at) <= t
local ready = state == 'ready' and (not not_before or tonumber(not_before) <= t)
if state and not ready and not takeover then
  return false
end
local token = next_counter(KEYS[2])
local fence = next_counter(KEYS[3])  -- the store-wide fence
local deadline = fmt(t + tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], 'state', 'running', 'owner', ARGV[2], 'token', int(token),
           'expires_at', deadline, 'updated_at', fmt(t), 'fence', int(fence), 'nonce', ARGV[5])
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
local takeovers = redis.call('HINCRBY', KEYS[1], 'takeovers', takeover and 1 or 0)
redis.call('HDEL', KEYS[1], 'result', 'not_before', 'settling', 'swept_by', 'eta')
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'task', ARGV[4])
else redis.call('HDEL', KEYS[1], 'task') end  -- never a previous delivery's
redis.call('HDEL', KEYS[1], 'task_id')
watch(KEYS[4], KEYS[1], tonumber(deadline))
redis.call('ZREM', terminal_index(KEYS[4]), KEYS[1])
if takeover then
  record(KEYS[4], KEYS[1], t, 'taken_over', ARGV[2], token, fence, 'the lease of '
         .. (previous_owner or '?') .. ' (token ' .. (previous_token or '?') .. ') had lapsed')
else
  record(KEYS[4], KEYS[1], t, 'claimed', ARGV[2], token, fence, nil)
end
return {int(token), deadline, int(fence), tostring(attempts), tostring(takeovers),
        redis.call('HGET', KEYS[1], 'cancel') or ''}
