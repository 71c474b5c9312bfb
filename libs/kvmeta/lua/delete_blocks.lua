-- ARGV: request id. Returns 1 if there was a record.
local rid = ARGV[1]
local key = P .. 'blocks:' .. rid
local engine = redis.call('HGET', key, 'engine')
if not engine then
  return 0
end
redis.call('DEL', key)
redis.call('ZREM', P .. 'leases', rid)
redis.call('SREM', P .. 'leases:' .. engine, rid)
return 1
