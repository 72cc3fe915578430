-- tollgate token bucket, state format 2: refill, take and persist one or
-- more buckets atomically, with one reading of Redis's clock.
--
-- KEYS[i]        bucket i, e.g. rl2:{tenant}:route: a string holding one
--                number, the bucket's theoretical arrival time (TAT): the
--                time at which it is full again, in microseconds since the
--                Unix epoch by Redis's clock (possibly fractional). A
--                bucket holds capacity - (TAT - now) × rate tokens; a
--                missing key is a full bucket.
-- ARGV[3i-2]     capacity of bucket i: size in tokens (number >= 1)
-- ARGV[3i-1]     refill rate of bucket i in tokens per second (number > 0)
-- ARGV[3i]       the ask (optional, default 1): a plain ask is the
--                request's cost, tokens to take (integer >= 1); a lease
--                ask is "want:min:need": take up to want tokens (a lease
--                batch), at least min (the fewest worth a lease), or,
--                when fewer than min but at least need exist, exactly need
--                (the request's own cost), so a lease call never turns
--                away a request that could pass. Every count is clamped
--                to the capacity, so a request costing more than the
--                bucket holds passes only when the bucket is full. Three
--                arguments per key whatever the ask: every argument costs
--                Redis a Lua string per call.
--
-- Returns, per key in key order, three integers for a plain ask and five
-- for a lease ask:
--   allowed         1 when the request's tokens were taken, else 0
--   remaining       tokens left after this call, floored
--   retry_after_ms  ms until need tokens exist, rounded up: for a rejection
--                   at least 1; after a grant, 0 while need tokens remain
--   granted         (leases only) tokens taken: min..want, or need, or 0
--   block_ms        (leases only) the same as retry_after_ms for min: when
--                   another lease could be granted
-- For a plain ask those two say nothing new (granted is the cost when
-- allowed, else 0; block_ms is retry_after_ms), so they are not sent: a
-- reply's integers are most of what a caller spends parsing it.
--
-- Per key: one GET, and one SET ... PX when tokens are taken (a rejection
-- writes nothing). Now always comes
-- from redis.call('TIME'), never from the gateway: gateway clocks drift.
--
-- Redis pays for every Lua function call and every number turned into a
-- string, so the loop compares inline instead of calling math.min and
-- math.max, and converts a rule's capacity, rate and expiry once for a run
-- of keys under the same rule (ARGV strings are interned: comparing two is
-- comparing pointers).
-- Redis 7 replicates scripts by their effects, so reading TIME before a
-- write is safe. A written key expires after twice the time to refill an
-- empty bucket; an idle bucket therefore vanishes and comes back full. A
-- changed rule keeps a bucket's debt (time until full), not its count.

-- Milliseconds until n tokens exist in a bucket holding tokens and
-- refilling at rate per second, rounded up; 0 when they do.
local floor, ceil = math.floor, math.ceil
local function wait(n, tokens, rate)
  if tokens >= n then
    return 0
  end
  return ceil((n - tokens) * 1000 / rate)
end

local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local reply = {}
local n = 0
-- The rule of the previous key: its argument strings and their values.
local rule_capacity, rule_rate, capacity, rate, expire_ms

for i = 1, #KEYS do
  local at = i * 3
  if ARGV[at - 2] ~= rule_capacity or ARGV[at - 1] ~= rule_rate then
    rule_capacity, rule_rate = ARGV[at - 2], ARGV[at - 1]
    capacity, rate = tonumber(rule_capacity), tonumber(rule_rate)
    expire_ms = string.format('%d', ceil(2000 * capacity / rate))
  end
  local ask = ARGV[at] or '1'
  local want = tonumber(ask)
  local min, need, lease = want, want, false
  if not want then
    local w, m, k = string.match(ask, '^(%d+):(%d+):(%d+)$')
    if not k then
      return redis.error_reply('tollgate: bad ask ' .. ask)
    end
    want, min, need, lease = tonumber(w), tonumber(m), tonumber(k), true
  end
  if want > capacity then want = capacity end
  if min > want then min = want end
  if need > min then need = min end

  local tokens = capacity
  local tat = tonumber(redis.call('GET', KEYS[i]))
  if tat and tat > now then
    tokens = capacity - (tat - now) * rate / 1000000
    if tokens < 0 then
      tokens = 0
    end
    -- Whole token counts survive the trip through the TAT despite rounding.
    local whole = floor(tokens + 0.5)
    if tokens - whole < 1e-9 and whole - tokens < 1e-9 then
      tokens = whole
    end
  end

  if tokens < need then
    -- tokens < need <= min, so both waits are at least 1 ms.
    reply[n + 1] = 0
    reply[n + 2] = floor(tokens)
    reply[n + 3] = wait(need, tokens, rate)
    n = n + 3
    if lease then
      reply[n + 1] = 0
      reply[n + 2] = wait(min, tokens, rate)
      n = n + 2
    end
  else
    local granted = need
    if tokens >= min then
      granted = floor(tokens)
      if granted > want then granted = want end
    end
    tokens = tokens - granted
    redis.call('SET', KEYS[i], now + (capacity - tokens) * 1000000 / rate, 'PX', expire_ms)
    reply[n + 1] = 1
    reply[n + 2] = floor(tokens)
    reply[n + 3] = wait(need, tokens, rate)
    n = n + 3
    if lease then
      reply[n + 1] = granted
      reply[n + 2] = wait(min, tokens, rate)
      n = n + 2
    end
  end
end

return reply
