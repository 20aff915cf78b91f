-- KEYS: lease hash, token counter, store-wide fence counter, running index (a sorted set of
-- running lease hashes by deadline, so a sweep reads only what expired). ARGV: injected_now,
-- owner, ttl
-- ARGV[4]: task JSON ('' for none); ARGV[5]: this claim call's nonce.
return claim_lease(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[4], ARGV[5],
                   now(ARGV[1]))
