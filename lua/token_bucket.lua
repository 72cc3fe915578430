-- tollgate token bucket: refill, take and persist one bucket atomically.
--
-- KEYS[1]  bucket hash, e.g. rl:{tenant}:route, fields:
--            tokens  fractional token count (string)
--            ts      time of the last update, ms since the Unix epoch by
--                    Redis's clock, with microsecond fraction (string)
-- ARGV[1]  capacity: bucket size in tokens (number >= 1)
-- ARGV[2]  refill rate in tokens per second (number > 0)
-- ARGV[3]  cost: tokens this request takes (integer >= 1); a cost above the
--          capacity is clamped to the capacity, so such a request passes
--          only when the bucket is full
--
-- Returns {allowed, remaining, retry_after_ms}, all integers:
--   allowed         1 if the tokens were taken, 0 if not
--   remaining       tokens left after this call, floored
--   retry_after_ms  0 when allowed; otherwise the ms until enough tokens
--                   exist, rounded up
--
-- Now always comes from redis.call('TIME'), never from the gateway: gateway
-- clocks drift. Redis 7 replicates scripts by their effects, so reading TIME
-- before a write is safe. The key expires after twice the time to refill an
-- empty bucket; an idle bucket therefore vanishes and comes back full.

local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cost = math.min(tonumber(ARGV[3]), capacity)

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

if tokens < cost then
  -- Nothing changes on a rejection: the refilled value follows from the
  -- stored pair, so the bucket is not written.
  local retry = math.ceil((cost - tokens) * 1000 / rate)
  return {0, math.floor(tokens), math.max(1, retry)}
end

tokens = tokens - cost
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'ts', string.format('%.3f', now))
redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil(2 * capacity * 1000 / rate)))
return {1, math.floor(tokens), 0}
