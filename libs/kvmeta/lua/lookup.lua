-- ARGV: a prompt's NodeIDs, first block first. Returns engine, blocks, device_blocks triples: for
-- each live holder of the first block, how many leading blocks it holds (and how many of those are
-- in its device tier). Stops at the first block no remaining holder has.
local holders, blocks, device = nil, {}, {}
for i = 1, #ARGV do
  local fields = redis.call('HGETALL', P .. 'node:' .. ARGV[i])
  local here = {}
  for j = 1, #fields, 2 do
    here[fields[j]] = fields[j + 1]
  end
  if holders == nil then
    holders = {}
    for engine, _ in pairs(here) do
      if is_live(engine) then
        holders[engine], blocks[engine], device[engine] = true, 0, 0
      end
    end
  end
  local any = false
  for engine, _ in pairs(holders) do
    local entry = here[engine]
    if entry then
      any = true
      blocks[engine] = i
      if cjson.decode(entry).tier == 'device' then
        device[engine] = device[engine] + 1
      end
    else
      holders[engine] = nil
    end
  end
  if not any then
    break
  end
end
local out = {}
for engine, n in pairs(blocks) do
  table.insert(out, engine)
  table.insert(out, n)
  table.insert(out, device[engine])
end
return out
