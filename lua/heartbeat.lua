-- tollgate membership heartbeat: mark one instance live, forget silent ones,
-- and count who is left, atomically.
--
-- KEYS[1]  sorted set of live instances, e.g. tollgate:{instances}:<region>
--          (member = instance id, score = last heartbeat, ms by Redis's clock)
-- ARGV[1]  this instance's id
-- ARGV[2]  ttl: an instance silent for longer is no longer live (ms)
--
-- Returns the number of live instances, this one included (integer).
--
-- Now comes from redis.call('TIME'), so gateway clocks never matter. The
-- set expires after twice the ttl once every instance has stopped.

local ttl = tonumber(ARGV[2])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
return redis.call('ZCARD', KEYS[1])
