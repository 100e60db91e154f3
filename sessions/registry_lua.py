"""The registry's atomic steps, as Lua scripts that Redis runs one at a time (see registry.py).

Every state change that must not interleave with another (claim, release, register, heartbeat, restore,
reap, deregister, abandon, drain) is one script here; `Registry` registers each once per client. ARGV[1]
is always the key prefix (`vivant:`); pool/worker/session ids follow, as each script's comment says.
The key layout is in registry.py's docstring. Times are milliseconds from Redis' own clock (TIME).
"""

LUA_HELPERS = """
local pfx = ARGV[1]
local function pk(pool, what) return pfx .. 'pool:' .. pool .. ':' .. what end
local function hb(w) return pfx .. 'worker:' .. w .. ':hb' end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# ARGV: prefix, pool, session -> worker id | false
CLAIM = LUA_HELPERS + """
local pool, session = ARGV[2], ARGV[3]
local sw = pfx .. 'session_worker'
local existing = redis.call('HGET', sw, session)
if existing then
  local epool = redis.call('HGET', pfx .. 'worker_pool', existing)
  if epool and redis.call('HGET', pk(epool, 'busy'), existing) == session then
    if epool == pool then return existing end
    return redis.error_reply('CONFLICT session ' .. session .. ' is held by worker ' .. existing .. ' of pool ' .. epool)
  end
  redis.call('HDEL', sw, session)
end
local idle = redis.call('SMEMBERS', pk(pool, 'idle'))
table.sort(idle)
for _, w in ipairs(idle) do
  if redis.call('EXISTS', hb(w)) == 1 and redis.call('SISMEMBER', pk(pool, 'draining'), w) == 0
     and redis.call('HEXISTS', pk(pool, 'busy'), w) == 0 then
    redis.call('SREM', pk(pool, 'idle'), w)
    redis.call('HSET', pk(pool, 'busy'), w, session)
    redis.call('HSET', sw, session, w)
    return w
  end
end
return false
"""

# ARGV: prefix, pool, worker, session -> 1 released | 0 not held
RELEASE = LUA_HELPERS + """
local pool, w, session = ARGV[2], ARGV[3], ARGV[4]
if redis.call('HGET', pk(pool, 'busy'), w) ~= session then return 0 end
redis.call('HDEL', pk(pool, 'busy'), w)
if redis.call('HGET', pfx .. 'session_worker', session) == w then redis.call('HDEL', pfx .. 'session_worker', session) end
if redis.call('SISMEMBER', pk(pool, 'workers'), w) == 1 and redis.call('SISMEMBER', pk(pool, 'warm'), w) == 1
   and redis.call('SISMEMBER', pk(pool, 'draining'), w) == 0 and redis.call('EXISTS', hb(w)) == 1 then
  redis.call('SADD', pk(pool, 'idle'), w)
end
return 1
"""

# ARGV: prefix, pool, worker, info json, warm ('1'|'0'), ttl ms, session ('' = none)
# -> 1 ok (session kept if given) | 0 the given session is lost (reaped or held by another worker)
REGISTER = LUA_HELPERS + """
local pool, w, info, warm, ttl, session = ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7]
local oldpool = redis.call('HGET', pfx .. 'worker_pool', w)
if oldpool and oldpool ~= pool then
  for _, what in ipairs({'workers', 'warm', 'idle', 'draining'}) do redis.call('SREM', pk(oldpool, what), w) end
end
redis.call('SET', pfx .. 'worker:' .. w, info)
redis.call('HSET', pfx .. 'worker_pool', w, pool)
redis.call('SADD', pk(pool, 'workers'), w)
redis.call('SET', hb(w), '{}', 'PX', ttl)
redis.call('HSET', pfx .. 'worker_seen', w, now_ms())
if warm == '1' then redis.call('SADD', pk(pool, 'warm'), w) else redis.call('SREM', pk(pool, 'warm'), w) end
local result = 1
if session ~= '' then
  local holder = redis.call('HGET', pfx .. 'session_worker', session)
  local mine = redis.call('HGET', pk(pool, 'busy'), w)
  if redis.call('EXISTS', pfx .. 'session:' .. session .. ':lost') == 1 or (holder and holder ~= w)
     or (mine and mine ~= session) then
    result = 0
  else
    redis.call('HSET', pk(pool, 'busy'), w, session)
    redis.call('HSET', pfx .. 'session_worker', session, w)
  end
