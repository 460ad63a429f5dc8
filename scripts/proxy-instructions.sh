#!/usr/bin/env bash
# Instructions agentrace executes per proxied request, counted by valgrind's callgrind: unlike
# req/s and CPU time, the count does not move with what else the machine is doing, so it shows
# whether a change to the forwarding path made it cheaper. Runs the proxy benchmark's
# 64-connection load through agentrace alone, counts a window of SECONDS after a warm-up, and
# prints instructions per request and the proxy functions that cost most (inclusive).
# Usage: scripts/proxy-instructions.sh [SECONDS]      needs: apt-get install -y valgrind wrk
set -euo pipefail
cd "$(dirname "$0")/.."
window=${1:-10}
for tool in valgrind callgrind_control callgrind_annotate wrk; do
  command -v "$tool" >/dev/null || { echo "$tool is not installed (apt-get install -y valgrind wrk)" >&2; exit 1; }
done
out=$(mktemp -d)
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
bench=$(cargo bench --bench proxy --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[ -x "$bench" ] || { echo "could not build the proxy benchmark" >&2; exit 1; }
# The direct target runs first for `duration` seconds, then agentrace: warm up 5 s, count `window`.
duration=$((window + 15))
"$bench" --only agentrace --loads 64 --duration "$duration" --repeats 1 --rates "" \
  --sse-streams 1 --wrap "valgrind --tool=callgrind --callgrind-out-file=$out/cg.%p" \
  >"$out/bench.txt" 2>&1 &
bench_pid=$!
sleep $((duration + 5))
callgrind_control --zero >/dev/null
sleep "$window"
callgrind_control --dump >/dev/null
wait "$bench_pid"
profile=$(ls "$out"/cg.*.1 2>/dev/null | head -1)
[ -n "$profile" ] || { echo "no callgrind dump in $out (see $out/bench.txt)" >&2; exit 1; }
callgrind_annotate --tree=calling --inclusive=yes "$profile" >"$out/tree.txt" 2>/dev/null
total=$(callgrind_annotate "$profile" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
requests=$(grep -E '>   .*routing::Router::route ' "$out/tree.txt" | head -1 |
  sed -E 's/.*\(([0-9,]+)x\).*/\1/' | tr -d ,)
[ -n "$requests" ] && [ "$requests" -gt 0 ] || { echo "no requests counted (see $out)" >&2; exit 1; }
echo "requests counted: $requests; instructions: $total; per request: $((total / requests))"
echo "costliest proxy functions, instructions per request (inclusive):"
callgrind_annotate --inclusive=yes "$profile" 2>/dev/null |
  sed -nE 's#^ *([0-9,]+) +\( *[0-9.]+%\) +([^ ]*/)?src/proxy/[a-z0-9_]+\.rs:(agentrace::proxy::[^ ]+).*#\1 \3#p' |
  awk -v n="$requests" '{c=$1; gsub(",", "", c); if (!seen[$2]++) printf "%8d  %s\n", c / n, $2}' |
  head -15
echo "profile: $profile"
