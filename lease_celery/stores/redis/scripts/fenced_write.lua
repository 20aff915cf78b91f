-- finish (done), release (ready) and kill (dead), fenced on the current lease (write_fenced).
-- KEYS: lease hash, attention index. ARGV: injected_now, owner, token, new_state,
-- result_json, reason, delay ('' for none), settle_within ('' for settled at once), task
-- ('' keeps the row's), given_back ('1': the claim's attempt is taken back; release only).
return write_fenced(KEYS[1], KEYS[2], now(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], ARGV[5],
                    ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10])
