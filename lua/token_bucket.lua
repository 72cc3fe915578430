-- tollgate token bucket, state format 2: refill, take and persist one or
-- more buckets atomically, with one reading of Redis's clock.
--
-- KEYS[i]        bucket i, e.g. rl2:{tenant}:route: a string holding one
--                number, the bucket's theoretical arrival time (TAT): the
--                time at which it is full again, in microseconds since the
--                Unix epoch by Redis's clock, written as a whole number
--                (rounded to the nearest microsecond: formatting a whole
--                number costs Redis far less than a fraction's %.17g; a
--                fractional value is still read). A bucket holds
--                capacity - (TAT - now) × rate tokens, snapped to a whole
--                count when within half a microsecond of refill of one;
--                a missing key is a full bucket.
-- ARGV           each key's arguments in key order, three (capacity,
--                rate, ask; below, ARGV[3i-2], ARGV[3i-1] and ARGV[3i]
--                name them as if every key had three) or one, a short ask:
--                '=' and a single ask (plain or lease), for a key under
--                the rule of the single key before it (a run of keys
--                under one rule, most of a busy call, then sends each
--                key's capacity and rate once: every argument costs
--                Redis a Lua string); a short ask with no single key
--                before it, or any other ask after '=', is undecided.
--                A count k before a short ask ("16=+1") makes it the
--                ask of k keys, this one and the k-1 after it, which
--                then have no argument of their own: a run of keys with
--                the same rule and ask sends one argument in all.
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
--                bucket holds passes only when the bucket is full.
--
-- A charge ask "c<n>" takes n tokens whatever the bucket holds (usage
-- reported after the fact): the bucket may go into debt, down to minus
-- its capacity, and later asks wait until the debt is paid back by the
-- refill. "c-<n>" gives n back (a refund), never above the capacity. A
-- quota counts a charge as n requests (at most twice the quota in a
-- window) and a refund as n fewer (never below zero). A charge is
-- always allowed.
--
-- Concurrency slots: a group's key may be a set of slots instead of a
-- bucket (ARGV[3i-2] the slots, ARGV[3i-1] "c<lease_ms>:<holder>", the
-- holder in hex): a sorted set whose members are the holders of a slot,
-- each scored with the time its hold ends (ms by Redis's clock); a member
-- whose time has passed is dropped when the key is next read. A take
-- admits only when every slot key has a free slot and its holder holds
-- none of them (a holder id used twice at once is refused, never
-- shared), and then holds one slot per key (one, whatever the cost) for
-- lease_ms; a charge leaves slots alone; the ask "r*n" gives the holders'
-- slots back, and "n*n" holds them for another lease_ms (allowed 0 for a
-- slot already lost). A slot key
-- expires when no hold can remain (twice the lease after the last write).
-- For a slot key, remaining is the free slots and retry_after_ms, when
-- none is free, a fixed 1000: a slot frees when a request ends, which no
-- clock foretells.
--
-- Groups: an ask "cost*n", "want:min:need*n" or "c<n>*n" starts a group
-- of n keys
-- (this one and the n-1 after it, whose asks are "-"): the limits of one
-- request, all of which must admit it. The same count is taken from every
-- one of them, or nothing from any: the cost, or for a lease as many as
-- the fullest limit allows up to want (at least min, else need alone),
-- every count clamped to the smallest limit's size; a charge is taken
-- from (or given back to) every one of them. A group's key is a bucket as above, or a quota: then
-- ARGV[3i-2] is the quota (requests per window) and ARGV[3i-1] the window
-- instead of a rate: "m", "h", "d" (calendar minute, hour, day, UTC), "M"
-- (calendar month, UTC) or "s<seconds>" (fixed windows counted from the
-- epoch). A quota's key holds the requests counted in the current window
-- and expires when the window ends (SET ... PXAT): a new window starts
-- from zero.
--
-- Returns, per key in key order, three integers for a plain or group ask
-- and five for a lease ask (in a group, allowed is the group's verdict and
-- remaining and retry_after_ms are that key's; a quota's retry_after_ms is
-- the time until its window ends):
--   allowed         1 when the request's tokens were taken, else 0; -1
--                   when this key (or a key of its group) could not be
--                   decided, the other integers then 0: the key holds a
--                   value this script did not write (another type, not a
--                   number), or its ask is malformed. Such a key fails
--                   alone; the call's other keys are decided as usual.
--   remaining       tokens left after this call, floored (negative for a
--                   bucket in debt)
--   retry_after_ms  ms until need tokens exist, rounded up: for a rejection
--                   at least 1; after a grant, 0 while need tokens remain;
--                   after a charge, until one token exists
--   granted         (leases only) tokens taken: min..want, or need, or 0
--   block_ms        (leases only) the same as retry_after_ms for min: when
--                   another lease could be granted
-- For a plain ask those two say nothing new (granted is the cost when
-- allowed, else 0; block_ms is retry_after_ms), so they are not sent: a
-- reply's integers are most of what a caller spends parsing it, and Redis
-- converts each one.
--
-- A plain ask written "+cost" (as the gateway writes it) gets the compact
-- reply instead: a grant that leaves at least cost tokens (retry_after_ms
-- 0, the common answer) is one integer, its remaining count (>= 1); a key
-- that could not be decided is -1 alone; any other answer is -2 followed
-- by allowed, remaining and retry_after_ms. A call with a compact ask
-- packs its whole reply, the same integers in the same order, into one
-- string, a MessagePack array (cmsgpack.pack, part of Redis's Lua):
-- Redis then sends one string instead of converting each integer, and the
-- gateway reads it without a general reply parser, which cost it about
-- 850 instructions an integer.
--
-- Per key: one GET, and when tokens are taken one INCRBY (with a
-- PEXPIREAT when the TAT moves to another cell of the expiry grid) or SET
-- (a rejection writes nothing), each by redis.pcall so that a key's own
-- error is that key's answer, not the call's. Now always comes from
-- redis.call('TIME'), never from the gateway: gateway clocks drift.
--
-- Redis pays for every Lua function call and every number turned into a
-- string, so the loop compares inline instead of calling math.min and
-- math.max, and converts a rule's capacity and rate once for a run
-- of keys under the same rule (ARGV strings are interned: comparing two is
-- comparing pointers).
-- Redis 7 replicates scripts by their effects, so reading TIME before a
-- write is safe. A written bucket's key expires about twice the time to
-- refill an empty bucket after the bucket is full again (put, below: a
-- busy bucket keeps the expiry it has while its TAT stays in one cell of
-- a grid); an idle bucket therefore vanishes, and comes back full. A
-- changed rule keeps a bucket's debt (time until full), not its count;
-- a write under a new rule may keep the expiry set under the old one: the
-- key then vanishes no earlier than the new rule's cell (half its refill
-- time) before the bucket is full, with at least half its tokens back.

-- What the loop calls or reads for every key, as locals: a global is a
-- lookup by name each time.
local floor, ceil, format = math.floor, math.ceil, string.format
local redis_pcall, tonumber, KEYS, ARGV = redis.pcall, tonumber, KEYS, ARGV

-- Milliseconds until n tokens exist in a bucket holding tokens and
-- refilling at rate per second, rounded up; 0 when they do.
local function wait(n, tokens, rate)
  if tokens >= n then
    return 0
  end
  return ceil((n - tokens) * 1000 / rate)
end

local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]

