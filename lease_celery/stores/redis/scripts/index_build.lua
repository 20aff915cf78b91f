-- Build the state indexes of a prefix that the version before wrote (it kept none): one batch
-- of the SCAN that RedisStore._build_indexes runs over the prefix, resumable (the cursor is
-- kept on the epoch record) and idempotent.
-- KEYS[1]: the build's lock; then ARGV[5] lease hashes, then receipt hashes (a SCAN page).
-- ARGV: injected_now, the builder's id, the lock's ttl (ms), the SCAN cursor after this page
-- ('' : none, the lock only), how many of KEYS are lease hashes, '1': let go of the lock after.
-- Reply: 0 someone else builds (nothing written), 1 a batch done, 2 the prefix is indexed.
--
-- Why no write is lost while workers go on: every script of this version keeps the indexes
-- itself, from the first call on, whatever the build's progress (index_lease moves a hash
-- from the index of its old state to that of its new one, and needs no entry to be there).
-- A batch reads each of its hashes and writes its entries in the same atomic script, so of
-- a batch and a transition of the same hash, whichever runs last leaves the entries of the
-- hash as it now is; a hash deleted before its batch leaves no entry, one deleted after it
-- clears its own. A hash created after the SCAN passed its place was created by a script that
-- indexed it. SCAN returns every key that exists from the first page to the last at least
-- once, so when the cursor comes back to 0 every hash has been indexed by its batch or by its
-- own last write: then, and only then, the epoch record says 'indexed' and the reads use the
-- indexes. (A worker still on the version before writes without them: upgrade every worker
-- first.)
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[2] then return 0 end
if redis.call('HGET', EPOCH_KEY, 'indexed') == '1' then
  if holder then redis.call('DEL', KEYS[1]) end
  return 2
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3]))
local leases = tonumber(ARGV[5])
-- The fields of a hash (nothing: the name is gone, or is no hash: passed over, never an error
-- that would stop every build to come).
local function fields(name, ...)
  local ok, values = pcall(redis.call, 'HMGET', name, ...)
  if not ok then return nil end
  return unpack(values)
end
-- Each hash into the index of its state. No other index can hold it: only this version's
-- scripts write entries, and each moves them with the hash's state.
for i = 2, 1 + leases do
  local hash = KEYS[i]
  local state, updated_at, expires_at = fields(hash, 'state', 'updated_at', 'expires_at')
  if state then
    redis.call('ZADD', state_index(state), updated_at or '0', hash)
    if state == 'running' then redis.call('ZADD', EXPIRY_INDEX, expires_at or '0', hash) end
  end
end
for i = 2 + leases, #KEYS do
  local state, updated_at = fields(KEYS[i], 'state', 'updated_at')
  if state then redis.call('ZADD', effect_index(state), updated_at or '0', KEYS[i]) end
end
if ARGV[4] == '0' then  -- the SCAN is complete
  redis.call('HSET', EPOCH_KEY, 'indexed', '1')
  redis.call('HDEL', EPOCH_KEY, 'index_cursor')
  redis.call('UNLINK', PREFIX .. 'terminal')  -- the version before's; nothing reads it now
  redis.call('DEL', KEYS[1])
  return 2
end
if ARGV[4] ~= '' then redis.call('HSET', EPOCH_KEY, 'index_cursor', ARGV[4]) end
if ARGV[6] == '1' then redis.call('DEL', KEYS[1]) end
return 1
