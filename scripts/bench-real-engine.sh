#!/usr/bin/env bash
# Session affinity against round-robin on two llama-servers (scripts/real-engine.sh builds
# them): the same workflow conversations replayed through agentrace's proxy under each
# policy, RUNS times each, fresh servers every run. Prints one row per run: mean and p90 TTFT,
# the cached share of prompt tokens, the prompt tokens the servers evaluated, system_tps.
#
#   scripts/bench-real-engine.sh [CONVERSATIONS=6] [RUNS=3]
#
# AGENTRACE=path/to/agentrace picks the binary (default: target/release/agentrace, built).
set -euo pipefail
cd "$(dirname "$0")/.."
convs="${1:-6}"
runs="${2:-3}"
cache="${AGENTRACE_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrace/real-engine}"
if [ ! -f "$cache/env" ]; then
    echo "bench-real-engine.sh: no $cache/env; run scripts/real-engine.sh first" >&2
    exit 2
fi
# shellcheck disable=SC1091
. "$cache/env"
# shellcheck source=scripts/lib/bench-common.sh
. scripts/lib/bench-common.sh

# Waits for "$2" in log "$1" and prints what follows it on that line (up to whitespace).
address_in_log() {
    for _ in $(seq 600); do
        if grep -q "$2" "$1"; then
            grep -o "$2[^ ]*" "$1" | head -1 | sed "s|$2||"
            return
        fi
        sleep 0.1
    done
    echo "bench-real-engine.sh: '$2' never appeared in $1" >&2
    tail -5 "$1" >&2
    exit 1
}

start_engine() {
    "$AGENTRACE_LLAMA_SERVER" --model "$AGENTRACE_TINY_GGUF" --host 127.0.0.1 --port 0 \
        --jinja --metrics --parallel 2 --ctx-size 49152 --threads 1 --alias tiny \
        >"$1" 2>&1 &
    pids+=($!)
    local addr
    addr="$(address_in_log "$1" "listening on http://")"
    until curl -fs "http://$addr/health" >/dev/null; do sleep 0.1; done
    echo "$addr"
}

prompt_tokens() {
    curl -fs "http://$1/metrics" | awk '/^llamacpp:prompt_tokens_total /{print $2}'
}

"$bin" dataset synth --coding 0 --workflow "$convs" --out "$work/workflow.jsonl" >/dev/null
cat >"$work/replay.toml" <<TOML
[model_params]
name = "tiny"
max_new_tokens = 16
temperature = 0.0
TOML

printf '%-12s %3s %10s %10s %8s %12s %10s\n' policy run ttft_mean ttft_p90 cached prompt_eval system_tps
for policy in session round_robin; do
    for run in $(seq "$runs"); do
        a="$(start_engine "$work/a.log")"
        b="$(start_engine "$work/b.log")"
        "$bin" proxy --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --policy "$policy" \
            --backend "a=http://$a" --backend "b=http://$b" >"$work/proxy.log" 2>&1 &
        pids+=($!)
        proxy="$(address_in_log "$work/proxy.log" "agentrace proxy listening on ")"
        out="$work/$policy-$run"
        "$bin" replay --config "$work/replay.toml" --target "http://$proxy" \
            --dataset "$work/workflow.jsonl" --concurrency 4 --delays false --salt false \
            --no-progress --out "$out" >"$work/replay.log" 2>&1 || {
            echo "replay failed:" >&2; tail -5 "$work/replay.log" >&2; exit 1; }
        evaluated=$(( $(prompt_tokens "$a" | cut -d. -f1) + $(prompt_tokens "$b" | cut -d. -f1) ))
        python3 - "$out/result_summary.json" "$policy" "$run" "$evaluated" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
m, t = s["metrics"], s["ttft"]
ms = lambda ns: ns / 1e6
print(f"{sys.argv[2]:<12} {sys.argv[3]:>3} {ms(t['avg']):>8.1f}ms {ms(t['percentiles']['90.0']):>8.1f}ms "
      f"{(m.get('cached_token_ratio') or 0) * 100:>7.1f}% {int(sys.argv[4]):>12} {s['tps']:>10.1f}")
PY
        stop_all
    done
done
