-- Fenced like finish: only the current holder's progress is written. KEYS: lease hash.
-- ARGV: injected_now, owner, token, checkpoint JSON.
if not lease_current(KEYS[1], ARGV[2], ARGV[3], now(ARGV[1])) then return 0 end
redis.call('HSET', KEYS[1], 'checkpoint', ARGV[4])
return 1