end
if redis.call('HEXISTS', pk(pool, 'busy'), w) == 1 then
  redis.call('SREM', pk(pool, 'idle'), w)
elseif warm == '1' and redis.call('SISMEMBER', pk(pool, 'draining'), w) == 0 then
  redis.call('SADD', pk(pool, 'idle'), w)
end
return result
"""

# ARGV: prefix, pool, worker, ttl ms, stats json -> 1 | 0 unknown worker (must re-register; also when
# only its lease is known, restored from a CR after Redis came back empty)
HEARTBEAT = LUA_HELPERS + """
local pool, w = ARGV[2], ARGV[3]
if redis.call('SISMEMBER', pk(pool, 'workers'), w) == 0 or redis.call('EXISTS', pfx .. 'worker:' .. w) == 0 then
  return 0
end
redis.call('SET', hb(w), ARGV[5], 'PX', tonumber(ARGV[4]))
redis.call('HSET', pfx .. 'worker_seen', w, now_ms())
return 1
"""

# ARGV: prefix, pool, worker, session -> 1 the worker holds the session's lease (now or already) | 0 not
# possible: the session is lost, held by another worker, or the worker holds another session.
# The worker joins the pool's workers (without a heartbeat), so the reaper fails the session if the
# worker never comes back within the grace.
RESTORE = LUA_HELPERS + """
local pool, w, session = ARGV[2], ARGV[3], ARGV[4]
local sw = pfx .. 'session_worker'
local holder = redis.call('HGET', sw, session)
if holder then return holder == w and 1 or 0 end
if redis.call('EXISTS', pfx .. 'session:' .. session .. ':lost') == 1 then return 0 end
local mine = redis.call('HGET', pk(pool, 'busy'), w)
if mine and mine ~= session then return 0 end
local oldpool = redis.call('HGET', pfx .. 'worker_pool', w)
if oldpool and oldpool ~= pool then return 0 end
redis.call('HSET', pk(pool, 'busy'), w, session)
redis.call('HSET', sw, session, w)
redis.call('SREM', pk(pool, 'idle'), w)
redis.call('SADD', pk(pool, 'workers'), w)
redis.call('HSET', pfx .. 'worker_pool', w, pool)
redis.call('HSETNX', pfx .. 'worker_seen', w, now_ms())
return 1
"""

# ARGV: prefix, pool, worker -> 1 | 0
SET_WARM = LUA_HELPERS + """
local pool, w = ARGV[2], ARGV[3]
if redis.call('SISMEMBER', pk(pool, 'workers'), w) == 0 then return 0 end
redis.call('SADD', pk(pool, 'warm'), w)
if redis.call('HEXISTS', pk(pool, 'busy'), w) == 0 and redis.call('SISMEMBER', pk(pool, 'draining'), w) == 0 then
  redis.call('SADD', pk(pool, 'idle'), w)
