-- Open the store: answer its epoch record, writing it if the store is new. KEYS[1]: the epoch
-- record; KEYS[2..]: the store's own index keys (fence counter, running and terminal indexes,
-- history), one of which exists as soon as anything was claimed, recorded or ended. ARGV:
-- injected_now, the id for a new epoch. The floor, the creation time in microseconds, is
-- above any counter that grew by one per claim before it: a store that lost everything and
-- is opened afresh still never hands out a token or fence number that was handed out before.
-- The reply's fourth value: '1' if the state indexes are complete (the record's 'indexed'
-- mark; a store the version before wrote has none until RedisStore builds them).
local t = now(ARGV[1])
local id, state, floor, created_at, why, indexed = unpack(redis.call(
  'HMGET', KEYS[1], 'id', 'state', 'floor', 'created_at', 'lost_why', 'indexed'))
if state == 'lost' then return lost_reply(why or 'marked lost') end
if id then return {id, floor, created_at, indexed or ''} end
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    return mark_lost('the store holds data (' .. KEYS[i] .. ') but no epoch record')
  end
end
floor = int(math.floor(t * 1000000))
-- An empty store has nothing to index: its indexes are complete from the start.
redis.call('HSET', KEYS[1], 'id', ARGV[2], 'floor', floor, 'created_at', fmt(t), 'indexed', '1')
return {ARGV[2], floor, fmt(t), '1'}