-- Writes tat (a whole number of microseconds) to the bucket at key, whose
-- TAT was old (nil for a new key), under a rule whose empty bucket
-- refills in fill microseconds; returns whether the write succeeded. The
-- key expires at the start of its TAT's cell on a grid of cells of
-- fill / 2, plus 2 × fill: between 1.5 and 2 fill times after the
-- bucket is full again. A stored whole number moves by INCRBY, the
-- cheapest write Redis has for it: the integer changed in place, and an
-- integer reply where SET's status becomes a Lua table. A TAT that stays
-- in its cell keeps the expiry already set; one that moves to another
-- cell sets it with PEXPIREAT, which costs Redis about a third less than
-- writing value and expiry with SET ... PXAT (that deletes the key's
-- expiry and adds it again). Cells of half the refill time make a busy
-- bucket set its expiry about twice per refill time. Turning a number
-- into text costs Redis more than most of a key's arithmetic, and the
-- keys of one call share now, a rule and an ask, so the last step (tat -
-- old: the same for a run of buckets that were not full), the last TAT
-- SET wrote (the same for a run of full buckets) and the last expiry are
-- kept as text for the next key. A new key, or a value INCRBY cannot add
-- to (a fraction written by an older build, say), is written by SET.
-- (x - x % cell is the start of x's cell, without a call to math.floor.)
local put_fill, put_start, put_expiry, put_step, put_step_text, put_tat, put_text
local function put(key, tat, old, fill)
  local cell = fill / 2
  local start = tat - tat % cell
  -- Whether INCRBY moved the stored TAT to tat.
  local added = false
  if old and old % 1 == 0 then
    local step = tat - old
    if step ~= put_step then
      put_step, put_step_text = step, format('%d', step)
    end
    -- INCRBY answers the new value; an error reply is a table, never tat.
    added = redis_pcall('INCRBY', key, put_step_text) == tat
    if added and old - old % cell == start then
      return true
    end
  end
  if start ~= put_start or fill ~= put_fill then
    put_fill, put_start = fill, start
    put_expiry = format('%d', ceil((start + 2 * fill) / 1000))
  end
  -- The TAT moved to another cell, and so does the expiry (1 when set).
  if added and redis_pcall('PEXPIREAT', key, put_expiry) == 1 then
    return true
  end
  if tat ~= put_tat then
    put_tat, put_text = tat, format('%d', tat)
  end
  return not redis_pcall('SET', key, put_text, 'PXAT', put_expiry).err
end
local reply = {}
local n = 0
-- Whether a compact ask was met: the reply is then packed (see above).
local packed = false
-- Decides a group of keys (see the loop); made once a call meets one.
local group
-- The last key of the latest group: a '-' ask after it belongs to no group.
local group_end = 0

-- The rule of the previous key: its argument strings, their values,
-- whether they are usable (a capacity of at least 1, a positive rate), and
-- the tokens within which a count snaps to a whole one.
local rule_capacity, rule_rate, capacity, rate, fill, rule_ok, snap
-- The previous single key's ask, and its counts: a run of keys with the
-- same ask (most often '1') converts it once.
local last_ask, last_want, last_min, last_need, last_lease, last_compact
-- The latest short ask: the next key's argument equal to it is one too.
local last_short
-- Keys after this one that a run's short ask still covers.
local run = 0
-- ARGV[c] is the first argument of key i.
local c = 1

local nkeys, i = #KEYS, 1
while i <= nkeys do
  -- A short ask ('=' (61) and a single ask) is the key's only argument,
  -- and a run's ("<k>=" and a single ask) that of k keys; any other key
  -- has three, the ask at at; a later key of a group has three. The usual
  -- first argument, a short ask met before or a capacity met before, is
  -- told apart without a call; any other is converted to a number, which
  -- a capacity needs anyway (lead_number), and only what is not one is
  -- looked at further.
  local ask, at, short, lead_number
  if run > 0 then
    ask, short, run = last_short, true, run - 1
  else
    local lead = ARGV[c]
    short = lead == last_short
    if not short and lead ~= rule_capacity and i > group_end then
      lead_number = tonumber(lead)
      if not lead_number and lead ~= nil then
        short = string.byte(lead) == 61
        -- A run: a count (no leading zero), then a short ask.
        local k, rest = string.match(lead, '^([1-9]%d*)(=.*)$')
        if k then
          short, run, lead = true, tonumber(k) - 1, rest
        end
      end
    end
    if short then
      ask, last_short, c = lead, lead, c + 1
    else
      at = c + 2
      ask, c = ARGV[at] or '1', c + 3
    end
  end
  local want, min, need, lease, single, compact
  if ask == last_ask then
    want, min, need, lease, single, compact = last_want, last_min, last_need, last_lease, true, last_compact
  else
    local text = short and string.sub(ask, 2) or ask
    want = tonumber(text)
    min, need, lease = want, want, false
    single = want ~= nil
    -- '+' (43) before a plain cost asks for the compact reply.
    compact = single and string.byte(text) == 43
    packed = packed or compact
    if not single then
      local w, m, k = string.match(text, '^(%d+):(%d+):(%d+)$')
      if k then
        want, min, need, lease, single = tonumber(w), tonumber(m), tonumber(k), true, true
      end
    end
    if single then
      last_ask, last_want, last_min, last_need, last_lease, last_compact =
        ask, want, min, need, lease, compact
    end
  end
  if short and not single then
    -- Only a single ask may be short.
    reply[n + 1], reply[n + 2], reply[n + 3] = -1, 0, 0
    n = n + 3
  elseif not single then
    if ask == '-' then
      -- A later key of a group, decided with the group's first key; one
      -- after the group's end belongs to no group and fails.
      if i > group_end then
        reply[n + 1], reply[n + 2], reply[n + 3] = -1, 0, 0
        n = n + 3
      end
    else
      -- A group's first ask, or a lone charge (a group of one).
      local head, count = string.match(ask, '^([^*]+)%*(%d+)$')
      if not head then
        head, count = ask, 1
      end
      count = tonumber(count)
      local gw, gm, gk, glease, gop
      if count and count >= 1 and i + count - 1 <= #KEYS then
        gw, gm, gk = string.match(head, '^(%d+):(%d+):(%d+)$')
        glease = gk ~= nil
        if glease then
          gw, gm, gk = tonumber(gw), tonumber(gm), tonumber(gk)
        elseif head == 'r' or head == 'n' then
          gop, gw, gm, gk = head, 0, 0, 0
        else
          local charged = string.match(head, '^c(%-?%d+)$')
          gop = charged and 'c'
          gw = tonumber(charged or string.match(head, '^%d+$'))
          gm, gk = gw, gw
        end
      end
      if gw and not group then
        -- Made here, on the first group of a call, not at the top: a
        -- script's functions are created afresh on every call, and most
        -- calls hold no group.
        local now_ms = floor(now / 1000)

        -- Answers one key that could not be decided (allowed = -1), with
        -- the reply's width for its ask.
        local function undecided(lease)
          reply[n + 1], reply[n + 2], reply[n + 3] = -1, 0, 0
          n = n + 3
          if lease then
            reply[n + 1], reply[n + 2] = 0, 0
            n = n + 2
          end
        end

        -- Tokens in the bucket at key, as the single-key path computes them,
        -- and its TAT (nil when the key is missing); nil when the key holds
        -- a value this script did not write.
        local function bucket_tokens(key, capacity, rate)
          local raw = redis_pcall('GET', key)
          local tat = tonumber(raw)
          if raw and not tat then
            return nil
          end
          if not tat or tat <= now then
            return capacity, tat
          end
          local tokens = capacity - (tat - now) * rate / 1000000
          local whole, snap = floor(tokens + 0.5), 1e-9 + rate * 5e-7
          if tokens - whole < snap and whole - tokens < snap then
            return whole, tat
          end
          return tokens, tat
        end

        -- Days since 1970-01-01 of the first day of month m (1-12) of year y.
        local function days_from_civil(y, m)
          if m <= 2 then y = y - 1 end
          local era = floor(y / 400)
          local yoe = y - era * 400
          local mp = m > 2 and m - 3 or m + 9
          local doe = yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + floor((153 * mp + 2) / 5)
          return era * 146097 + doe - 719468
        end

        -- When the window named code that holds now ends, in ms since the
        -- epoch; nil for a code that names no window.
        local function window_end(code)
          local len
          if code == 'm' then len = 60000
          elseif code == 'h' then len = 3600000
          elseif code == 'd' then len = 86400000
          elseif code == 'M' then
            local z = floor(now_ms / 86400000) + 719468
            local era = floor(z / 146097)
            local doe = z - era * 146097
            local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
            local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
            local mp = floor((5 * doy + 2) / 153)
            local m = mp < 10 and mp + 3 or mp - 9
            local y = yoe + era * 400 + (m <= 2 and 1 or 0)
            if m == 12 then y, m = y + 1, 1 else m = m + 1 end
            return days_from_civil(y, m) * 86400000
          else
            len = tonumber(string.match(code or '', '^s(%d+)$'))
            if not len or len < 1 then
              return nil
            end
            len = len * 1000
          end
          return (floor(now_ms / len) + 1) * len
        end

        -- Milliseconds until k can be taken from limit s holding tokens
        -- (for slots: until one is free, see the top).
        local function limit_wait(s, tokens, k)
          if tokens >= k then
            return 0
          elseif s.slots then
            return 1000
          elseif s.rate then
            return wait(k, tokens, s.rate)
          end
          return s.ends - now_ms
        end

        -- The state of the group's key j, whose ask is ARGV[at], or nil
        -- when it cannot be decided.
        local function limit_state(j, at)
          local capacity = tonumber(ARGV[at - 2])
          if not capacity or capacity < 1 then
            return nil
          end
          local lease, holder = string.match(ARGV[at - 1], '^c(%d+):(%x+)$')
          if lease then
            -- Slots: drop the holds whose lease ran out, count the rest.
            local key = KEYS[j]
            lease = tonumber(lease)
            if lease < 1 or type(redis_pcall('ZREMRANGEBYSCORE', key, '-inf', now_ms)) ~= 'number' then
              return nil
            end
            local used = redis_pcall('ZCARD', key)
            if type(used) ~= 'number' then
              return nil
            end
            local held = redis_pcall('ZSCORE', key, holder)
            return {capacity = capacity, slots = true, tokens = capacity - used,
              holder = holder, lease = lease, held = type(held) == 'string'}
          end
          local rate = tonumber(ARGV[at - 1])
          local s = {capacity = capacity, rate = rate}
          if rate then
            if rate <= 0 then
              return nil
            end
            s.tokens, s.tat = bucket_tokens(KEYS[j], capacity, rate)
          else
            s.ends = window_end(ARGV[at - 1])
            local raw = redis_pcall('GET', KEYS[j])
            s.used = tonumber(raw)
            if not s.ends or (raw and not s.used) then
              return nil
            end
            s.used = s.used or 0
            s.tokens = capacity - s.used
          end
          if not s.tokens then
            return nil
          end
          return s
        end

        -- Writes key j, limit s, as holding tokens (a bucket's debt moves
        -- its TAT, and so its expiry, later); false when the write failed.
        local function store(j, s, tokens)
          if s.rate then
            return put(KEYS[j], floor(now + (s.capacity - tokens) * 1000000 / s.rate + 0.5),
              s.tat, 1000000 * s.capacity / s.rate)
          end
          return not redis_pcall('SET', KEYS[j], s.capacity - tokens, 'PXAT', s.ends).err
        end

        -- Holds a slot of key j (state s) for its holder, for its lease;
        -- false when the write failed.
        local function hold(j, s)
          local key = KEYS[j]
          return type(redis_pcall('ZADD', key, now_ms + s.lease, s.holder)) == 'number'
            and type(redis_pcall('PEXPIRE', key, 2 * s.lease)) == 'number'
        end

        -- Answers every key of the group from first on, whose states are
        -- state and whose tokens are left now, allowed as allowed (each
        -- key's own when a table), needing need: undecided when written
        -- is false.
        local function answer(first, count, state, left, allowed, need, written)
          for j = first, first + count - 1 do
            if written then
              local ok = allowed
              if type(ok) == 'table' then ok = ok[j] end
              reply[n + 1] = ok and 1 or 0
              reply[n + 2] = floor(left[j])
              reply[n + 3] = limit_wait(state[j], left[j], need)
              n = n + 3
            else
              undecided(false)
            end
          end
        end

        -- Charges amount (a refund when negative) to every bucket and
        -- quota of the group from first on, whose states are state;
        -- slots stay as they are.
        local function charge(first, count, state, amount)
          local left = {}
          local written = true
          for j = first, first + count - 1 do
            local s = state[j]
            local tokens = s.tokens
            if not s.slots then
              tokens = tokens - amount
              if tokens > s.capacity then tokens = s.capacity end
              if tokens < -s.capacity then tokens = -s.capacity end
              if amount ~= 0 and not store(j, s, tokens) then
                written = false
              end
            end
            left[j] = tokens
          end
          answer(first, count, state, left, true, 1, written)
        end

        -- Gives back (op 'r') or renews (op 'n') the holder's slots in
        -- the group from first on; buckets and quotas stay as they are.
        -- A renewal is allowed where the holder still holds its slot.
        local function slots(first, count, state, op)
          local left, kept = {}, {}
          local written = true
          for j = first, first + count - 1 do
            local s = state[j]
            left[j], kept[j] = s.tokens, true
            if s.slots and op == 'r' then
              if s.held then
                written = type(redis_pcall('ZREM', KEYS[j], s.holder)) == 'number' and written
                left[j] = s.tokens + 1
              end
            elseif s.slots then
              kept[j] = s.held
              if s.held and not hold(j, s) then
                written = false
              end
            end
          end
          answer(first, count, state, left, kept, 1, written)
        end

        -- Decides the group of count keys starting at first, as the ask
        -- (want, min, need; a lease when lease; a charge of want when
        -- charged) says: every key's state is read before any is written,
        -- so a key that cannot be decided leaves the whole group undecided
        -- and untouched.
        group = function(first, at, count, want, min, need, lease, op)
          local state = {}
          local avail, size
          -- Whether a slot key has no slot free for the holder.
          local full = false
          for j = first, first + count - 1 do
            local s = limit_state(j, at + 3 * (j - first))
            if not s then
              for _ = first, first + count - 1 do
                undecided(lease)
              end
              return
            end
            if s.slots then
              if s.tokens < 1 or s.held then full = true end
            else
              if not avail or s.tokens < avail then avail = s.tokens end
              if not size or s.capacity < size then size = s.capacity end
            end
            state[j] = s
          end
          if op == 'c' then
            return charge(first, count, state, want)
          elseif op then
            return slots(first, count, state, op)
          end
          -- A group of slots alone takes no tokens: its ask is met whole.
          avail = avail or want
          size = size or want
          if want > size then want = size end
          if min > want then min = want end
          if need > min then need = min end
          local granted = 0
          if avail >= min then
            granted = floor(avail)
            if granted > want then granted = want end
          elseif avail >= need then
            granted = need
          end
          if full then granted = 0 end
          local written = true
          local left = {}
          for j = first, first + count - 1 do
            local s = state[j]
            if s.slots then
              left[j] = s.tokens
              if granted > 0 then
                left[j] = s.tokens - 1
                if not hold(j, s) then
                  written = false
                end
              end
            else
              left[j] = s.tokens - granted
              if granted > 0 and not store(j, s, left[j]) then
                written = false
              end
            end
          end
          for j = first, first + count - 1 do
            if not written then
              undecided(lease)
            else
              local s = state[j]
              local tokens = left[j]
              reply[n + 1] = granted > 0 and 1 or 0
              reply[n + 2] = floor(tokens)
              reply[n + 3] = limit_wait(s, tokens, need)
              n = n + 3
              if lease then
                reply[n + 1] = granted
                reply[n + 2] = limit_wait(s, tokens, min)
                n = n + 2
              end
            end
          end
        end
      end
      if gw then
        group_end = i + count - 1
        group(i, at, count, gw, gm, gk, glease, gop)
      else
        -- A malformed ask fails this key; the '-' keys after it, which
        -- no group holds, fail one by one.
        reply[n + 1], reply[n + 2], reply[n + 3] = -1, 0, 0
        n = n + 3
      end
    end
  end
  if single then
    -- A short ask keeps the rule in force (none before: undecided).
    if not short and (ARGV[at - 2] ~= rule_capacity or ARGV[at - 1] ~= rule_rate) then
      rule_capacity, rule_rate = ARGV[at - 2], ARGV[at - 1]
      capacity, rate = lead_number or tonumber(rule_capacity), tonumber(rule_rate)
      rule_ok = capacity and rate and capacity >= 1 and rate > 0
      if rule_ok then
        fill = 1000000 * capacity / rate
        snap = 1e-9 + rate * 5e-7
      end
    end
    if rule_ok then
      if want > capacity then want = capacity end
      if min > want then min = want end
      if need > min then need = min end
    end
    -- This key and the keys after it that its run covers share the rule
    -- and the ask: one loop decides them, with nothing to look up again.
    local last = i + run
    if last > nkeys then last = nkeys end
    run = 0
    for j = i, last do
      -- The group path's bucket_tokens, inline: this path runs per key.
      -- allowed stays -1 when the key cannot be decided, and becomes
      -- false once a compact grant has been answered.
      local allowed, tokens, granted = -1, 0, 0
      local key = KEYS[j]
      local raw = rule_ok and redis_pcall('GET', key)
      local tat = tonumber(raw)
      if rule_ok and (tat or not raw) then
        tokens = capacity
        if tat and tat > now then
          -- Negative while a charge's debt is being paid back.
          tokens = capacity - (tat - now) * rate / 1000000
          -- Whole token counts survive the trip through the TAT despite
          -- rounding. (x - x % 1 is floor(x), without a function call.)
          local whole = tokens + 0.5
          whole = whole - whole % 1
          if tokens - whole < snap and whole - tokens < snap then
            tokens = whole
          end
        end
        -- tokens < need <= min: refused, and both waits are at least 1 ms.
        allowed = 0
        if tokens >= need then
          -- want is whole: a bucket holding it grants it.
          granted = want
          if tokens < want then
            granted = need
            if tokens >= min then granted = tokens - tokens % 1 end
          end
          local left = tokens - granted
          local to = now + (capacity - left) * 1000000 / rate + 0.5
          if not put(key, to - to % 1, tat, fill) then
            allowed = -1
          elseif compact and left >= need then
            -- The compact reply of a grant with need tokens left (the
            -- common answer): its remaining count alone (at least 1).
            reply[n + 1] = left - left % 1
            n = n + 1
            allowed = false
          else
            allowed, tokens = 1, left
          end
        end
      end
      if not allowed then
        -- Answered above.
      elseif allowed < 0 and compact then
        reply[n + 1] = -1
        n = n + 1
      elseif allowed < 0 then
        reply[n + 1], reply[n + 2], reply[n + 3] = -1, 0, 0
        n = n + 3
        if lease then
          reply[n + 1], reply[n + 2] = 0, 0
          n = n + 2
        end
      else
        -- Any other compact answer is tagged, then as a plain one.
        if compact then
          reply[n + 1] = -2
          n = n + 1
        end
        -- wait(need, tokens, rate), inline: in Redis's Lua a call costs
        -- more than the arithmetic it wraps.
        local retry = 0
        if tokens < need then
          retry = ceil((need - tokens) * 1000 / rate)
        end
        reply[n + 1], reply[n + 2], reply[n + 3] = allowed, tokens - tokens % 1, retry
        n = n + 3
        if lease then
          reply[n + 1] = allowed > 0 and granted or 0
          reply[n + 2] = wait(min, tokens, rate)
          n = n + 2
        end
      end
    end
    i = last
  end
  i = i + 1
end

-- A Redis-compatible server without cmsgpack gets the plain array, which
-- the gateway reads as well. Looked up with rawget: Redis fails a script
-- that reads a global it does not have.
local msgpack = packed and rawget(_G, 'cmsgpack')
if msgpack then
  return msgpack.pack(reply)
end
return reply