end
return 1
"""

# Remove one worker from every pool structure; tombstone its session. Used by reap and deregister.
DROP_WORKER_FN = """
local function drop(pool, w, why)
  for _, what in ipairs({'workers', 'warm', 'idle', 'draining'}) do redis.call('SREM', pk(pool, what), w) end
  redis.call('DEL', pfx .. 'worker:' .. w)
  redis.call('DEL', hb(w))
  redis.call('HDEL', pfx .. 'worker_seen', w)
  local s = redis.call('HGET', pk(pool, 'busy'), w)
  redis.call('HDEL', pk(pool, 'busy'), w)
  if s then
    if redis.call('HGET', pfx .. 'session_worker', s) == w then redis.call('HDEL', pfx .. 'session_worker', s) end
    redis.call('SET', pfx .. 'session:' .. s .. ':lost', why, 'EX', tonumber(ARGV[#ARGV]))
    return s
  end
  return ''
end
"""

# ARGV: prefix, pool, grace ms, settled ms (how long Redis has been reachable: its uptime, or since this
# client regained it), ttl s -> flat list [w1, s1, w2, s2, ...] ('' = no session)
REAP = LUA_HELPERS + DROP_WORKER_FN + """
local pool, grace, settled = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local out = {}
for _, w in ipairs(redis.call('SMEMBERS', pk(pool, 'workers'))) do
  local seen = tonumber(redis.call('HGET', pfx .. 'worker_seen', w) or '0')
  local silent = math.min(now - seen, settled)
  if redis.call('EXISTS', hb(w)) == 0 and silent > grace then
    local s = drop(pool, w, 'heartbeat of worker ' .. w .. ' expired')
    table.insert(out, w)
    table.insert(out, s)
  end
end
if #out > 0 then redis.call('HINCRBY', pk(pool, 'worker_failures'), 'lost', #out / 2) end
return out
"""

# ARGV: prefix, pool, worker, reason, failed ('1' | '0'), ttl s -> session id | ''. A failed worker still
# registered counts once in pool:P:worker_failures 'fault' (deregistering it again counts nothing).
DEREGISTER = LUA_HELPERS + DROP_WORKER_FN + """
local pool, w = ARGV[2], ARGV[3]
if ARGV[5] == '1' and redis.call('SISMEMBER', pk(pool, 'workers'), w) == 1 then
  redis.call('HINCRBY', pk(pool, 'worker_failures'), 'fault', 1)
end
return drop(pool, w, ARGV[4])
"""

# ARGV: prefix, pool, worker, session, reason, ttl s -> 1 | 0: give up a held session (worker restarted)
ABANDON = LUA_HELPERS + """
local pool, w, session = ARGV[2], ARGV[3], ARGV[4]
if redis.call('HGET', pk(pool, 'busy'), w) ~= session then return 0 end
redis.call('HDEL', pk(pool, 'busy'), w)
if redis.call('HGET', pfx .. 'session_worker', session) == w then redis.call('HDEL', pfx .. 'session_worker', session) end
redis.call('SET', pfx .. 'session:' .. session .. ':lost', ARGV[5], 'EX', tonumber(ARGV[6]))
if redis.call('SISMEMBER', pk(pool, 'warm'), w) == 1 and redis.call('SISMEMBER', pk(pool, 'draining'), w) == 0 then
  redis.call('SADD', pk(pool, 'idle'), w)
end
return 1
"""

# ARGV: prefix, pool -> {registered, loading, idle, busy, draining, dead}
COUNTS = LUA_HELPERS + """
local pool = ARGV[2]
local c = {0, 0, 0, 0, 0, 0}
for _, w in ipairs(redis.call('SMEMBERS', pk(pool, 'workers'))) do
  if redis.call('EXISTS', hb(w)) == 1 then
    c[1] = c[1] + 1
    if redis.call('SISMEMBER', pk(pool, 'warm'), w) == 0 then c[2] = c[2] + 1 end
    if redis.call('SISMEMBER', pk(pool, 'idle'), w) == 1 then c[3] = c[3] + 1 end
    if redis.call('HEXISTS', pk(pool, 'busy'), w) == 1 then c[4] = c[4] + 1 end
    if redis.call('SISMEMBER', pk(pool, 'draining'), w) == 1 then c[5] = c[5] + 1 end
  else
    c[6] = c[6] + 1
  end
end
return c
"""

# ARGV: prefix, pool, worker... -> number newly marked
DRAIN = LUA_HELPERS + """
local pool = ARGV[2]
local n = 0
for i = 3, #ARGV do
  local w = ARGV[i]
  if redis.call('SISMEMBER', pk(pool, 'workers'), w) == 1 then
    n = n + redis.call('SADD', pk(pool, 'draining'), w)
    redis.call('SREM', pk(pool, 'idle'), w)
  end
end
return n
"""
