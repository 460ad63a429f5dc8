#!/usr/bin/env bash
# Session affinity against round-robin on two llama-servers (scripts/real-engine.sh builds
# them): the same workflow conversations replayed through agentrace's proxy under each
# policy, RUNS times each, fresh servers every run. Prints one row per run: mean and p90 TTFT,
# the cached share of prompt tokens, the prompt tokens the servers evaluated, system_tps,
# moves (turns the proxy sent elsewhere than the session's previous turn, from its capture)
# and how many of the two servers' KV cache sizes the proxy knew when the replay started.
#
#   scripts/bench-real-engine.sh [CONVERSATIONS=6] [RUNS=3] [CONCURRENCY=4] [SYSTEM_CHARS]
#
# Each server gets CONCURRENCY/2 slots (rounded up) of 24576 tokens each. SYSTEM_CHARS cuts each
# conversation's system prompt (35 KB in the synthetic workflow set) to its first that many
# characters, for a machine too slow or too busy to prefill it under round-robin.
#
# AGENTRACE=path/to/agentrace picks the binary (default: target/release/agentrace, built).
set -euo pipefail
cd "$(dirname "$0")/.."
convs="${1:-6}"
runs="${2:-3}"
concurrency="${3:-4}"
system_chars="${4:-}"
slots=$(( (concurrency + 1) / 2 ))
cache="${AGENTRACE_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrace/real-engine}"
if [ ! -f "$cache/env" ]; then
    echo "bench-real-engine.sh: no $cache/env; run scripts/real-engine.sh first" >&2
    exit 2
fi
# shellcheck disable=SC1091
. "$cache/env"
# shellcheck source=scripts/lib/bench-common.sh
. scripts/lib/bench-common.sh

start_engine() {
    "$AGENTRACE_LLAMA_SERVER" --model "$AGENTRACE_TINY_GGUF" --host 127.0.0.1 --port 0 \
        --jinja --metrics --parallel "$slots" --ctx-size $(( 24576 * slots )) --threads 1 --alias tiny \
        >"$1" 2>&1 &
    # Called in a command substitution, whose `pids` the script never sees: the caller reads
    # the PID from here, so every server is stopped with the run.
    echo $! >"$1.pid"
    local addr
    addr="$(address_in_log "$1" "listening on http://")"
    until curl -fs "http://$addr/health" >/dev/null; do sleep 0.1; done
    echo "$addr"
}

# Waits (up to 10 s) until the proxy at admin address $1 has asked every backend for its KV
# cache size (a build without `kv_cache_source` has nothing to wait for), and prints how many
# it knows.
kv_known() {
    python3 - "$1" <<'PY'
import json, sys, time, urllib.request
url = f"http://{sys.argv[1]}/admin/backends"
for _ in range(100):
    backends = json.load(urllib.request.urlopen(url))["backends"]
    if all(b.get("kv_cache_source") != "pending" for b in backends):
        break
    time.sleep(0.1)
print(sum(1 for b in backends if b.get("kv_cache_tokens", 0) > 0))
PY
}

# Turns sent to another backend than their session's previous turn, in capture directory $1.
moves() {
    "$bin" capture cat "$1" | python3 -c '
import json, sys
records = [json.loads(l) for l in sys.stdin if l.strip()]
records = [r for r in records if "backend" in r and r.get("session")]
last, moves = {}, 0
for r in sorted(records, key=lambda r: r["id"]):
    before = last.get(r["session"])
    moves += before is not None and before != r["backend"]
    last[r["session"]] = r["backend"]
print(moves)'
}

prompt_tokens() {
    curl -fs "http://$1/metrics" | awk '/^llamacpp:prompt_tokens_total /{print $2}'
}

"$bin" dataset synth --coding 0 --workflow "$convs" --out "$work/workflow.jsonl" >/dev/null
if [ -n "$system_chars" ]; then
    python3 - "$work/workflow.jsonl" "$system_chars" <<'PY'
import json, sys
path, keep = sys.argv[1], int(sys.argv[2])
rows = [json.loads(line) for line in open(path)]
for row in rows:
    if isinstance(row.get("system"), str):
        row["system"] = row["system"][:keep]
with open(path, "w") as out:
    out.writelines(json.dumps(row) + "\n" for row in rows)
PY
fi
cat >"$work/replay.toml" <<TOML
[model_params]
name = "tiny"
max_new_tokens = 16
temperature = 0.0
TOML

printf '%-12s %3s %10s %10s %8s %12s %10s %6s %8s\n' policy run ttft_mean ttft_p90 cached prompt_eval system_tps moves kv_known
for policy in session round_robin; do
    for run in $(seq "$runs"); do
        a="$(start_engine "$work/a.log")"
        b="$(start_engine "$work/b.log")"
        pids+=("$(cat "$work/a.log.pid")" "$(cat "$work/b.log.pid")")
        capture="$work/capture-$policy-$run"
        "$bin" proxy --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --policy "$policy" \
            --backend "a=http://$a" --backend "b=http://$b" --capture "$capture" \
            >"$work/proxy.log" 2>&1 &
        pids+=($!)
        proxy="$(address_in_log "$work/proxy.log" "agentrace proxy listening on ")"
        admin="$(address_in_log "$work/proxy.log" "(admin ")"
        admin="${admin%)}"
        known="$(kv_known "$admin")"
        out="$work/$policy-$run"
        "$bin" replay --config "$work/replay.toml" --target "http://$proxy" \
            --dataset "$work/workflow.jsonl" --concurrency "$concurrency" --delays false --salt false \
            --no-progress --out "$out" >"$work/replay.log" 2>&1 || {
            echo "replay failed:" >&2; tail -5 "$work/replay.log" >&2; exit 1; }
        evaluated=$(( $(prompt_tokens "$a" | cut -d. -f1) + $(prompt_tokens "$b" | cut -d. -f1) ))
        # The proxy finishes its capture as it stops.
        stop_all
        python3 - "$out/result_summary.json" "$policy" "$run" "$evaluated" "$(moves "$capture")" "$known" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
m, t = s["metrics"], s["ttft"]
ms = lambda ns: ns / 1e6
print(f"{sys.argv[2]:<12} {sys.argv[3]:>3} {ms(t['avg']):>8.1f}ms {ms(t['percentiles']['90.0']):>8.1f}ms "
      f"{(m.get('cached_token_ratio') or 0) * 100:>7.1f}% {int(sys.argv[4]):>12} {s['tps']:>10.1f} "
      f"{sys.argv[5]:>6} {sys.argv[6]:>8}")
PY
    done
done
