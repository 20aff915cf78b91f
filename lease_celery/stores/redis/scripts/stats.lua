-- Store.stats from the state indexes, in one atomic read: per state its row count (ZCARD),
-- then the running leases whose deadline has passed (expires_at <= now, from the expiry
-- index). ARGV: injected_now. Reply: count per state in LEASE_STATES order, then expired.
local t = now(ARGV[1])
local out = {}
for _, state in ipairs(LEASE_STATES) do
  table.insert(out, redis.call('ZCARD', state_index(state)))
end
table.insert(out, redis.call('ZCOUNT', EXPIRY_INDEX, '-inf', fmt(t)))
return out
