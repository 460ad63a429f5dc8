#!/usr/bin/env bash
# Instructions agentrace executes per proxied request, counted by valgrind's callgrind: unlike
# req/s and CPU time, the count does not move with what else the machine is doing, so it shows
# whether a change to the forwarding path made it cheaper. Runs the proxy benchmark's
# closed-loop load (64 connections, or N with --conns) through agentrace alone, counts a window
# of SECONDS after a warm-up, and prints instructions per request and the proxy functions that
# cost most (inclusive). At one connection every request also pays for the runtime's sleep and
# wake-up, twice, which at 64 connections is shared among many requests.
# With --peers, nginx (one worker, no master) and HAProxy (one thread), whichever are installed,
# are counted the same way on the same backends and load, for comparison.
# With --cache, valgrind also simulates the caches (`--cache-sim=yes`, its first-level and
# last-level caches) and each count is followed by the misses per request: instruction reads
# (I1mr), data reads (D1mr) and data writes (D1mw) missing the first level. Two programs that
# execute as many instructions can still spend very different time waiting on memory; the
# simulation counts that repeatably where the machine has no hardware counters.
# Usage: scripts/proxy-instructions.sh [SECONDS] [--peers] [--conns N] [--cache]
#        needs: apt-get install -y valgrind wrk (and nginx haproxy for --peers)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"
window=10
peers=false
conns=64
cache_sim=""

while [ $# -gt 0 ]; do
  case "$1" in
    --peers) peers=true ;;
    --cache) cache_sim="--cache-sim=yes" ;;
    --conns)
      conns=${2:-}
      [ $# -ge 2 ] && shift
      ;;
    *) window=$1 ;;
  esac
  shift
done
[[ "$conns" =~ ^[1-9][0-9]*$ ]] || { echo "--conns: expected a number of connections, got '$conns'" >&2; exit 2; }
[[ "$window" =~ ^[1-9][0-9]*$ ]] || { echo "SECONDS: expected a whole number, got '$window'" >&2; exit 2; }
threads=$((conns < 2 ? conns : 2))
for tool in valgrind callgrind_control callgrind_annotate wrk; do
  command -v "$tool" >/dev/null || { echo "$tool is not installed (apt-get install -y valgrind wrk)" >&2; exit 1; }
done
out=$(mktemp -d)

# misses PROFILE REQUESTS: with --cache, the first-level misses per request from a profile's
# summary line (events Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw).
misses() {
  [ -n "$cache_sim" ] || return 0
  awk -v n="$2" '/^summary:/ {printf "  misses per request: I1mr %d, D1mr %d, D1mw %d\n", $5 / n, $6 / n, $7 / n}' "$1"
}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
# The build reports the agentrace binary too, in no fixed order: take the bench target's.
bench=$(cargo bench --bench proxy --no-run --message-format=json 2>/dev/null |
  grep '"kind":\["bench"\]' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1 || true)
[ -x "$bench" ] || { echo "could not build the proxy benchmark" >&2; exit 1; }
# The direct target runs first for `duration` seconds, then agentrace: warm up 5 s, count `window`.
duration=$((window + 15))
"$bench" --only agentrace --loads "$conns" --duration "$duration" --repeats 1 --rates "" \
  --sse-streams 1 --wrap "valgrind --tool=callgrind $cache_sim --callgrind-out-file=$out/cg.%p" \
  >"$out/bench.txt" 2>&1 &
bench_pid=$!
sleep $((duration + 5))
kill -0 "$bench_pid" 2>/dev/null || { echo "the benchmark stopped early (see $out/bench.txt)" >&2; exit 1; }
callgrind_control --zero >/dev/null
sleep "$window"
callgrind_control --dump >/dev/null
wait "$bench_pid" || { echo "the benchmark failed (see $out/bench.txt)" >&2; exit 1; }
profile=$(ls "$out"/cg.*.1 2>/dev/null | head -1 || true)
[ -n "$profile" ] || { echo "no callgrind dump in $out (see $out/bench.txt)" >&2; exit 1; }
callgrind_annotate --tree=calling --inclusive=yes "$profile" >"$out/tree.txt" 2>"$out/annotate.txt" ||
  { echo "callgrind_annotate could not read $profile (see $out/annotate.txt)" >&2; exit 1; }
