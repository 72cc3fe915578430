"""Report of scripts/bench-proxy: reads the run's JSON files and prints the
tables (latency, throughput, CPU per request per process, Redis time per
decision, ratios against nginx).

Usage: bench_report.py WORK ROUNDS RATE TENANTS MODE FALLBACKS TARGET...
where WORK holds rate-<target>-<round>.json and max-<target>-<round>.json
(load generator summaries) and cpu-<target>-<round>.json (CPU ticks of the
upstream, the proxy and its Redis over the max-throughput run, and Redis's
script time and calls).
"""

import json
import os
import statistics
import sys

work, rounds, rate, tenants, mode, fallbacks = sys.argv[1:7]
rounds, fallbacks = int(rounds), int(fallbacks)
targets = sys.argv[7:]
proxies = targets[1:]
tollgates = [t for t in proxies if t != "nginx"]
TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")
ROUNDS = range(1, rounds + 1)


def load(kind, t, r):
    with open(f"{work}/{kind}-{t}-{r}.json") as f:
        return json.load(f)


def median(xs):
    return statistics.median(xs)


def pct(doc, key):
    return doc["latencyPercentiles"][key] * 1000.0  # seconds → ms


def ratio(x, y):
    return float("inf") if y <= 0 else x / y


def spread(xs):
    if not xs:
        return "-"
    return f"{median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


lat, rps, codes, cpu = {}, {}, {}, {}
for t in targets:
    docs = [load("rate", t, r) for r in ROUNDS]
    maxes = [load("max", t, r) for r in ROUNDS]
    lat[t] = {k: median([pct(d, k) for d in docs]) for k in ("p50", "p99", "p99.9")}
    rps[t] = median([d["summary"]["requestsPerSec"] for d in maxes])
    codes[t] = {}
    for d in docs + maxes:
        for code, n in d.get("statusCodeDistribution", {}).items():
            # oha counts by status code, load.lua by class: one scheme.
            if code.isdigit():
                code = "2xx/3xx" if 200 <= int(code) < 400 else "other status"
            codes[t][code] = codes[t].get(code, 0) + n
        if d.get("socketErrors"):
            codes[t]["socket errors"] = codes[t].get("socket errors", 0) + d["socketErrors"]
    # Per round: CPU microseconds per request of each process, and Redis's
    # script microseconds and calls per request (= per decision).
    per_round = []
    for r in ROUNDS:
        c, n = load("cpu", t, r), load("max", t, r)["summary"]["total"]
        per_round.append({
            "proxy": c["proxy"] * TICK_US / n,
            "kernel": c["proxy_kernel"] * TICK_US / n,
            "redis": c["redis"] * TICK_US / n,
            "rls": c.get("rls", 0) * TICK_US / n,
            "upstream": c["upstream"] * TICK_US / n,
            "script": c["script_usec"] / n,
            "calls": c["script_calls"] / n,
            "switches": c["proxy_switches"] / n,
            "preempted": c["proxy_preempted"] / n,
            "redis_switches": c["redis_switches"] / n,
        })
    cpu[t] = {k: median([p[k] for p in per_round]) for k in per_round[0]}
    cpu[t]["rounds"] = per_round

print()
print(f"Mode: {mode}")
print(f"Fixed rate {rate} req/s (median of {rounds} rounds), ms"
      + (", latency-corrected" if tenants == "1" else ", wrk-paced"))
print(f"{'target':<16}{'p50':>9}{'p99':>9}{'p99.9':>9}   statuses")
for t in targets:
    l = lat[t]
    print(f"{t:<16}{l['p50']:>9.3f}{l['p99']:>9.3f}{l['p99.9']:>9.3f}   {codes[t]}")
print()
added = {t: {k: lat[t][k] - lat["direct"][k] for k in ("p50", "p99", "p99.9")} for t in proxies}
print("Added over direct, ms")
for t in proxies:
    a = added[t]
    print(f"{t:<16}{a['p50']:>9.3f}{a['p99']:>9.3f}{a['p99.9']:>9.3f}")
print()
print(f"Maximum throughput (median of {rounds} rounds), req/s")
for t in targets:
    print(f"{t:<16}{rps[t]:>12.0f}")
