"""Throwaway services for the Python scripts (scripts/soak,
scripts/slow-clients, scripts/failover-cost): redis-server (alone, as a
primary with a replica under Sentinel, or as a Cluster with replicas), a
PostgreSQL cluster, an HTTP upstream and `tollgate serve` processes, each
on free ports, with helpers to wait for them. Imported, not run."""

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def fail(message):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    fail(f"{what} did not happen within {seconds} s")


def port_open(port):
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---------------------------------------------------------------- services


class Redis:
    def __init__(self, work, wrapper=(), args=(), name="redis"):
        """A throwaway redis-server on a free port, run under `wrapper` (a
        command prefix such as valgrind's) when one is given, with extra
        server `args`; its log is <work>/<name>.log."""
        if not shutil.which("redis-server"):
            fail("redis-server not found; install it with: apt-get install -y redis-server")
        self.port = free_port()
        # A directory of its own, so that it never loads a dump.rdb found
        # in the working directory (a replica saves what it synced there).
        self.dir = tempfile.mkdtemp(prefix=f"{name}-", dir=work)
        # A Cluster node's bus port is its port + 10000.
        while self.port >= 55536:
            self.port = free_port()
        self.name = name
        self.log = open(os.path.join(work, f"{name}.log"), "ab")
        self.wrapper = list(wrapper)
        self.args = list(args)
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            self.wrapper + ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                            "--save", "", "--appendonly", "no", "--dir", self.dir] + self.args,
            stdout=self.log, stderr=self.log)
        wait_for(lambda: port_open(self.port), 60 if self.wrapper else 10, "redis-server start")

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def pause(self):
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def cli(self, *args):
        """One command by redis-cli; its text output, or None when the
        server does not answer."""
        out = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True,
                             text=True, timeout=5)
        return out.stdout if out.returncode == 0 and out.stdout else None

    def is_primary(self):
        if self.proc.poll() is not None:
            return False
        try:
            role = self.cli("ROLE")
        except subprocess.TimeoutExpired:
            return False
        return bool(role) and role.startswith("master")


SENTINEL_MASTER = "tollgate"


class Sentinel:
    """A primary, its replica and three sentinels (quorum 2, a primary
    silent for 1 s is failed over), each on free ports."""

    def __init__(self, work):
        if not shutil.which("redis-cli"):
            fail("redis-cli not found; install it with: apt-get install -y redis-tools")
        first = Redis(work, name="redis-0")
        second = Redis(work, args=["--replicaof", "127.0.0.1", str(first.port)], name="redis-1")
        self.servers = [first, second]
        self.sentinels = []
        for i in range(3):
            port = free_port()
            path = os.path.join(work, f"sentinel-{i}.conf")
            with open(path, "w") as f:
                f.write(f"port {port}\nbind 127.0.0.1\ndir {work}\n"
                        f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {first.port} 2\n"
                        f"sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n"
                        f"sentinel failover-timeout {SENTINEL_MASTER} 5000\n")
            log_file = open(os.path.join(work, f"sentinel-{i}.log"), "ab")
            proc = subprocess.Popen(["redis-server", path, "--sentinel"], stdout=log_file,
                                    stderr=log_file)
            self.sentinels.append((port, proc))

        def agreed():
            for port, _ in self.sentinels:
                out = subprocess.run(["redis-cli", "-p", str(port), "SENTINEL", "REPLICAS",
                                      SENTINEL_MASTER], capture_output=True, text=True)
                if "slave" not in out.stdout:
                    return False
            return True

        wait_for(agreed, 20, "the sentinels to see the primary and its replica")

    def redis_toml(self):
        nodes = ", ".join(f'"127.0.0.1:{p}"' for p, _ in self.sentinels)
        return f'sentinel_nodes = [{nodes}]\nsentinel_master = "{SENTINEL_MASTER}"'

    def primary(self):
        """The server that answers as the primary, if any."""
        return next((s for s in self.servers if s.is_primary()), None)

    def describe(self):
        return (f"Sentinel: primary :{self.servers[0].port}, replica :{self.servers[1].port}, "
                f"sentinels {', '.join(f':{p}' for p, _ in self.sentinels)}")

    def stop(self):
        for _, proc in self.sentinels:
            proc.kill()
            proc.wait()
        for server in self.servers:
            server.stop()


