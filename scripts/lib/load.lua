-- wrk script for the benchmark scripts (scripts/lib/bench.sh, run_wrk).
--
-- Environment:
--   TENANTS   keys to rotate over in X-Api-Key: 1 sends "bench" on every
--             request; N > 1 sends "t0" … "t<N-1>", each connection
--             walking the keys from its own starting point
--   DELAY_MS  mean pause before each request on a connection (0 = none),
--             drawn uniformly from 0 to twice the mean so that connections
--             do not fire together: with C connections the rate is about
--             C × 1000 / DELAY_MS req/s
--   OUT       where done() writes the run's summary as JSON, in the
--             shape run_oha's output has (requestsPerSec,
--             latencyPercentiles in seconds, statusCodeDistribution)

local tenants = tonumber(os.getenv("TENANTS") or "1")
local delay_ms = tonumber(os.getenv("DELAY_MS") or "0")

local prepared = {}
local next_key = 1

function init(args)
  local path = wrk.path
  if tenants <= 1 then
    prepared[1] = wrk.format(nil, path, { ["X-Api-Key"] = "bench" })
  else
    for i = 0, tenants - 1 do
      prepared[i + 1] = wrk.format(nil, path, { ["X-Api-Key"] = "t" .. i })
    end
  end
  math.randomseed(os.time() + math.floor(os.clock() * 1e6))
  next_key = math.random(#prepared)
end

function request()
  local r = prepared[next_key]
  next_key = next_key % #prepared + 1
  return r
end

if delay_ms > 0 then
  function delay()
    return math.random(0, 2 * delay_ms)
  end
end

function done(summary, latency, requests)
  local seconds = summary.duration / 1e6
  local e = summary.errors
  local ok = summary.requests - e.status
  local out = assert(io.open(assert(os.getenv("OUT"), "OUT is not set"), "w"))
  out:write(string.format(
    '{"summary":{"requestsPerSec":%.3f,"total":%d},'
      .. '"latencyPercentiles":{"p50":%.9f,"p99":%.9f,"p99.9":%.9f},'
      .. '"statusCodeDistribution":{"2xx/3xx":%d,"other status":%d},'
      .. '"socketErrors":%d}\n',
    summary.requests / seconds, summary.requests,
    latency:percentile(50) / 1e6, latency:percentile(99) / 1e6, latency:percentile(99.9) / 1e6,
    ok, e.status, e.connect + e.read + e.write + e.timeout))
  out:close()
end
