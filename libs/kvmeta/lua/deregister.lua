-- ARGV: id. Returns 1 if the worker was known.
local id = ARGV[1]
if not is_live(id) and not redis.call('ZSCORE', P .. 'workers', id) then
  return 0
end
purge_worker(id)
publish_leave(id, 'deregistered', now_ms())
return 1