print()
print("CPU per request over the maximum-throughput runs (/proc; median of rounds), us")
print(f"{'target':<16}{'proxy':>9}{'(kernel)':>10}{'rls':>9}{'redis':>9}{'upstream':>10}{'total':>9}"
      f"{'script us/decision':>20}{'calls/decision':>16}")
for t in targets:
    c = cpu[t]
    script = f"{c['script']:.2f}" if c["calls"] else "-"
    calls = f"{c['calls']:.3f}" if c["calls"] else "-"
    rls = f"{c['rls']:.1f}" if c["rls"] else "-"
    print(f"{t:<16}{c['proxy']:>9.1f}{c['kernel']:>10.1f}{rls:>9}{c['redis']:>9.1f}{c['upstream']:>10.1f}"
          f"{c['proxy'] + c['rls'] + c['redis'] + c['upstream']:>9.1f}{script:>20}{calls:>16}")
print()
print("Context switches per request over the maximum-throughput runs (/proc; median of rounds)")
print(f"{'target':<16}{'proxy':>9}{'(preempted)':>13}{'redis':>9}")
for t in proxies:
    c = cpu[t]
    redis = f"{c['redis_switches']:.3f}" if c["calls"] else "-"
    print(f"{t:<16}{c['switches']:>9.3f}{c['preempted']:>13.3f}{redis:>9}")
print()
print("Ratios against nginx proxy_pass, from the medians")
print(f"{'':<16}{'added p50':>11}{'added p99':>11}{'max req/s':>11}{'proxy CPU':>11}"
      f"{'+rls+redis':>12}")
for t in tollgates:
    print(f"{t:<16}{ratio(added[t]['p50'], added['nginx']['p50']):>11.2f}"
          f"{ratio(added[t]['p99'], added['nginx']['p99']):>11.2f}"
          f"{ratio(rps[t], rps['nginx']):>11.2f}"
          f"{ratio(cpu[t]['proxy'], cpu['nginx']['proxy']):>11.2f}"
          f"{ratio(cpu[t]['proxy'] + cpu[t]['rls'] + cpu[t]['redis'], cpu['nginx']['proxy']):>12.2f}")
print()
# The same ratios round by round, each against the nginx run of its own
# round, so slow phases of the machine hit both sides of a ratio.
print(f"Paired per round: median [min-max] of {rounds} rounds "
      "(added p99 only where nginx added > 0)")
print(f"{'':<16}{'added p99':>22}{'max req/s':>22}{'proxy CPU':>22}")
for t in tollgates:
    p99, thr, cp = [], [], []
    for i, r in enumerate(ROUNDS):
        direct = pct(load("rate", "direct", r), "p99")
        base = pct(load("rate", "nginx", r), "p99") - direct
        if base > 0:
            p99.append((pct(load("rate", t, r), "p99") - direct) / base)
        thr.append(load("max", t, r)["summary"]["requestsPerSec"]
                   / load("max", "nginx", r)["summary"]["requestsPerSec"])
        cp.append(ratio(cpu[t]["rounds"][i]["proxy"], cpu["nginx"]["rounds"][i]["proxy"]))
    print(f"{t:<16}{spread(p99):>22}{spread(thr):>22}{spread(cp):>22}")
print(f"decisions made by the local fallback (Redis targets): {fallbacks}")

if "tollgate-tls" in targets:
    # TLS to Redis against plaintext, round by round: the same
    # configuration, each with a Redis of its own.
    print()
    print(f"TLS to Redis (tollgate-tls against tollgate), paired per round: "
          f"median [min-max] of {rounds} rounds")
    gateway, redis, thr = [], [], []
    for i, r in enumerate(ROUNDS):
        tls, plain = cpu["tollgate-tls"]["rounds"][i], cpu["tollgate"]["rounds"][i]
        gateway.append(tls["proxy"] - plain["proxy"])
        redis.append(tls["redis"] - plain["redis"])
        thr.append(load("max", "tollgate-tls", r)["summary"]["requestsPerSec"]
                   / load("max", "tollgate", r)["summary"]["requestsPerSec"])
    calls = median([cpu["tollgate-tls"]["calls"], cpu["tollgate"]["calls"]])
    print(f"  gateway CPU per request, TLS minus plaintext, us   {spread(gateway)}")
    print(f"  Redis CPU per request, TLS minus plaintext, us     {spread(redis)}")
    print(f"  max req/s, TLS / plaintext                         {spread(thr)}")
    print(f"  script calls per request                           {calls:.3f}")
