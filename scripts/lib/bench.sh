# Shared plumbing for the benchmark scripts (sourced, not run).
#
# Provides: require TOOL..., build_tollgate, start_work_dir (sets $work and
# cleans up on exit: runs the commands in $cleanup, then kills everything
# recorded in $pids), free_port, wait_port PORT, start_redis PORT (sets
# REDIS_PID), start_upstream PORT (nginx answering "ok"; sets UPSTREAM_PID),
# write_bench_config …, start_tollgate NAME CONFIG [ENV=VALUE...] (sets
# TOLLGATE_PID), wait_ready ADMIN_PORT LOG [SECONDS], run_oha OUT URL
# ARGS..., run_wrk OUT URL ARGS..., latency_ms FILE (p50 p99 p99.9 in
# ms), family PID... (them and their children), cpu_ticks PID... (all,
# kernel), switches PID... (all, preempted), pin CPU PID..., make_redis_tls
# DIR (a CA and a certificate for 127.0.0.1), start_redis_tls PORT DIR (a
# TLS-only Redis; sets REDIS_PID), redis_at PORT ARGS... (redis-cli, over
# TLS for a TLS Redis), script_usec PORT... .
#
# Load generators run under ${LOAD_PREFIX[@]} (for example taskset -c 1).

require() {
  local tool hint
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 && continue
    case $tool in
      oha) hint="cargo install oha --locked" ;;
      taskset) hint="apt-get install -y util-linux" ;;
      nginx) hint="apt-get install -y nginx-light" ;;
      redis-server | redis-cli) hint="apt-get install -y redis-server redis-tools" ;;
      *) hint="apt-get install -y $tool" ;;
    esac
    echo "error: $tool not found; install it with: $hint" >&2
    exit 1
  done
}

build_tollgate() {
  echo "==> building tollgate (release)"
  cargo build --release --quiet
  TOLLGATE=target/release/tollgate
}

