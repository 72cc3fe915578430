# Shared plumbing for the benchmark scripts (sourced, not run).
#
# Provides: require TOOL..., build_tollgate, start_work_dir (sets $work and
# cleans up on exit, killing everything recorded in $pids), free_port,
# wait_port PORT, start_redis PORT, start_upstream PORT (nginx answering
# "ok"), write_bench_config …, start_tollgate NAME CONFIG [ENV=VALUE...],
# run_oha OUT URL ARGS..., latency_ms FILE (p50 p99 p99.9 in ms).

require() {
  local tool hint
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 && continue
    case $tool in
      oha) hint="cargo install oha --locked" ;;
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
  trap 'for pid in "${pids[@]}"; do kill -CONT "$pid" 2>/dev/null; kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"' EXIT
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
  redis-server --port "$1" --bind 127.0.0.1 --save '' --appendonly no >"$work/redis-$1.log" 2>&1 &
  pids+=($!)
  REDIS_PID=$!
  wait_port "$1"
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
  wait_port "$1"
}

# write_bench_config FILE LISTEN_PORT ADMIN_PORT REDIS_URL UPSTREAM_PORT WORKERS [EXACT]
# A gateway config with one catch-all route "bench" to the upstream, and a
# rule for tenant "bench" so large that no request is ever rejected. With
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
[[routes]]
id = "bench"
path_prefix = "/"
upstream = "http://127.0.0.1:$5"
CONF
}

start_tollgate() {
  local name=$1 config=$2
  shift 2
  env "$@" "$TOLLGATE" serve --config "$config" >"$work/$name.log" 2>&1 &
  pids+=($!)
}

run_oha() {
  local out=$1 url=$2
  shift 2
  oha --no-tui --output-format json -H "X-Api-Key: bench" "$@" "$url" >"$out"
}

latency_ms() {
  python3 -c 'import json,sys; p=json.load(open(sys.argv[1]))["latencyPercentiles"]; print(" ".join(f"{p[k]*1000:.3f}" for k in ("p50","p99","p99.9")))' "$1"
}
