#!/usr/bin/env bash
# The same small replay in each request API the replayer speaks (`--api chat|messages|
# responses`) against llama.cpp's llama-server (scripts/real-engine.sh builds it): the first
# CONVERSATIONS conversations of the public MLPerf sample, each cut to its first TURNS client
# turns, at most 32 new tokens a turn, greedy. A fresh server for every run, so no API replays into a
# prefix cache another filled; the order of the APIs rotates from run to run. Prints one row
# per run and API: TTFT p50/p90 (ms), output tokens/s, the mean prompt tokens the server
# counted (the same conversation in every API should give about the same) and the ratio of
# each figure to chat's in the same run.
#
#   scripts/bench-replay-apis.sh [CONVERSATIONS=3] [TURNS=4] [RUNS=3] [CONCURRENCY=2]
#
# The sample is read where the tests read it (datasets/ in the checkout, else
# ../shared/datasets/); the cut copy lives in a temporary directory only.
# AGENTRACE=path/to/agentrace picks the binary (default: target/release/agentrace, built).
set -euo pipefail
cd "$(dirname "$0")/.."
convs="${1:-3}"
turns="${2:-4}"
runs="${3:-3}"
concurrency="${4:-2}"
cache="${AGENTRACE_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrace/real-engine}"
if [ ! -f "$cache/env" ]; then
    echo "bench-replay-apis.sh: no $cache/env; run scripts/real-engine.sh first" >&2
    exit 2
fi
# shellcheck disable=SC1091
. "$cache/env"
sample=""
for place in datasets ../shared/datasets; do
    if [ -f "$place/mlperf_agentic_coding_sample.jsonl" ]; then
        sample="$place/mlperf_agentic_coding_sample.jsonl"
        break
    fi
done
if [ -z "$sample" ]; then
    echo "bench-replay-apis.sh: the public sample is absent (scripts/fetch-sample.sh)" >&2
    exit 2
fi
# shellcheck source=scripts/lib/bench-common.sh
. scripts/lib/bench-common.sh

python3 - "$sample" "$convs" "$turns" >"$work/cut.jsonl" <<'EOF'
import json, sys
path, convs, turns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kept = []
for line in open(path):
    row = json.loads(line)
    cid = row["conversation_id"]
    if cid not in kept:
        if len(kept) == convs:
            continue
        kept.append(cid)
    # Rows alternate client and reply: client turn k is row 2k-1, its reply row 2k.
    if row["turn"] <= 2 * turns:
        print(line, end="")
EOF

cat >"$work/replay.toml" <<TOML
concurrency = $concurrency
enable_salt = false
inject_tool_delay = false

[model_params]
name = "tiny"
max_new_tokens = 32
temperature = 0.0
TOML

start_engine() {
    local port
    port="$(free_port)"
    "$AGENTRACE_LLAMA_SERVER" --model "$AGENTRACE_TINY_GGUF" --host 127.0.0.1 --port "$port" \
        --jinja --parallel "$concurrency" --ctx-size $(( 16384 * concurrency )) --threads 1 \
        --alias tiny >"$work/engine.log" 2>&1 &
    # Called in a command substitution, whose `pids` the script never sees: the caller reads
    # the PID from here, so every server is stopped with the run.
    echo $! >"$work/engine.pid"
    wait_http "http://127.0.0.1:$port/health"
    echo "$port"
}

apis=(chat messages responses)
printf '%-4s %-10s %10s %10s %10s %8s %8s %8s %8s\n' run api ttft_p50 ttft_p90 out_tok_s \
    isl p50/chat p90/chat tps/chat
for run in $(seq "$runs"); do
    declare -A p50=() p90=() tps=() isl=()
    shift_by=$(( (run - 1) % 3 ))
    order=("${apis[@]:$shift_by}" "${apis[@]:0:$shift_by}")
    for api in "${order[@]}"; do
        port="$(start_engine)"
        pids+=("$(cat "$work/engine.pid")")
        out="$work/run$run-$api"
        "$bin" replay --config "$work/replay.toml" --target "http://127.0.0.1:$port" \
            --dataset "$work/cut.jsonl" --api "$api" --no-progress --out "$out" >/dev/null
        read -r p50["$api"] p90["$api"] tps["$api"] isl["$api"] < <(python3 - "$out" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1] + "/result_summary.json"))
h = doc["headline"]
if h["failures"]:
    reasons = json.load(open(sys.argv[1] + "/result_summary.json"))["failure_counts"]["top_reasons"]
    sys.exit(f"{sys.argv[1]}: {h['failures']} failed turns: {reasons}")
print(h["ttft_p50_ms"], h["ttft_p90_ms"], h["system_tps"], doc["input_sequence_lengths"]["avg"])
EOF
)
        stop_all
    done
    for api in "${apis[@]}"; do
        python3 -c 'import sys
run, api, a50, a90, atps, isl, c50, c90, ctps = sys.argv[1:]
a50, a90, atps, isl, c50, c90, ctps = map(float, (a50, a90, atps, isl, c50, c90, ctps))
print(f"{run:<4} {api:<10} {a50:10.1f} {a90:10.1f} {atps:10.1f} {isl:8.0f} {a50/c50:8.2f} {a90/c90:8.2f} {atps/ctps:8.2f}")' \
            "$run" "$api" "${p50[$api]}" "${p90[$api]}" "${tps[$api]}" "${isl[$api]}" \
            "${p50[chat]}" "${p90[chat]}" "${tps[chat]}"
    done
done
echo "load: $(uptime)"
