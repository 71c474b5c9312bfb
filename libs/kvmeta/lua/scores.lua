-- ARGV: engine, then node, delta pairs. Returns how many entries were updated (unknown ones are skipped).
local engine = ARGV[1]
local updated = 0
for i = 2, #ARGV, 2 do
  local key = P .. 'node:' .. ARGV[i]
  local raw = redis.call('HGET', key, engine)
  if raw then
    local entry = cjson.decode(raw)
    entry.score = entry.score + tonumber(ARGV[i + 1])
    redis.call('HSET', key, engine, cjson.encode(entry))
    updated = updated + 1
  end
end
return updated
