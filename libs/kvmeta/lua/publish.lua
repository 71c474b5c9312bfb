-- ARGV: engine, then node, entry (JSON) pairs. Returns how many entries are new, or -1 when the
-- engine is not a live worker (entries of an unknown engine could never be cleaned up).
local engine = ARGV[1]
if not is_live(engine) then
  return -1
end
local held = P .. 'held:' .. engine
local added = 0
for i = 2, #ARGV, 2 do
  added = added + redis.call('HSET', P .. 'node:' .. ARGV[i], engine, ARGV[i + 1])
  redis.call('SADD', held, ARGV[i])
end
return added
