-- ARGV: id, info (JSON), load (JSON), ttl_ms. A registration is a (re)start: whatever kvmeta held
-- for this id belongs to an earlier life of the worker, so it goes, with a leave event.
local id, info, load, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local key = P .. 'worker:' .. id
local now = now_ms()
local alive = is_live(id)
if alive or redis.call('ZSCORE', P .. 'workers', id) then
  purge_worker(id)
  publish_leave(id, alive and 'reregistered' or 'expired', now)
end
redis.call('HSET', key, 'info', info, 'load', load, 'ttl_ms', ttl, 'registered_ms', now, 'heartbeat_ms', now)
redis.call('PEXPIRE', key, ttl)
redis.call('ZADD', P .. 'workers', now + ttl, id)
redis.call('PUBLISH', P .. 'events',
  '{"kind":"join","worker_id":' .. cjson.encode(id) .. ',"at_ms":' .. now .. ',"worker":' .. info .. '}')
return now