start_work_dir() {
  work=$(mktemp -d)
  pids=()
  cleanup=()
  LOAD_PREFIX=()
  trap 'for c in "${cleanup[@]}"; do eval "$c" || true; done; for pid in "${pids[@]}"; do kill -CONT "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"' EXIT
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_port() {
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "error: nothing listens on port $1" >&2
  exit 1
}

start_redis() {
  # --dir: a dump.rdb in the working directory is never loaded.
  redis-server --port "$1" --bind 127.0.0.1 --save '' --appendonly no --dir "$work" \
    >"$work/redis-$1.log" 2>&1 &
  pids+=($!)
  REDIS_PID=$!
  wait_port "$1"
}

# make_redis_tls DIR: a test CA (DIR/ca.crt) and a certificate for
# 127.0.0.1 and localhost signed by it (DIR/redis.crt, DIR/redis.key).
make_redis_tls() {
  local dir=$1
  mkdir -p "$dir"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj "/CN=bench CA" -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=localhost \
    -keyout "$dir/redis.key" -out "$dir/redis.csr" 2>/dev/null
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' >"$dir/redis.ext"
  openssl x509 -req -in "$dir/redis.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 2 -out "$dir/redis.crt" -extfile "$dir/redis.ext" 2>/dev/null
}

# Ports of TLS-only Redis servers, with the CA redis-cli trusts for each.
declare -A REDIS_TLS_CA=()

# start_redis_tls PORT DIR: a Redis that speaks only TLS on PORT, with
# DIR's certificate (make_redis_tls).
start_redis_tls() {
  redis-server --port 0 --tls-port "$1" --tls-cert-file "$2/redis.crt" --tls-key-file "$2/redis.key" \
    --tls-ca-cert-file "$2/ca.crt" --tls-auth-clients no --bind 127.0.0.1 --save '' \
    --appendonly no --dir "$work" >"$work/redis-$1.log" 2>&1 &
  pids+=($!)
  REDIS_PID=$!
  REDIS_TLS_CA[$1]=$2/ca.crt
  wait_port "$1"
}

# redis_at PORT ARGS...: redis-cli to the Redis on PORT (over TLS for one
# started by start_redis_tls).
redis_at() {
  local port=$1
  shift
  if [ -n "${REDIS_TLS_CA[$port]:-}" ]; then
    redis-cli --tls --cacert "${REDIS_TLS_CA[$port]}" -p "$port" "$@"
  else
    redis-cli -p "$port" "$@"
  fi
}

start_upstream() {
  mkdir -p "$work/up"
  cat >"$work/up/nginx.conf" <<CONF
daemon off;
worker_processes 1;
error_log $work/up/error.log warn;
pid $work/up/nginx.pid;
events { worker_connections 4096; }
http {
  access_log off;
  server {
    listen 127.0.0.1:$1 reuseport backlog=4096;
    keepalive_requests 1000000;
    location / { return 200 "ok\n"; }
  }
}
CONF
  nginx -p "$work/up" -c "$work/up/nginx.conf" &
  pids+=($!)
  UPSTREAM_PID=$!
  wait_port "$1"
}

# write_bench_config FILE LISTEN_PORT ADMIN_PORT REDIS_URL UPSTREAM_PORT WORKERS [EXACT]
# A gateway config with one catch-all route "bench" to the upstream, a rule
# for tenant "bench" so large that no request is ever rejected, and a
# default rule of a million requests per second for every other tenant
# (far above what one tenant of a many-tenant run sends). With
# EXACT=true (the default) the rule never leases, so every request is
# decided by a Redis call; with false the gateway runs as configured by
# default, leasing tokens for the hot key.
write_bench_config() {
  cat >"$1.rules.toml" <<CONF
[[rule]]
tenant = "bench"
route = "bench"
capacity = 2000000000
refill_per_second = 2000000000
exact = ${7:-true}
CONF
  cat >"$1" <<CONF
[server]
listen = "127.0.0.1:$2"
admin_listen = "127.0.0.1:$3"
workers = $6
[redis]
url = "$4"
[rules]
file = "$1.rules.toml"
[log]
level = "warn"
[default_rule]
capacity = 1000000
refill_per_second = 1000000
[[routes]]
id = "bench"
path_prefix = "/"
upstream = "http://127.0.0.1:$5"
CONF
}

# wait_ready ADMIN_PORT LOG [SECONDS]: waits up to SECONDS (10) for a
# gateway's /ready to answer 200; past that, prints its log and exits.
# Each try gives up after a second, so a gateway that accepts and then
# stalls cannot hold the wait past its deadline.
wait_ready() {
  local deadline=$(( $(date +%s) + ${3:-10} ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    [ "$(curl -s -m 1 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/ready")" = 200 ] && return 0
    sleep 0.1
  done
  echo "error: the gateway is not ready after ${3:-10} s; its log ($2):" >&2
  cat "$2" >&2
  exit 1
}

start_tollgate() {
  local name=$1 config=$2
  shift 2
  env "$@" "$TOLLGATE" serve --config "$config" >"$work/$name.log" 2>&1 &
  pids+=($!)
  TOLLGATE_PID=$!
}

run_oha() {
  local out=$1 url=$2
  shift 2
  "${LOAD_PREFIX[@]}" oha --no-tui --output-format json -H "X-Api-Key: bench" "$@" "$url" >"$out"
}

# run_wrk OUT URL ARGS...: wrk with scripts/lib/load.lua, which rotates the
# key over $TENANTS tenants (1: "bench") and paces each connection by
# $DELAY_MS when set; OUT gets the summary in run_oha's JSON shape.
run_wrk() {
  local out=$1 url=$2
  shift 2
  OUT=$out TENANTS=${TENANTS:-1} DELAY_MS=${DELAY_MS:-0} \
    "${LOAD_PREFIX[@]}" wrk -s scripts/lib/load.lua "$@" "$url" >"$out.log"
}

latency_ms() {
  python3 -c 'import json,sys; p=json.load(open(sys.argv[1]))["latencyPercentiles"]; print(" ".join(f"{p[k]*1000:.3f}" for k in ("p50","p99","p99.9")))' "$1"
}

# family PID...: these processes and their children (nginx's workers),
# one per line.
family() {
  local pid
  for pid in "$@"; do
    echo "$pid"
    pgrep -P "$pid" || true
  done
}

# cpu_ticks PID...: user plus system CPU time, in clock ticks (getconf
# CLK_TCK per second), of these processes (all their threads) and their
# children; then, after a space, the system (kernel) part alone.
cpu_ticks() {
  local pid
  for pid in $(family "$@"); do cat "/proc/$pid/stat"; done |
    awk '{n += $14 + $15; k += $15} END {print n + 0, k + 0}'
}

# switches PID...: context switches so far (voluntary and involuntary,
# every thread) of these processes and their children; then, after a
# space, the involuntary ones alone.
switches() {
  local pid
  for pid in $(family "$@"); do cat /proc/"$pid"/task/*/status 2>/dev/null || true; done |
    awk '/^voluntary_ctxt_switches/ {v += $2} /^nonvoluntary_ctxt_switches/ {n += $2}
         END {print v + n, n + 0}'
}

# pin CPU PID...: binds these processes, every thread and their children to
# one CPU; threads started later inherit it.
pin() {
  local cpu=$1 pid
  shift
  for pid in $(family "$@"); do
    taskset -a -p -c "$cpu" "$pid" >/dev/null
  done
}

# script_usec PORT...: microseconds Redis spent in script calls (EVALSHA and
# EVAL) since the last CONFIG RESETSTAT, summed over the servers on PORTs,
# then their number of calls: "usec calls".
script_usec() {
  local port
  for port in "$@"; do redis_at "$port" INFO commandstats; done |
    awk -F'[:=,]' '/^cmdstat_eval(sha)?:/ {calls += $3; usec += $5} END {print usec + 0, calls + 0}'
}
