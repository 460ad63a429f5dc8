#!/usr/bin/env bash
# Sessions moved by accident: four plain backends (JSON answers after DELAY_MS, no /metrics, no
# usage, so the proxy has no evidence for moving anything) behind `agentrace proxy` with its
# default settings, and closed-loop clients each driving one session at a time through TURNS
# growing turns with an X-Session-ID, SESSIONS sessions in all. Prints one row per binary and
# client count: sessions answered by more than one backend, the proxy's spill decisions and
# moves (from /metrics), failed requests, and the wall time. Every moved session pays a full
# prefill of its context on a real engine.
#
#   scripts/bench-affinity.sh [CLIENTS="1 8 24 64"] [SESSIONS=96] [TURNS=6]
#
# AGENTRACE=path/to/agentrace picks the binary (default: target/release/agentrace, built);
# BEFORE=path/to/another adds its rows first, measured in the same run, for a comparison.
# DELAY_MS (default 30) is the backends' answer time. NEW_CONNECTION=1 makes every turn open a
# new connection, as clients without a connection pool do.
set -euo pipefail
cd "$(dirname "$0")/.."
clients="${1:-1 8 24 64}"
sessions="${2:-96}"
turns="${3:-6}"
delay="${DELAY_MS:-30}"
# shellcheck source=scripts/lib/bench-common.sh
. scripts/lib/bench-common.sh

# Four plain backends in one process: any POST gets a chat completion after the delay, naming
# nothing; every other request a 404 (so no /metrics and no KV size).
ports=()
for _ in 1 2 3 4; do ports+=("$(free_port)"); done
python3 - "$delay" "${ports[@]}" >"$work/backends.log" 2>&1 <<'PY' &
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
delay = int(sys.argv[1]) / 1000
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def do_GET(self):
        code = 200 if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("content-length", "0")
        self.end_headers()
    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        self.rfile.read(n)
        time.sleep(delay)
        body = json.dumps({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "done"},
             "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256
for port in sys.argv[2:]:
    server = Server(("127.0.0.1", int(port)), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
threading.Event().wait()
PY
pids+=($!)
for port in "${ports[@]}"; do wait_http "http://127.0.0.1:$port/health"; done

# Drives SESSIONS sessions through the proxy at $1 with $2 clients; prints "moved failures secs".
drive() {
    python3 - "$1" "$2" "$sessions" "$turns" "${NEW_CONNECTION:-0}" <<'PY'
import http.client, json, queue, sys, threading, time
addr, clients, sessions, turns, fresh = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
host, port = addr.rsplit(":", 1)
todo = queue.Queue()
for s in range(sessions):
    todo.put(s)
served = {}
failures = [0]
lock = threading.Lock()
def body(s, t):
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"task {s}: " + "fix the build " * 50}]
    for k in range(t):
        messages.append({"role": "assistant", "content": f"step {k} " + "read a file " * 40})
        messages.append({"role": "user", "content": f"result {k} " + "line of output " * 80})
    return json.dumps({"model": "m", "messages": messages}).encode()
def client():
    conn = None
    while True:
        try:
            s = todo.get_nowait()
        except queue.Empty:
            return
        for t in range(turns):
            if conn is None or fresh:
                if conn is not None:
                    conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
            try:
                conn.request("POST", "/v1/chat/completions", body(s, t),
                             {"content-type": "application/json", "x-session-id": f"bench-{s}"})
                resp = conn.getresponse()
                resp.read()
                backend = resp.getheader("x-agentrace-backend")
                ok = resp.status == 200
            except OSError:
                ok, backend = False, None
                conn = None
            with lock:
                if ok:
                    served.setdefault(s, set()).add(backend)
                else:
                    failures[0] += 1
start = time.monotonic()
threads = [threading.Thread(target=client) for _ in range(clients)]
for th in threads:
    th.start()
for th in threads:
    th.join()
moved = sum(1 for b in served.values() if len(b) > 1)
print(moved, failures[0], f"{time.monotonic() - start:.1f}")
PY
}

# The sum of every series of metric $1 with label text $2 in the Prometheus text at URL $3.
metric() {
    curl -fs "$3" | awk -v m="$1" -v l="$2" 'index($0, m) == 1 && index($0, l) { s += $NF } END { print s + 0 }'
}

echo "uptime: $(uptime)"
printf '%-10s %8s %10s %7s %6s %9s %7s\n' binary clients moved/all spills moves failures secs
binaries=()
[ -n "${BEFORE:-}" ] && binaries+=("before=$BEFORE")
binaries+=("after=$bin")
for entry in "${binaries[@]}"; do
    label="${entry%%=*}"
    exe="${entry#*=}"
    for n in $clients; do
        listen="127.0.0.1:$(free_port)"
        admin="127.0.0.1:$(free_port)"
        args=(proxy --listen "$listen" --admin-listen "$admin")
        for i in "${!ports[@]}"; do args+=(--backend "b$i=http://127.0.0.1:${ports[$i]}"); done
        "$exe" "${args[@]}" >"$work/proxy.log" 2>&1 &
        proxy=$!
        pids+=("$proxy")
        wait_http "http://$admin/metrics"
        read -r moved failures secs < <(drive "$listen" "$n")
        url="http://$admin/metrics"
        spills=$(metric agentrace_affinity_decisions_total 'outcome="spill"' "$url")
        moves=$(metric agentrace_affinity_moves_total '' "$url")
        printf '%-10s %8s %10s %7s %6s %9s %7s\n' "$label" "$n" "$moved/$sessions" "$spills" "$moves" "$failures" "$secs"
        kill "$proxy"
        wait "$proxy" 2>/dev/null || true
    done
done
