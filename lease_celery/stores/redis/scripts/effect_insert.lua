-- KEYS[1]: the receipt hash, KEYS[2]: the lease hash. ARGV: injected_now, fingerprint,
-- lease_key, lease_token, lease_owner ('' for none). -1: the lease is not current.
local t = now(ARGV[1])
if ARGV[3] ~= '' and not lease_current(KEYS[2], ARGV[5], ARGV[4], t) then return -1 end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'fingerprint', ARGV[2], 'state', 'in_flight', 'lease_key', ARGV[3],
           'lease_token', ARGV[4], 'lease_owner', ARGV[5], 'started_at', fmt(t),
           'attempts', 1, 'version', 1, 'updated_at', fmt(t))
index_effect(KEYS[1], nil, 'in_flight', fmt(t))
return 1
