-- ARGV: id, or nothing for all. Returns now, then per live worker: info, load, ttl_ms,
-- registered_ms, heartbeat_ms, deadline_ms.
local now = now_ms()
local ids
if ARGV[1] then
  local deadline = redis.call('ZSCORE', P .. 'workers', ARGV[1])
  ids = deadline and {ARGV[1], deadline} or {}
else
  ids = redis.call('ZRANGEBYSCORE', P .. 'workers', '(' .. now, '+inf', 'WITHSCORES')
end
local out = {now}
for i = 1, #ids, 2 do
  local f = redis.call('HMGET', P .. 'worker:' .. ids[i], 'info', 'load', 'ttl_ms', 'registered_ms', 'heartbeat_ms')
  if f[1] and tonumber(ids[i + 1]) > now then
    for _, v in ipairs(f) do
      table.insert(out, v)
    end
    table.insert(out, ids[i + 1])
  end
end
return out
