#!/usr/bin/env bash
# Figures for every agent's wire (Anthropic Messages, OpenAI Responses): sessions pinned by
# fingerprint without a header, lost caches noticed from each API's usage, turns exported
# against turns sent, the recorded first token against the client's, and chains continued
# by previous_response_id over four backends, failed when sent round robin straight to the
# backends against through agentrace (round robin too: only the response ids keep a chain).
#
#   scripts/bench-wire.sh [SESSIONS_PER_API]     (default 16)
#
# Prints the machine's load and one JSON line of figures. Counts, not speed: a debug build
# serves.
#
# Then the same figures from the official SDKs (tests/sdk/*.py: a streamed anthropic tool loop,
# an openai Responses loop chained by previous_response_id, 4 turns a session) over 4 replicas
# of `agentrace sim` behind the proxy binary with its recorder: "before" is $AGENTRACE_BEFORE
# (a build without the wire work, default /work/before/agentrace, skipped when absent), "after"
# is $AGENTRACE (else a release build made here), each with session affinity, and "after" once
# more with --policy round_robin. One JSON line each: sessions pinned, failed turns, affinity
# moves by reason, turns exported, client TTFT minus the captured first token (ms, p50/p99).
set -euo pipefail
cd "$(dirname "$0")/.."
uptime
sessions="${1:-16}"
WIRE_SESSIONS="$sessions" nice cargo test --test wire_apis wire_figures -- --ignored --nocapture 2>/dev/null \
  | grep '^{'
uptime
if ! py="$(scripts/python-sdks.sh 2>/dev/null)"; then
    echo "bench-wire.sh: SDK figures skipped (scripts/python-sdks.sh could not install the SDKs)"
    exit 0
fi
# shellcheck source=scripts/lib/bench-common.sh
. scripts/lib/bench-common.sh
"$bin" sim --replicas 4 --listen 127.0.0.1:0 --time-scale 0.01 >"$work/sim.log" 2>&1 &
pids+=($!)
for _ in $(seq 600); do
    [ "$(grep -c 'simulated replica listening' "$work/sim.log")" -ge 4 ] && break
    sleep 0.1
done
backends=()
for addr in $(grep -o 'addr=[0-9.:]*' "$work/sim.log" | cut -d= -f2); do
    backends+=(--backend "http://$addr")
done
# run_one LABEL PROXY_BINARY [PROXY_ARGS...]
run_one() {
    local label="$1" proxy_bin="$2" dir="$work/$1"
    shift 2
    mkdir -p "$dir"
    local port admin
    port="$(free_port)"
    admin="$(free_port)"
    "$proxy_bin" proxy --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
        "${backends[@]}" --capture "$dir/capture" "$@" >"$dir/proxy.log" 2>&1 &
    local pid=$!
    wait_http "http://127.0.0.1:$admin/metrics"
    "$py" tests/sdk/anthropic_loop.py "http://127.0.0.1:$port" "$sessions" 4 >"$dir/turns.jsonl" 2>"$dir/loop.err" || true
    "$py" tests/sdk/openai_responses_loop.py "http://127.0.0.1:$port/v1" "$sessions" 4 >>"$dir/turns.jsonl" 2>>"$dir/loop.err" || true
    curl -fs "http://127.0.0.1:$admin/metrics" >"$dir/metrics.txt" || true
    kill -TERM "$pid"
    wait "$pid" || true
    "$bin" capture cat "$dir/capture" >"$dir/cat.jsonl" 2>/dev/null || true
    "$bin" capture export "$dir/capture" --out "$dir/export.jsonl" >"$dir/export.txt" 2>&1 || true
    "$py" scripts/lib/wire_sdk_figures.py "$label" "$dir/turns.jsonl" "$dir/metrics.txt" \
        "$dir/cat.jsonl" "$dir/export.txt"
}
before="${AGENTRACE_BEFORE:-/work/before/agentrace}"
if [ -x "$before" ]; then
    run_one before "$before"
fi
run_one after "$bin"
run_one after-round-robin "$bin" --policy round_robin
uptime
