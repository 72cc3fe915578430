-- tollgate token bucket, state format 2: refill, take and persist one or
-- more buckets atomically, with one reading of Redis's clock.
--
-- KEYS[i]        bucket i, e.g. rl2:{tenant}:route: a string holding one
--                number, the bucket's theoretical arrival time (TAT): the
--                time at which it is full again, in microseconds since the
--                Unix epoch by Redis's clock (possibly fractional). A
--                bucket holds capacity - (TAT - now) × rate tokens; a
--                missing key is a full bucket.
-- ARGV[5i-4]     capacity of bucket i: size in tokens (number >= 1)
-- ARGV[5i-3]     refill rate of bucket i in tokens per second (number > 0)
-- ARGV[5i-2]     want (optional, default 1): tokens to take (integer >= 1):
--                one request's cost, or a lease batch; clamped to the
--                capacity, so a request costing more than the bucket holds
--                passes only when the bucket is full
-- ARGV[5i-1]     min (optional, default want): the fewest tokens worth a
--                lease
-- ARGV[5i]       need (optional, default min): the request's own cost; when
--                fewer than min but at least need tokens exist, exactly
--                need are taken, so a lease call never turns away a request
--                that could pass
--
-- Returns, per key in key order, three integers for a plain ask (want,
-- min and need as given all equal, or left out) and five for a lease:
--   allowed         1 when the request's tokens were taken, else 0
--   remaining       tokens left after this call, floored
--   retry_after_ms  ms until need tokens exist, rounded up: for a rejection
--                   at least 1; after a grant, 0 while need tokens remain
--   granted         (leases only) tokens taken: min..want, or need, or 0
--   block_ms        (leases only) the same as retry_after_ms for min: when
--                   another lease could be granted
-- For a plain ask those two say nothing new (granted is need when allowed,
-- else 0; block_ms is retry_after_ms), so they are not sent: a reply's
-- integers are most of what a caller spends parsing it.
--
-- Per key: one GET, and one SET ... PX when tokens are taken (a rejection
-- writes nothing). Now always comes
-- from redis.call('TIME'), never from the gateway: gateway clocks drift.
-- Redis 7 replicates scripts by their effects, so reading TIME before a
-- write is safe. A written key expires after twice the time to refill an
-- empty bucket; an idle bucket therefore vanishes and comes back full. A
-- changed rule keeps a bucket's debt (time until full), not its count.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local reply = {}

for i = 1, #KEYS do
  local at = (i - 1) * 5
  local capacity = tonumber(ARGV[at + 1])
  local rate = tonumber(ARGV[at + 2])
  local want = tonumber(ARGV[at + 3] or 1)
  local min = tonumber(ARGV[at + 4] or want)
  local need = tonumber(ARGV[at + 5] or min)
  -- Decided on the asks as given, which the caller knows too.
  local lease = want ~= min or min ~= need
  want = math.min(want, capacity)
  min = math.min(min, want)
  need = math.min(need, min)

  local tat = tonumber(redis.call('GET', KEYS[i])) or now
  local tokens = math.max(0, capacity - math.max(0, tat - now) * rate / 1000000)
  -- Whole token counts survive the trip through the TAT despite rounding.
  local whole = math.floor(tokens + 0.5)
  if math.abs(tokens - whole) < 1e-9 then
    tokens = whole
  end

  -- Milliseconds until n tokens exist, rounded up; 0 when they do.
  local function wait(n)
    if tokens >= n then
      return 0
    end
    return math.ceil((n - tokens) * 1000 / rate)
  end

  local base = #reply
  if tokens < need then
    reply[base + 1] = 0
    reply[base + 2] = math.floor(tokens)
    reply[base + 3] = math.max(1, wait(need))
    if lease then
      reply[base + 4] = 0
      reply[base + 5] = math.max(1, wait(min))
    end
  else
    local granted = need
    if tokens >= min then
      granted = math.min(want, math.floor(tokens))
    end
    tokens = tokens - granted
    redis.call('SET', KEYS[i], now + (capacity - tokens) * 1000000 / rate,
      'PX', math.max(1, math.ceil(2 * capacity * 1000 / rate)))
    reply[base + 1] = 1
    reply[base + 2] = math.floor(tokens)
    reply[base + 3] = wait(need)
    if lease then
      reply[base + 4] = granted
      reply[base + 5] = wait(min)
    end
  end
end

return reply
