-- An operator accepts the data loss: a new epoch replaces the record, lost or not. KEYS[1]:
-- the epoch record. ARGV: injected_now, the new id. Its floor is its creation time in
-- microseconds (and above the previous floor, should the clock have gone back), so tokens and
-- fence numbers continue above every number handed out before. Answers the new record and
-- what the previous one said.
local t = now(ARGV[1])
local old_id, old_floor, old_state, old_why, indexed, cursor = unpack(redis.call(
  'HMGET', KEYS[1], 'id', 'floor', 'state', 'lost_why', 'indexed', 'index_cursor'))
local floor = math.floor(t * 1000000)
if old_floor and tonumber(old_floor) >= floor then floor = tonumber(old_floor) + 1 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'id', ARGV[2], 'floor', int(floor), 'created_at', fmt(t),
           'reset', '1', 'replaces', old_id or '')
-- The state indexes describe the data beside them, which the reset keeps (a record that is
-- gone leaves no mark: the indexes are built again).
if indexed then redis.call('HSET', KEYS[1], 'indexed', indexed) end
if cursor then redis.call('HSET', KEYS[1], 'index_cursor', cursor) end
return {ARGV[2], int(floor), fmt(t), old_id or '', old_state or '', old_why or ''}
