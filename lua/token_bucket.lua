-- tollgate token bucket: refill, take and persist one bucket atomically.
--
-- KEYS[1]  bucket hash, e.g. rl:{tenant}:route, fields:
--            tokens  fractional token count (string)
--            ts      time of the last update, ms since the Unix epoch by
--                    Redis's clock, with microsecond fraction (string)
-- ARGV[1]  capacity: bucket size in tokens (number >= 1)
-- ARGV[2]  refill rate in tokens per second (number > 0)
-- ARGV[3]  want (optional, default 1): tokens to take (integer >= 1): one
--          request's cost, or a lease batch; clamped to the capacity, so a
--          request costing more than the bucket holds passes only when the
--          bucket is full
-- ARGV[4]  min (optional, default want): the fewest tokens worth a lease
-- ARGV[5]  need (optional, default min): the request's own cost; when
--          fewer than min but at least need tokens exist, exactly need are
--          taken, so a lease call never turns away a request that could pass
--
-- Returns {allowed, remaining, retry_after_ms, granted, block_ms}, all
-- integers:
--   allowed         1 when the request's tokens were taken, else 0
--   remaining       tokens left after this call, floored
--   retry_after_ms  ms until need tokens exist, rounded up: for a rejection
--                   at least 1; after a grant, 0 while need tokens remain
--   granted         tokens taken: min..want, or need, or 0
--   block_ms        the same as retry_after_ms for min: when another lease
--                   could be granted
--
-- Now always comes from redis.call('TIME'), never from the gateway: gateway
-- clocks drift. Redis 7 replicates scripts by their effects, so reading TIME
-- before a write is safe. The key expires after twice the time to refill an
-- empty bucket; an idle bucket therefore vanishes and comes back full.

local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local want = math.min(tonumber(ARGV[3] or 1), capacity)
local min = math.min(tonumber(ARGV[4] or want), want)
local need = math.min(tonumber(ARGV[5] or min), min)

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000

local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = capacity
  ts = now
end

local elapsed = math.max(0, now - ts)
tokens = math.min(capacity, tokens + elapsed * rate / 1000)

-- Milliseconds until n tokens exist, rounded up; 0 when they do.
local function wait(n)
  if tokens >= n then
    return 0
  end
  return math.ceil((n - tokens) * 1000 / rate)
end

if tokens < need then
  -- Nothing changes on a rejection: the refilled value follows from the
  -- stored pair, so the bucket is not written.
  return {0, math.floor(tokens), math.max(1, wait(need)), 0, math.max(1, wait(min))}
end

local granted = need
if tokens >= min then
  granted = math.min(want, math.floor(tokens))
end
tokens = tokens - granted
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'ts', string.format('%.3f', now))
redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil(2 * capacity * 1000 / rate)))
return {1, math.floor(tokens), wait(need), granted, wait(min)}