total=$(callgrind_annotate "$profile" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
requests=$(grep -E '>   .*routing::Router::route ' "$out/tree.txt" | head -1 |
  sed -E 's/.*\(([0-9,]+)x\).*/\1/' | tr -d ,)
[ -n "$requests" ] && [ "$requests" -gt 0 ] || { echo "no requests counted (see $out)" >&2; exit 1; }
echo "requests counted: $requests; instructions: $total; per request: $((total / requests))"
misses "$profile" "$requests"
echo "costliest proxy functions, instructions per request (inclusive):"
callgrind_annotate --inclusive=yes "$profile" 2>/dev/null |
  sed -nE 's#^ *([0-9,]+) +\( *[0-9.]+%\) +([^ ]*/)?src/proxy/[a-z0-9_]+\.rs:(agentrace::proxy::[^ ]+).*#\1 \3#p' |
  awk -v n="$requests" '{c=$1; gsub(",", "", c); if (!seen[$2]++) printf "%8d  %s\n", c / n, $2}' |
  head -15
echo "profile: $profile"
$peers || exit 0

# Peers: the benchmark's backends in their own process (they exit when their stdin closes),
# each peer under callgrind, counters zeroed after a warm-up, then `window` seconds of wrk;
# instructions per request is what the peer executed in that window over wrk's request count.
exec 3> >("$bench" --serve-backends 1000 >"$out/backends.txt")
for _ in $(seq 50); do [ -s "$out/backends.txt" ] && break; sleep 0.1; done
read -r -a backends <"$out/backends.txt"
[ "${#backends[@]}" -eq 4 ] || { echo "the backends did not start (see $out/backends.txt)" >&2; exit 1; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
script="$out/sessions.lua"
cat >"$script" <<'EOF'
local keys = {}
for i = 1, 1000 do keys[i] = "session-" .. i end
local body = '{"model":"bench","messages":[{"role":"system","content":"You are a coding agent."},{"role":"user","content":"Fix the failing test."}],"max_tokens":16}'
request = function()
  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json", ["X-Session-ID"] = keys[math.random(1, 1000)]}, body)
end
EOF
url="http://127.0.0.1:$port/v1/chat/completions"

# count_peer NAME COMMAND...: runs COMMAND under callgrind, listening on $port.
count_peer() {
  local name=$1
  shift
  valgrind --tool=callgrind $cache_sim --callgrind-out-file="$out/$name.cg" "$@" >"$out/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 100); do (exec 9<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.2; done
  wrk -t"$threads" -c"$conns" -d5s -s "$script" "$url" >/dev/null
  callgrind_control --zero "$pid" >/dev/null
  local served
  served=$(wrk -t"$threads" -c"$conns" -d"${window}s" -s "$script" "$url" | awk '/requests in/ {print $1}')
  callgrind_control --dump "$pid" >/dev/null
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  local dump count
  dump=$(ls "$out/$name.cg".* 2>/dev/null | grep -v '\.cg$' | head -1 || true)
  [ -n "$dump" ] || { echo "$name: no callgrind dump in $out (see $out/$name.log)" >&2; return; }
  count=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
  echo "$name: requests $served; instructions: $count; per request: $((count / served))"
  misses "$dump" "$served"
}

servers=""
for b in "${backends[@]}"; do servers+="    server $b;"$'\n'; done
if command -v nginx >/dev/null; then
  mkdir -p "$out/nginx"
  cat >"$out/nginx/nginx.conf" <<EOF
master_process off;
daemon off;
pid $out/nginx/nginx.pid;
error_log $out/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $out/nginx/body; proxy_temp_path $out/nginx/proxy;
  fastcgi_temp_path $out/nginx/fcgi; uwsgi_temp_path $out/nginx/uwsgi; scgi_temp_path $out/nginx/scgi;
  upstream backends {
    hash \$http_x_session_id consistent;
$servers    keepalive 256;
  }
  server {
    listen 127.0.0.1:$port;
    location / {
      proxy_pass http://backends; proxy_http_version 1.1;
      proxy_set_header Connection ""; proxy_buffering off;
    }
  }
}
EOF
  count_peer nginx nginx -p "$out/nginx" -c "$out/nginx/nginx.conf" -e "$out/nginx/error.log"
else
  echo "nginx not installed: skipped"
fi
if command -v haproxy >/dev/null; then
  i=0
  servers=""
  for b in "${backends[@]}"; do servers+="  server gpu-$i $b"$'\n'; i=$((i + 1)); done
  cat >"$out/haproxy.cfg" <<EOF
global
  nbthread 1
  maxconn 4000
defaults
  mode http
  timeout connect 5s
  timeout client 120s
  timeout server 120s
  option http-keep-alive
  http-reuse always
frontend fe
  bind 127.0.0.1:$port
  default_backend be
backend be
  balance hdr(X-Session-ID)
  hash-type consistent
$servers
EOF
  count_peer haproxy haproxy -f "$out/haproxy.cfg" -db
else
  echo "haproxy not installed: skipped"
fi
exec 3>&-
