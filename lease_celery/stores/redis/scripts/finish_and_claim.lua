-- A finish (done, settled at once) carried by the next claim, one script: each judged by
-- its own rule (write_fenced, claim_lease) on one reading of the clock.
-- KEYS: the finished lease's hash, attention index; the claimed key's lease hash, token
-- counter, store-wide fence counter. ARGV: injected_now, owner, token, result_json (the
-- finish); owner, ttl, task JSON ('' for none), nonce (the claim).
-- Returns {1 or 0 (the finish), the claim's reply or {} (refused)}.
local t = now(ARGV[1])
local finished = write_fenced(KEYS[1], KEYS[2], t, ARGV[2], ARGV[3], 'done', ARGV[4], '', '',
                              '', '', '')
local claimed = claim_lease(KEYS[3], KEYS[4], KEYS[5], KEYS[2], ARGV[5], ARGV[6], ARGV[7],
                            ARGV[8], t)
return {finished, claimed or {}}
