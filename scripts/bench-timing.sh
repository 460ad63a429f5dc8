#!/usr/bin/env bash
# How true the replayer's stamps are, seen by the server: an observer server of our own
# (examples/timing_observer.rs) answers every turn with SSE events on a fixed script of pauses
# and logs on CLOCK_MONOTONIC when each request arrived (the kernel's receive time) and when it
# wrote each event. The replayer's events.jsonl is on the same clock, so the two join per
# conversation and turn. Prints, per binary and run:
#   - delay excess: how late a turn reached the server against its schedule, i.e. its first
#     bytes' arrival minus (the previous answer's last write + the turn's recorded delay);
#   - TTFT error: the replayer's TTFT (RECV_FIRST - ISSUED) minus the server's own (its first
#     event's write - the arrival of the request's last bytes);
# each at p50 and p99, over every turn with a delay (excess) and every turn (TTFT), and the
# TTFT error's p99 without each conversation's first turn (its connection's first answer);
# `kernel` counts the requests whose arrival the observer has from the kernel.
#
#   scripts/bench-timing.sh [RUNS=5] [CONCURRENCY=20] [DATASET=../shared/datasets/mlperf_agentic_coding_sample.jsonl]
#
# AGENTRACE=path picks the binary (default: target/release/agentrace, built); BEFORE=path adds
# its rows first, in the same run, for a comparison. TIME_SCALE (default 1) scales the recorded
# delays; FIRST_MS (20), GAP_MS (5) and EVENTS (8) script the observer's answers. The MLPerf
# reference client and AIPerf are reported as skipped: this script does not drive them.
# Print `uptime` beside the figures: on a loaded machine they measure the load as much as the
# client.
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-5}"
concurrency="${2:-20}"
dataset="${3:-../shared/datasets/mlperf_agentic_coding_sample.jsonl}"
scale="${TIME_SCALE:-1}"
[ -f "$dataset" ] || { echo "bench-timing: no dataset at $dataset" >&2; exit 1; }
# shellcheck source=scripts/lib/bench-common.sh
. scripts/lib/bench-common.sh

cargo build --quiet --example timing_observer
observer="${CARGO_TARGET_DIR:-target}/debug/examples/timing_observer"

echo "# $(uptime)"
echo "# dataset $dataset, concurrency $concurrency, time scale $scale, observer: first ${FIRST_MS:-20} ms, gap ${GAP_MS:-5} ms, ${EVENTS:-8} events"
for other in aiperf inference-endpoint; do
    if command -v "$other" >/dev/null; then
        echo "# $other is installed; this script does not drive it: skipped"
    else
        echo "# $other: not installed, skipped"
    fi
done
printf '%-28s %4s %6s %22s %22s %13s %8s\n' binary run turns "delay excess p50/p99" "TTFT error p50/p99" "p99 turns 2+" kernel

one_run() { # name binary run
    local name="$1" binary="$2" run="$3" dir="$work/$1-$3"
    mkdir -p "$dir"
    "$observer" "$dir/port" "${FIRST_MS:-20}" "${GAP_MS:-5}" "${EVENTS:-8}" >"$dir/server.jsonl" &
    local server=$!
    pids+=("$server")
    for _ in $(seq 600); do [ -s "$dir/port" ] && break; sleep 0.05; done
    [ -s "$dir/port" ] || { echo "bench-timing: the observer never listened" >&2; exit 1; }
    "$binary" replay --target "http://127.0.0.1:$(cat "$dir/port")" --dataset "$dataset" \
        --concurrency "$concurrency" --delays true --time-scale "$scale" --salt false \
        --no-progress --out "$dir/run" >"$dir/replay.log" 2>&1 \
        || { echo "bench-timing: $name replay failed:" >&2; tail "$dir/replay.log" >&2; exit 1; }
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    python3 - "$name" "$run" "$dataset" "$scale" "$dir/server.jsonl" "$dir/run/events.jsonl" <<'PY'
import json, sys
from collections import defaultdict
name, run, dataset, scale, server_log, events_log = sys.argv[1:]
scale = float(scale)
# Each conversation's client turns (user or tool rows) in order, with their recorded delay.
delays = defaultdict(list)
for line in open(dataset):
    row = json.loads(line)
    if row.get("role") in ("user", "tool"):
        delays[row["conversation_id"]].append((row["turn"], float(row.get("delay_seconds") or 0)))
for conv in delays:
    delays[conv].sort()
served = defaultdict(list)
for line in open(server_log):
    x = json.loads(line)
    served[x["session"]].append(x)
events = [json.loads(l) for l in open(events_log)]
by_uuid = defaultdict(dict)
for e in events:
    if e["event_type"] in ("sample.issued", "sample.recv_first", "sample.complete"):
        by_uuid[e["sample_uuid"]].setdefault(e["event_type"], e)
excess, ttft_err, ttft_later, kernel, seen = [], [], [], 0, defaultdict(int)
for e in events:
    if e["event_type"] != "sample.issued":
        continue
    conv = e["conversation_id"]
    k = seen[conv]
    seen[conv] += 1
    if k >= len(served[conv]):
        continue
    x = served[conv][k]
    kernel += bool(x["arrival_kernel"])
    source = conv.split("__repeat_")[0]
    delay = delays[source][k][1] * scale if k < len(delays[source]) else 0.0
    if k > 0 and delay > 0:
        prev_end = served[conv][k - 1]["end"][0]
        excess.append((x["arrival_first_ns"] - prev_end) / 1e6 - delay * 1e3)
    got = by_uuid[e["sample_uuid"]]
    if "sample.recv_first" in got and x["sends"]:
        client = got["sample.recv_first"]["timestamp_ns"] - e["timestamp_ns"]
        server = x["sends"][0][0] - x["arrival_last_ns"]
        ttft_err.append((client - server) / 1e6)
        if k > 0:
            ttft_later.append((client - server) / 1e6)
def pct(v, q):
    if not v:
        return float("nan")
    v = sorted(v)
    i = (len(v) - 1) * q
    lo = int(i)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (i - lo)
turns = sum(seen.values())
print(f"{name:<28} {run:>4} {turns:>6} {pct(excess, .5):>10.3f}/{pct(excess, .99):<8.3f}ms "
      f"{pct(ttft_err, .5):>10.3f}/{pct(ttft_err, .99):<8.3f}ms {pct(ttft_later, .99):>10.3f} ms "
      f"{kernel:>4}/{turns}")
PY
}

for run in $(seq "$runs"); do
    if [ -n "${BEFORE:-}" ]; then one_run "before:$(basename "$BEFORE")" "$BEFORE" "$run"; fi
    one_run "$(basename "$bin")" "$bin" "$run"
done
echo "# $(uptime)"
