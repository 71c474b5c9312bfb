-- ARGV: engine, then nodes. Returns how many entries were removed.
local engine = ARGV[1]
local held = P .. 'held:' .. engine
local removed = 0
for i = 2, #ARGV do
  removed = removed + redis.call('HDEL', P .. 'node:' .. ARGV[i], engine)
  redis.call('SREM', held, ARGV[i])
end
return removed
