-- A finished key whose owner neither confirmed nor renewed its settle phase before the
-- deadline is gone: this delivery completes it (same token; the owner becomes the completer).
-- KEYS: lease hash, running index. ARGV: injected_now, owner, ttl, nonce.
local t = now(ARGV[1])
local settling, expires_at, previous_owner, state = unpack(redis.call(
  'HMGET', KEYS[1], 'settling', 'expires_at', 'owner', 'state'))
if settling ~= '1' or tonumber(expires_at) > t then return false end
local deadline = fmt(t + tonumber(ARGV[3]))
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'expires_at', deadline, 'updated_at', fmt(t),
           'nonce', ARGV[4])
redis.call('HDEL', KEYS[1], 'swept_by')
watch(KEYS[2], KEYS[1], tonumber(deadline))
index_lease(KEYS[1], state, state, fmt(t))
local token, fence, attempts, takeovers = unpack(redis.call(
  'HMGET', KEYS[1], 'token', 'fence', 'attempts', 'takeovers'))
record(KEYS[2], KEYS[1], t, 'completed', ARGV[2], token, fence, 'its owner '
       .. (previous_owner or '?') .. ' left the ' .. (state or '?')
       .. ' key unsettled: completed by this delivery')
return {token, deadline, fence or '0', attempts or '0', takeovers or '0'}