class Cluster:
    """A Redis Cluster of three primaries with one replica each, a 1.5 s
    node timeout, every primary serving its slots while another's fail
    over (cluster-require-full-coverage no)."""

    def __init__(self, work):
        if not shutil.which("redis-cli"):
            fail("redis-cli not found; install it with: apt-get install -y redis-tools")
        self.nodes = []
        for i in range(6):
            node_dir = os.path.join(work, f"cluster-{i}")
            os.makedirs(node_dir)
            self.nodes.append(Redis(work, args=[
                "--cluster-enabled", "yes", "--cluster-node-timeout", "1500",
                "--cluster-require-full-coverage", "no", "--dir", node_dir], name=f"cluster-{i}"))
        out = subprocess.run(["redis-cli", "--cluster", "create",
                              *[f"127.0.0.1:{n.port}" for n in self.nodes],
                              "--cluster-replicas", "1", "--cluster-yes"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            fail(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")

        def healthy():
            return all("cluster_state:ok" in (n.cli("CLUSTER", "INFO") or "")
                       for n in self.nodes if n.proc.poll() is None)

        wait_for(healthy, 30, "the cluster to be healthy")
        wait_for(lambda: all("master_link_status:up" in (n.cli("INFO", "replication") or "")
                             for n in self.nodes if not n.is_primary()), 30,
                 "the replicas to sync")

    def redis_toml(self):
        nodes = ", ".join(f'"127.0.0.1:{n.port}"' for n in self.nodes)
        return f"cluster_nodes = [{nodes}]"

    def primaries(self):
        return [n for n in self.nodes if n.is_primary()]

    def describe(self):
        return (f"Cluster: primaries {', '.join(f':{n.port}' for n in self.primaries())}, "
                f"6 nodes")

    def stop(self):
        for node in self.nodes:
            node.stop()


class Postgres:
    def __init__(self, work):
        versions = sorted(
            (d for d in os.listdir("/usr/lib/postgresql") if os.path.exists(
                f"/usr/lib/postgresql/{d}/bin/initdb")),
            key=lambda v: [int(x) for x in v.split(".") if x.isdigit()],
        ) if os.path.isdir("/usr/lib/postgresql") else []
        if not versions:
            fail("no PostgreSQL server binaries; install them with: apt-get install -y postgresql")
        self.bin = f"/usr/lib/postgresql/{versions[-1]}/bin"
        self.dir = os.path.join(work, "pg")
        os.makedirs(self.dir)
        self.as_pg = []
        if os.geteuid() == 0:
            shutil.chown(work, "postgres")
            os.chmod(work, 0o755)
            shutil.chown(self.dir, "postgres", "postgres")
            self.as_pg = ["runuser", "-u", "postgres", "--"]
        self.port = free_port()
        self.run("initdb", "-D", self.data(), "-U", "postgres", "-A", "trust", "--no-sync")
        self.start()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def data(self):
        return os.path.join(self.dir, "data")

    def run(self, tool, *args):
        out = subprocess.run(self.as_pg + [os.path.join(self.bin, tool), *args],
                             capture_output=True, text=True)
        if out.returncode != 0:
            fail(f"{tool} failed: {out.stdout}{out.stderr}")

    def start(self):
        self.run("pg_ctl", "-D", self.data(), "-l", os.path.join(self.dir, "server.log"), "-w",
                 "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off",
                 "start")

    def stop(self):
        self.run("pg_ctl", "-D", self.data(), "-m", "fast", "-w", "stop")


class Upstream:
    """An HTTP/1.1 upstream: /download?bytes=N streams N bytes, /slow?ms=N
    answers after N ms (counting how many it works on at once), POST reads
    the body, anything else answers a small JSON document."""

    def __init__(self):
        upstream = self
        self.lock = threading.Lock()
        self.slow_now = self.slow_most = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # The head and the body leave in separate writes: without
            # TCP_NODELAY the body waits for the head's delayed ACK (40 ms).
            disable_nagle_algorithm = True

            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path.startswith("/slow"):
                    with upstream.lock:
                        upstream.slow_now += 1
                        upstream.slow_most = max(upstream.slow_most, upstream.slow_now)
                    try:
                        time.sleep(int(self.path.split("ms=")[1]) / 1000)
                    finally:
                        with upstream.lock:
                            upstream.slow_now -= 1
                if self.path.startswith("/download"):
                    total = int(self.path.split("bytes=")[1])
                    self.send_response(200)
                    self.send_header("Content-Length", str(total))
                    self.end_headers()
                    chunk = b"x" * 65536
                    try:
                        sent = 0
                        while sent < total:
                            n = min(len(chunk), total - sent)
                            self.wfile.write(chunk[:n])
                            sent += n
                    except OSError:
                        self.close_connection = True
                    return
                body = b'{"ok":true}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                length = int(self.headers.get("Content-Length", "0"))
                try:
                    self.rfile.read(length)
                except OSError:
                    self.close_connection = True
                    return
                self.do_GET()

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 512

            def handle_error(self, request, client_address):
                pass  # A gateway dropping a connection is part of the soak.

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()


class Gateway:
    def __init__(self, name, work, binary, config):
        self.name, self.work, self.binary = name, work, binary
        self.config_text = config
        self.log_path = os.path.join(work, f"gateway-{name}.log")
        self.proxy = self.admin = self.rls = 0
        self.proc = None
        self.start()

    def start(self):
        config = self.config_text.replace("{proxy}", str(self.proxy)).replace(
            "{admin}", str(self.admin))
        path = os.path.join(self.work, f"gateway-{self.name}.toml")
        with open(path, "w") as f:
            f.write(config)
        log = open(self.log_path, "ab")
        offset = log.tell()
        env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
        self.proc = subprocess.Popen([self.binary, "serve", "--config", path],
                                     stdout=log, stderr=log, env=env)

        def serving():
            with open(self.log_path) as f:
                f.seek(offset)
                for line in f:
                    # A line still being written has no newline yet.
                    if "tollgate is serving." in line and line.endswith("\n"):
                        # Older builds colour their logs even in files.
                        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
                        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
                        self.proxy = int(fields["proxy"].rsplit(":", 1)[1])
                        self.admin = int(fields["admin"].rsplit(":", 1)[1])
                        if "rls" in fields:
                            self.rls = int(fields["rls"].rsplit(":", 1)[1])
                        return True
            if self.proc.poll() is not None:
                fail(f"gateway {self.name} exited; see {self.log_path}")
            return False

        wait_for(serving, 60, f"gateway {self.name} start")
        wait_for(lambda: self.ready_status() == 200, 30, f"gateway {self.name} ready")

    def ready_status(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/ready", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def ready(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/ready", timeout=5) as r:
            return json.load(r)

    def metric(self, series):
        """One series of this gateway's own /metrics (its own process), or 0."""
        url = f"http://127.0.0.1:{self.admin}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(series + " "):
                    return float(line.split()[-1])
        return 0.0

    def terminate(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0


# ---------------------------------------------------------------- traffic


class Client:
    """A keep-alive connection to one gateway, reopened after failures."""

    def __init__(self, gateway):
        self.gateway = gateway
        self.conn = None

    def get(self, path, key):
        for attempt in range(2):
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection("127.0.0.1", self.gateway.proxy,
                                                           timeout=10)
                self.conn.request("GET", path, headers={"X-Api-Key": key})
                response = self.conn.getresponse()
                response.read()
                if response.getheader("Connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                return response.status
            except (OSError, http.client.HTTPException):
                if self.conn:
                    self.conn.close()
                self.conn = None
                # A kept connection the gateway closed meanwhile: one retry
                # on a fresh one before counting a refusal.
                if attempt == 1:
                    return None
        return None


def paced(stop, per_second, step):
    period = 1.0 / per_second
    next_at = time.monotonic()
    while not stop.is_set():
        step()
        next_at += period
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        else:
            next_at = time.monotonic()
