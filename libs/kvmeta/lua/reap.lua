-- ARGV: limit. Announces and purges workers whose TTL ran out. Several kvmeta replicas may run it
-- at once: the script is atomic, so each expiry is announced once.
local now = now_ms()
local ids = redis.call('ZRANGEBYSCORE', P .. 'workers', '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, id in ipairs(ids) do
  purge_worker(id)
  publish_leave(id, 'expired', now)
end
return #ids
