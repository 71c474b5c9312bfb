-- ARGV: mode ('one' | 'expired' | 'all'), request id or engine ('' for every engine), limit.
-- Returns now, then per record: request id, engine, layers, token_count, tier, deadline_ms.
local mode, subject, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
local rids
if mode == 'one' then
  rids = {subject}
elseif subject ~= '' then
  rids = redis.call('SMEMBERS', P .. 'leases:' .. subject)
elseif mode == 'expired' then
  rids = redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', now, 'LIMIT', 0, limit)
else
  rids = redis.call('ZRANGE', P .. 'leases', 0, limit - 1)
end
local out = {now}
local n = 0
for _, rid in ipairs(rids) do
  local f = redis.call('HMGET', P .. 'blocks:' .. rid, 'engine', 'layers', 'token_count', 'tier', 'deadline_ms')
  if f[1] and (mode ~= 'expired' or tonumber(f[5]) <= now) and n < limit then
    n = n + 1
    table.insert(out, rid)
    for _, v in ipairs(f) do
      table.insert(out, v)
    end
  end
end
return out
