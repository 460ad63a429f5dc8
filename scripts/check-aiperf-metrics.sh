#!/usr/bin/env bash
# The InferenceX / AIPerf figures of a replay, recomputed by AIPerf's own code from the same
# per-turn records: E2E normalized interactivity = 1 / percentile(latency / OSL) at p90 and
# p75, numpy's linear percentile, taken through aiperf.metrics.derived_latency (the function
# AIPerf builds its per-request latency results with). Prints both numbers and fails unless
# they agree to 1e-9 relative.
#
# Runs a short replay of the public MLPerf sample against `agentrace sim` (DATASET= picks
# another file, TRAJECTORIES= how many, default 12), or checks an existing replay directory
# given as $1. AIPerf is installed from PyPI by name into a virtualenv at
# ${XDG_CACHE_HOME:-~/.cache}/agentrace/aiperf-venv when missing. AGENTRACE=path picks the
# binary (default: a release build made here).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${XDG_CACHE_HOME:-$HOME/.cache}/agentrace/aiperf-venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import aiperf' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet aiperf
fi

if [ $# -ge 1 ]; then
    run="$1"
else
    # shellcheck source=lib/bench-common.sh
    source scripts/lib/bench-common.sh
    dataset="${DATASET:-../shared/datasets/mlperf_agentic_coding_sample.jsonl}"
    [ -f "$dataset" ] || { echo "$bench_name: no dataset at $dataset (DATASET=...)" >&2; exit 2; }
    "$bin" --log-format json sim --listen 127.0.0.1:0 --time-scale 0.05 >"$work/sim.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 600); do
        grep -q '"addr"' "$work/sim.log" && break
        sleep 0.1
    done
    addr="$(grep -o '"addr":"[^"]*"' "$work/sim.log" | head -1 | cut -d'"' -f4)"
    wait_http "http://$addr/v1/models"
    run="$work/run"
    "$bin" replay --target "http://$addr" --dataset "$dataset" --concurrency 4 \
        --num-trajectories "${TRAJECTORIES:-12}" --time-scale 0.01 --no-progress \
        --out "$run" >/dev/null
fi

"$venv/bin/python" - "$run" <<'PY'
import json, sys
import numpy as np
from aiperf.metrics.derived_latency import _array_to_metric_result

run = sys.argv[1]
ours = json.load(open(f"{run}/result_summary.json"))["agentic_metrics"]["inferencex_aiperf"]
records = [json.loads(l) for l in open(f"{run}/turns.jsonl")]
# AIPerf's records: successful requests with output tokens, latency in ms per output token.
ok = [r for r in records if r["tracked"] and r["kind"] == "ok" and r["output_tokens"] > 0]
ms_per_token = np.array(
    [(r["complete_ns"] - r["issued_ns"]) / 1e6 / r["output_tokens"] for r in ok], dtype=np.float64
)
res = _array_to_metric_result(
    tag="e2e_latency_per_output_token", header="E2E latency / OSL", unit="ms", values_ms=ms_per_token
)
bad = 0
print(f"records {len(ok)} (agentrace: {ours['requests']})")
if len(ok) != ours["requests"]:
    bad += 1
for p, value in (("p90", res.p90), ("p75", res.p75)):
    theirs = 1000.0 / value
    mine = ours[f"e2e_normalized_interactivity_{p}"]
    same = abs(theirs - mine) <= 1e-9 * abs(theirs)
    bad += not same
    print(f"E2E normalized interactivity {p}: aiperf {theirs:.9f}  agentrace {mine:.9f}  {'equal' if same else 'DIFFERENT'}")
# Not the same figure, shown for scale: AIPerf's e2e_output_token_throughput, the p90 of the
# per-request rate OSL / latency.
rate = _array_to_metric_result(
    tag="e2e_output_token_throughput", header="OSL / latency", unit="tok/s", values_ms=1000.0 / ms_per_token
)
print(f"(for scale, not compared: p90 of per-request OSL/latency {rate.p90:.3f} tok/s/user)")
sys.exit(1 if bad else 0)
PY
