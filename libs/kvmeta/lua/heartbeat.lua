-- ARGV: id, load (JSON, or '' to keep), ttl_ms (or '' to keep). Returns {now, ttl_ms}, or 0 for an
-- unknown worker, which must register again.
local id = ARGV[1]
local key = P .. 'worker:' .. id
if not is_live(id) then
  return 0
end
local now = now_ms()
if ARGV[2] ~= '' then
  redis.call('HSET', key, 'load', ARGV[2])
end
if ARGV[3] ~= '' then
  redis.call('HSET', key, 'ttl_ms', ARGV[3])
end
local ttl = tonumber(redis.call('HGET', key, 'ttl_ms'))
redis.call('HSET', key, 'heartbeat_ms', now)
redis.call('PEXPIRE', key, ttl)
redis.call('ZADD', P .. 'workers', now + ttl, id)
return {now, ttl}
