-- ARGV: request id, engine, layers (JSON), token_count, tier, lease_ms. Returns the lease deadline,
-- or -1 when the engine is not a live worker.
local rid, engine = ARGV[1], ARGV[2]
if not is_live(engine) then
  return -1
end
local key = P .. 'blocks:' .. rid
local previous = redis.call('HGET', key, 'engine')
if previous and previous ~= engine then
  redis.call('SREM', P .. 'leases:' .. previous, rid)
end
local deadline = now_ms() + tonumber(ARGV[6])
redis.call('HSET', key, 'engine', engine, 'layers', ARGV[3], 'token_count', ARGV[4], 'tier', ARGV[5],
  'deadline_ms', deadline)
redis.call('ZADD', P .. 'leases', deadline, rid)
redis.call('SADD', P .. 'leases:' .. engine, rid)
return deadline
