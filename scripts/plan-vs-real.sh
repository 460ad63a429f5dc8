#!/usr/bin/env bash
# The plan's prediction beside a real run: llama-servers (scripts/real-engine.sh builds them)
# are calibrated, `agentrace plan` predicts 1 and 2 replicas under session affinity and
# round-robin at time scale 1, then the same dataset is replayed for real through
# `agentrace proxy` in front of that many fresh llama-servers. Prints, per replica count and
# policy, predicted and measured TTFT p50/p90, per-user output rate (e2e interactivity),
# system output tokens/s and the prefix-cache hit (the replay's cached_token_ratio, from the
# servers' usage on both sides), the ratio predicted/measured per cell, and `uptime`.
#
#   scripts/plan-vs-real.sh [CONVERSATIONS=4] [SLOTS=4] [SYSTEM_CHARS=1500] [MAX_NEW_TOKENS=8]
#
# Output lengths match on both sides: every row asks for MAX_NEW_TOKENS, the llama-servers run
# with --ignore-eos and the simulated replicas cut the (longer) recorded replies to it.
# AGENTRACE=path/to/agentrace picks the binary (default: target/release/agentrace, built);
# KEEP=DIR keeps the profile, the plan and the real runs' outputs there.
set -euo pipefail
cd "$(dirname "$0")/.."
convs="${1:-4}"
slots="${2:-4}"
system_chars="${3:-1500}"
max_new="${4:-8}"
cache="${AGENTRACE_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrace/real-engine}"
if [ ! -f "$cache/env" ]; then
    echo "plan-vs-real.sh: no $cache/env; run scripts/real-engine.sh first" >&2
    exit 2
fi
# shellcheck disable=SC1091
. "$cache/env"
# shellcheck source=scripts/lib/bench-common.sh
. scripts/lib/bench-common.sh

start_engine() {
    "$AGENTRACE_LLAMA_SERVER" --model "$AGENTRACE_TINY_GGUF" --host 127.0.0.1 --port 0 \
        --jinja --metrics --parallel "$slots" --ctx-size $(( 8192 * slots )) --threads 1 \
        --alias tiny --ignore-eos >"$1" 2>&1 &
    echo $! >"$1.pid"
    local addr
    addr="$(address_in_log "$1" "listening on http://")"
    until curl -fs "http://$addr/health" >/dev/null; do sleep 0.1; done
    echo "$addr"
}

# The workflow conversations, system prompts cut to SYSTEM_CHARS, no tool schemas, every
# row asking for MAX_NEW_TOKENS.
"$bin" dataset synth --coding 0 --workflow "$convs" --out "$work/raw.jsonl" >/dev/null
python3 - "$work/raw.jsonl" "$work/dataset.jsonl" "$system_chars" "$max_new" <<'PY'
import json, sys
src, dst, keep, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with open(dst, "w") as out:
    for line in open(src):
        row = json.loads(line)
        if isinstance(row.get("system"), str):
            row["system"] = row["system"][:keep]
        row.pop("tools", None)
        if row.get("role") == "user":
            row["max_new_tokens"] = max_new
        out.write(json.dumps(row) + "\n")
PY
cat >"$work/replay.toml" <<TOML
[model_params]
name = "tiny"
temperature = 0.0
TOML

echo "calibrating ($(uptime))" >&2
a="$(start_engine "$work/cal.log")"
pids+=("$(cat "$work/cal.log.pid")")
"$bin" sim calibrate --target "http://$a" --model tiny --max-prompt-tokens 2048 \
    --out "$work/profile.toml" >"$work/calibrate.log" 2>&1 || {
    echo "calibration failed:" >&2; tail -5 "$work/calibrate.log" >&2; exit 1; }
stop_all

echo "planning ($(uptime))" >&2
"$bin" plan --dataset "$work/dataset.jsonl" --profile "$work/profile.toml" --replicas 1,2 \
    --policies affinity,round_robin --time-scale 1 --no-progress --out "$work/plan" \
    >"$work/plan.log" 2>&1 || { echo "plan failed:" >&2; tail -5 "$work/plan.log" >&2; exit 1; }

for policy in session round_robin; do
    name=$([ "$policy" = session ] && echo affinity || echo round_robin)
    for replicas in 1 2; do
        echo "real: $name, $replicas replicas ($(uptime))" >&2
        backends=()
        for r in $(seq "$replicas"); do
            addr="$(start_engine "$work/e$r.log")"
            pids+=("$(cat "$work/e$r.log.pid")")
            backends+=(--backend "e$r=http://$addr")
        done
        "$bin" proxy --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --policy "$policy" \
            "${backends[@]}" >"$work/proxy.log" 2>&1 &
        pids+=($!)
        proxy="$(address_in_log "$work/proxy.log" "agentrace proxy listening on ")"
        "$bin" replay --config "$work/replay.toml" --target "http://$proxy" \
            --dataset "$work/dataset.jsonl" --concurrency "$convs" --delays true --salt true \
            --no-progress --out "$work/real/$name-r$replicas" >"$work/replay.log" 2>&1 || {
            echo "replay failed:" >&2; tail -5 "$work/replay.log" >&2; exit 1; }
        stop_all
    done
done

python3 - "$work" <<'PY'
import glob, json, os, sys
work = sys.argv[1]
def figures(path):
    s = json.load(open(path))
    m, t = s["metrics"], s["ttft"]["percentiles"]
    return {
        "ttft_p50_ms": t["50.0"] / 1e6,
        "ttft_p90_ms": t["90.0"] / 1e6,
        "user_tok_s": m["e2e_interactivity"],
        "system_tok_s": m["system_tps"],
        "cache_hit": m.get("cached_token_ratio") or 0.0,
        "failed": m["turns"]["failed"] if isinstance(m.get("turns"), dict) else 0,
    }
cols = ["ttft_p50_ms", "ttft_p90_ms", "user_tok_s", "system_tok_s", "cache_hit"]
print(f"{'combination':<16} " + " ".join(f"{c:>24}" for c in cols))
print(f"{'':<16} " + " ".join(f"{'plan / real (ratio)':>24}" for _ in cols))
worst = 0.0
for name in ["affinity-r1", "affinity-r2", "round_robin-r1", "round_robin-r2"]:
    plan_dir = glob.glob(os.path.join(work, "plan", "runs", name + "-kv*"))[0]
    p = figures(os.path.join(plan_dir, "result_summary.json"))
    r = figures(os.path.join(work, "real", name, "result_summary.json"))
    cells = []
    for c in cols:
        ratio = p[c] / r[c] if r[c] else float("nan")
        if ratio == ratio:
            worst = max(worst, abs(ratio - 1))
        cells.append(f"{p[c]:>8.3g} /{r[c]:>8.3g} ({ratio:4.2f})")
    print(f"{name:<16} " + " ".join(f"{x:>24}" for x in cells))
print(f"worst cell off by {100 * worst:.0f}%")
PY
if [ -n "${KEEP:-}" ]; then
    mkdir -p "$KEEP" && cp -r "$work/profile.toml" "$work/dataset.jsonl" "$work/plan" "$work/real" "$KEEP/"
fi
echo "profile fit: $(grep -E 'prefill_max_error_pct|decode_max_error_pct' "$work/profile.toml" | tr '\n' ' ')"
uptime
