-- Prepended to every kvmeta script. KEYS[1] is the cluster's key prefix, `kvmesh:{cluster}:`: the
-- braces are a Redis Cluster hash tag, so all of one cluster's keys share a slot and each script
-- runs atomically over them.
--   worker:<id>   hash  info, load (JSON), ttl_ms, registered_ms, heartbeat_ms; PEXPIREs with the TTL
--   workers       zset  id -> deadline (ms); the reaper reads it to announce expiries
--   events        channel of join/leave events (JSON)
--   node:<node>   hash  engine -> {"tier","size","score"} (JSON): the cache table
--   held:<engine> set   NodeIDs the engine publishes, so its entries go when it does
--   blocks:<rid>  hash  engine, layers (JSON), token_count, tier, deadline_ms: the block map
--   leases        zset  rid -> lease deadline (ms)
--   leases:<eng>  set   request ids whose blocks live on the engine
local P = KEYS[1]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function is_live(id)
  return redis.call('EXISTS', P .. 'worker:' .. id) == 1
end

-- Forget all a worker held: cache-table entries, block leases, registry entry. Its blocks are gone
-- with it, and kvmeta must hold no entry for a block that no longer exists.
local function purge_worker(id)
  local held = P .. 'held:' .. id
  for _, node in ipairs(redis.call('SMEMBERS', held)) do
    redis.call('HDEL', P .. 'node:' .. node, id)
  end
  local leases = P .. 'leases:' .. id
  for _, rid in ipairs(redis.call('SMEMBERS', leases)) do
    redis.call('DEL', P .. 'blocks:' .. rid)
    redis.call('ZREM', P .. 'leases', rid)
  end
  redis.call('DEL', held, leases, P .. 'worker:' .. id)
  redis.call('ZREM', P .. 'workers', id)
end

local function publish_leave(id, reason, now)
  redis.call('PUBLISH', P .. 'events',
    cjson.encode({kind = 'leave', worker_id = id, reason = reason, at_ms = now}))
end

