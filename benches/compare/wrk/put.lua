-- Fenced PUT for wrk: a 1 KiB body with X-Fencing-Token: $FENCING_TOKEN.
--
-- Default: every request goes to the URL's path (one pre-formatted
-- request, wrk's cheapest mode).
-- With RANDOM_KEYS=N: each request goes to KEY_PREFIX .. key(i) for a
-- random i in 0..N-1, where key(i) = hex8((i * 2654435761) mod 2^32) —
-- the same keys `loadgen fill` installs.
--
-- done() prints one machine-readable line: "WRKJSON {...}".
local body = string.rep("a", 1024)
local token = os.getenv("FENCING_TOKEN") or "1"

wrk.method = "PUT"
wrk.body = body
wrk.headers["Content-Type"] = "application/octet-stream"
wrk.headers["X-Fencing-Token"] = token

local n = tonumber(os.getenv("RANDOM_KEYS") or "")
if n then
  local prefix = os.getenv("KEY_PREFIX") or "/ext/r/"
  local headers = { ["Content-Type"] = "application/octet-stream", ["X-Fencing-Token"] = token }
  init = function(args)
    math.randomseed(os.time())
  end
  request = function()
    local k = (math.random(0, n - 1) * 2654435761) % 4294967296
    local key = string.format("%04x%04x", math.floor(k / 65536), k % 65536)
    return wrk.format("PUT", prefix .. key, headers, body)
  end
end

-- With WRK_QUANTILES set, the line also carries "q": the latency at the
-- percentiles 1, 2, ..., 89, then 90.0, 90.1, ..., 100 (us), so that the
-- distributions of several runs can be pooled (leases500k.py).
local function quantiles(latency)
  local q = {}
  for p = 1, 89 do
    q[#q + 1] = string.format("[%g,%d]", p, latency:percentile(p))
  end
  for i = 900, 999 do
    q[#q + 1] = string.format("[%g,%d]", i / 10, latency:percentile(i / 10))
  end
  -- wrk answers percentile(100) with 0: the maximum instead.
  q[#q + 1] = string.format("[100,%d]", latency.max)
  return ',"q":[' .. table.concat(q, ",") .. "]"
end

done = function(summary, latency, requests)
  local e = summary.errors
  local q = os.getenv("WRK_QUANTILES") and quantiles(latency) or ""
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"rps":%.1f,"p50_us":%d,"p99_us":%d,' ..
    '"max_us":%d,"err_connect":%d,"err_read":%d,"err_write":%d,"err_status":%d,"err_timeout":%d%s}\n',
    summary.requests, summary.duration, summary.requests / (summary.duration / 1e6),
    latency:percentile(50), latency:percentile(99), latency.max,
    e.connect, e.read, e.write, e.status, e.timeout, q))
end
