-- A task is about to be published (lease_record_at_publish): write its key's row as ready, with
-- the message's task info, unless the key has a row. The sweeper re-publishes the row if nobody
-- claims it a grace period after ARGV[3] (the message's countdown) has passed: a message the
-- broker lost is not lost for good. KEYS: lease hash, token counter, running index.
-- ARGV: injected_now, task JSON, countdown.
local t = now(ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local eta = t + tonumber(ARGV[3])
-- The token shown is the key's last one (0 for a new key): the claim draws the next.
redis.call('HSET', KEYS[1], 'state', 'ready', 'token', int(tonumber(redis.call('GET', KEYS[2]) or '0')),
           'attempts', 0, 'takeovers', 0, 'fence', 0, 'updated_at', fmt(t), 'eta', fmt(eta),
           'task', ARGV[2])
watch(KEYS[3], KEYS[1], eta)
index_lease(KEYS[1], nil, 'ready', fmt(t))
return 1
