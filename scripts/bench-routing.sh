#!/usr/bin/env bash
# Placement against the cache-aware routers people deploy: agentrace's default session policy,
# SMG (cache_aware, consistent_hashing) and the vLLM router (cache_aware, consistent_hash),
# each in front of its own fresh `agentrace sim` cluster, replaying the same dataset
# closed-loop. Prints one row per router and run: prefix-cache hit rate and server TTFT
# mean/p90 (from the replicas' own counters and histogram, simulated time; p90 interpolated
# within its bucket as Prometheus' histogram_quantile does), the p90 time requests waited for
# a batch slot (the queueing part of that tail), client TTFT p50/p90, system_tps, the slowest
# user's tokens/s, requests per replica and failures; with RUNS > 1, then the median and the
# worst run of each router.
#
#   scripts/bench-routing.sh DATASET [REPLICAS=4] [KV_BLOCKS=5000] [CONCURRENCY=20] [HEADER=1]
#
# DATASET `standard` replays the standard set (generated when missing); TRAJECTORIES=48 takes
# a slice of it. HEADER=0 replays without any session header (fingerprint vs the peers' prefix
# trees). RUNS=3 repeats every router on a new cluster (new ports, so new backend names and a
# new draw of hash luck). TIME_SCALE (default 0.02) scales the simulated time and delays.
# ROUTERS="agentrace:session smg:cache_aware ..." picks the rows; `direct:balanced` adds a row
# with no router at all, each replica replayed by its own client with the conversations split
# evenly ahead of time (a split no router can make, as it knows every conversation's length;
# it never moves one; DATASET a file, whole; no client columns, as its clients' figures do not
# add up); AGENTRACE_CONFIG=file.toml
# gives agentrace's proxy a config file (its `[affinity]`, say) under the flags. The proxy's
# active window (`affinity.active_secs`, 20 s) is scaled by TIME_SCALE like every simulated
# time, unless that file sets it: unscaled, sessions that ended would count as live context
# for 1,000 simulated seconds, most of a run. The peers are
# installed from PyPI into a virtualenv at ${XDG_CACHE_HOME:-~/.cache}/agentrace/bench-venv
# when missing. AGENTRACE=path/to/agentrace picks the binary (default: target/release/agentrace,
# built).
set -euo pipefail
cd "$(dirname "$0")/.."
dataset="${1:?usage: scripts/bench-routing.sh DATASET [REPLICAS] [KV_BLOCKS] [CONCURRENCY] [HEADER]}"
replicas="${2:-4}"
blocks="${3:-5000}"
conc="${4:-20}"
header="${5:-1}"
runs="${RUNS:-1}"
scale="${TIME_SCALE:-0.02}"
routers="${ROUTERS:-agentrace:session agentrace:round_robin smg:cache_aware smg:consistent_hashing vllm:cache_aware vllm:consistent_hash}"
venv="${XDG_CACHE_HOME:-$HOME/.cache}/agentrace/bench-venv"
if [ ! -x "$venv/bin/smg" ] || [ ! -x "$venv/bin/vllm-router" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet smg vllm-router
fi
# shellcheck source=scripts/lib/bench-common.sh
. scripts/lib/bench-common.sh

dataset_args=(--dataset "$dataset")
[ "$dataset" = standard ] && dataset_args=()
[ -n "${TRAJECTORIES:-}" ] && dataset_args+=(--num-trajectories "$TRAJECTORIES")
# Splits dataset file $1 into $2 files $3<i>.jsonl of whole conversations: longest (most client
# turns) first, each to the part with the fewest conversations so far, ties to the fewest
# turns. Prints each part's conversation count, one a line.
split_balanced() {
    python3 - "$@" <<'PY'
import json, sys
src, n, prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = {}
for line in open(src):
    row = json.loads(line)
    rows.setdefault(row["conversation_id"], []).append((row["role"], line))
turns = {c: sum(role != "assistant" for role, _ in r) for c, r in rows.items()}
parts = [[] for _ in range(n)]
for c in sorted(turns, key=lambda c: -turns[c]):
    i = min(range(n), key=lambda i: (len(parts[i]), sum(turns[x] for x in parts[i])))
    parts[i].append(c)
if not all(parts):
    sys.exit(f"direct:balanced: {len(rows)} conversations cannot fill {n} replicas")
for i, part in enumerate(parts):
    with open(f"{prefix}{i}.jsonl", "w") as f:
        f.writelines(line for c in part for _, line in rows[c])
    print(len(part))
PY
}
for router in $routers; do
    case "$router" in
        agentrace:* | smg:* | vllm:*) ;;
        direct:balanced)
            [ -f "$dataset" ] && [ -z "${TRAJECTORIES:-}" ] \
                || { echo "$bench_name: direct:balanced needs a dataset file, whole" >&2; exit 2; }
            ;;
        *) echo "$bench_name: unknown router $router (agentrace:, smg:, vllm:POLICY or direct:balanced)" >&2; exit 2 ;;
    esac
done
rows="$work/rows.tsv"
: >"$rows"

echo "# $(basename "$dataset")${TRAJECTORIES:+ ($TRAJECTORIES trajectories)}, $replicas replicas x $blocks KV blocks, concurrency $conc, session header: $header, time scale $scale, $runs run(s); $(uptime)"
printf '%-28s %6s %9s %9s %9s %9s %9s %9s %9s  %-24s %s\n' router hit ttft_mean ttft_p90 queue_p90 cli_p50 cli_p90 sys_tps slow_tps per_replica failures
for _ in $(seq "$runs"); do
for router in $routers; do
    kind="${router%%:*}"
    policy="${router#*:}"
    "$bin" --log-format json sim --replicas "$replicas" --listen 127.0.0.1:0 --time-scale "$scale" \
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
    port="$(free_port)"
    case "$kind" in
        agentrace)
            # Backends named host:port, as `--backend URL` names them, after AGENTRACE_CONFIG.
            active="$(python3 -c "print(20 * $scale)")"
            { if [ -n "${AGENTRACE_CONFIG:-}" ]; then
                  if grep -q '^active_secs' "$AGENTRACE_CONFIG"; then
                      cat "$AGENTRACE_CONFIG"
                  elif grep -q '^\[affinity\]' "$AGENTRACE_CONFIG"; then
                      sed "/^\[affinity\]/a active_secs = $active" "$AGENTRACE_CONFIG"
                  else
                      cat "$AGENTRACE_CONFIG"; printf '[affinity]\nactive_secs = %s\n' "$active"
                  fi
              else
                  printf '[affinity]\nactive_secs = %s\n' "$active"
              fi
              for a in "${addrs[@]}"; do printf '[[backends]]\nname = "%s"\nurl = "http://%s"\n' "$a" "$a"; done
            } >"$work/proxy.toml"
            "$bin" proxy -c "$work/proxy.toml" --listen "127.0.0.1:$port" --admin-listen 127.0.0.1:0 \
                --policy "$policy" >"$work/router.log" 2>&1 &
            ;;
        smg)
            "$venv/bin/smg" launch --host 127.0.0.1 --port "$port" --worker-urls "${urls[@]}" \
                --policy "$policy" --disable-tokenizer-autoload \
                --prometheus-port "$(free_port)" >"$work/router.log" 2>&1 &
            ;;
        vllm)
            "$venv/bin/vllm-router" --host 127.0.0.1 --port "$port" --worker-urls "${urls[@]}" \
                --policy "$policy" >"$work/router.log" 2>&1 &
            ;;
    esac
    if [ "$kind" != direct ]; then
        pids+=($!)
        (wait_http "http://127.0.0.1:$port/v1/models") || { cat "$work/router.log" >&2; exit 1; }
    fi
    out="$work/$kind-$policy"
    rm -rf "$out"
    # Without a header the replayer's default (X-Session-ID) must be emptied by a config.
    printf 'routing_headers = []\n' >"$work/no-header.toml"
    routing=(--config "$work/no-header.toml")
    [ "$header" = 1 ] && routing=(--routing-header x-session-id)
    status=0
    if [ "$kind" = direct ]; then
        # No router: each replica replayed by its own client over its part of split_balanced.
        mapfile -t shares < <(split_balanced "$dataset" "${#urls[@]}" "$work/part")
        [ "${#shares[@]}" -eq "${#urls[@]}" ] || exit 2
        replays=()
        summaries=""
        for i in "${!urls[@]}"; do
            "$bin" replay --target "${urls[$i]}" --dataset "$work/part$i.jsonl" --model-name "$model" \
                --concurrency "${shares[$i]}" --delays false --time-scale "$scale" "${routing[@]}" \
                --no-progress --out "$out/$i" >"$work/replay$i.log" 2>&1 &
            replays+=($!)
            summaries+="${summaries:+:}$out/$i/result_summary.json"
        done
        for i in "${!replays[@]}"; do
            wait "${replays[$i]}" || { status=$?; tail -3 "$work/replay$i.log" >&2; }
        done
    else
        summaries="$out/result_summary.json"
        "$bin" replay --target "http://127.0.0.1:$port" "${dataset_args[@]}" --model-name "$model" \
            --concurrency "$conc" --delays false --time-scale "$scale" "${routing[@]}" --no-progress \
            --out "$out" >"$work/replay.log" 2>&1 || { status=$?; tail -3 "$work/replay.log" >&2; }
    fi
    for u in "${urls[@]}"; do curl -fs "$u/metrics"; echo "# end"; done >"$work/metrics.txt"
    # agentrace's own account of its decisions (hash, placed, spill, ...), after the failures.
    : >"$work/decisions.txt"
    if [ "$kind" = agentrace ]; then
        admin="$(grep -o 'admin [0-9.:]*' "$work/router.log" | cut -d' ' -f2)"
        curl -fs "http://$admin/metrics" | grep '^agentrace_affinity_decisions_total' >"$work/decisions.txt" || true
    fi
    python3 - "$summaries" "$work/metrics.txt" "$kind:$policy" "$status" "$rows" "$work/decisions.txt" <<'PY'
import json, re, sys
summary, metrics, name, status, rows, decisions = sys.argv[1:]
outcomes = {}
for line in open(decisions):
    o = re.search(r'outcome="([^"]+)"', line).group(1)
    outcomes[o] = outcomes.get(o, 0) + int(float(line.rsplit(" ", 1)[1]))
hits = queries = 0.0
per, tsum, tcount = [], 0.0, 0.0
# Histograms summed over the replicas: TTFT, and the part of it spent waiting for a batch slot.
buckets = {"vllm:time_to_first_token_seconds": {}, "vllm:request_queue_time_seconds": {}}
for block in open(metrics).read().split("# end"):
    n = 0.0
    for line in block.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        v = float(value)
        if key.startswith("vllm:prefix_cache_hits_total"): hits += v
        elif key.startswith("vllm:prefix_cache_queries_total"): queries += v
        elif key.startswith("vllm:request_success_total"): n += v
        elif key.startswith("vllm:time_to_first_token_seconds_sum"): tsum += v
        elif key.startswith("vllm:time_to_first_token_seconds_count"): tcount += v
        elif "_bucket{" in key and key.split("_bucket{")[0] in buckets:
            le = re.search(r'le="([^"]+)"', key).group(1)
            into = buckets[key.split("_bucket{")[0]]
            into[le] = into.get(le, 0.0) + v
    if block.strip():
        per.append(int(n))
def p90_of(hist):
    """As Prometheus' histogram_quantile: linear within the bucket the 90th percentile falls in."""
    ranked = sorted((float(k), c) for k, c in hist.items())
    total = ranked[-1][1] if ranked else 0.0
    lower = below = 0.0
    for le, c in ranked:
        if total and c >= 0.9 * total:
            return le if le == float("inf") else lower + (le - lower) * (0.9 * total - below) / max(c - below, 1e-9)
        lower, below = le, c
    return float("nan")
p90 = p90_of(buckets["vllm:time_to_first_token_seconds"])
queue_p90 = p90_of(buckets["vllm:request_queue_time_seconds"])
try:
    parts = [json.load(open(p)) for p in summary.split(":")]
    s = parts[0]
    t = s["ttft"]["percentiles"]
    cli = (t["50.0"] / 1e6, t["90.0"] / 1e6)
    m = s["metrics"]
    tps = m["system_tps"]
    slow = min(p["metrics"]["per_user"]["tokens_per_s"]["min"] for p in parts)
    failures = sum(p["n_samples_failed"] for p in parts)
    if len(parts) > 1:
        # One client per replica: their percentiles and token rates do not add up.
        cli, tps = (float("nan"),) * 2, float("nan")
except Exception as e:
    cli, tps, slow, failures = (float("nan"),) * 2, float("nan"), float("nan"), f"replay exit {status}: {e}"
hit, mean = hits / max(queries, 1), 1000 * tsum / max(tcount, 1)
print(f"{name:<28} {hit:6.3f} {mean:7.0f}ms {1000 * p90:7.0f}ms {1000 * queue_p90:7.0f}ms "
      f"{cli[0]:7.0f}ms {cli[1]:7.0f}ms {tps:9.1f} {slow:9.1f}  {'/'.join(map(str, per)):<24} {failures}"
      + "".join(f" {o}={n}" for o, n in sorted(outcomes.items())))
with open(rows, "a") as f:
    f.write(f"{name}\t{hit}\t{mean}\t{1000 * p90}\t{1000 * queue_p90}\t{tps}\t{slow}\n")
PY
    stop_all
done
done
[ "$runs" -gt 1 ] || exit 0
# Median and worst run per router: the lowest hit rate and tokens/s, the highest TTFT and wait.
python3 - "$rows" <<'PY'
import statistics, sys
by = {}
for line in open(sys.argv[1]):
    name, *v = line.rstrip("\n").split("\t")
    by.setdefault(name, []).append([float(x) for x in v])
print(f"\n{'median|worst of ' + str(len(next(iter(by.values())))) + ' runs':<28}"
      f" {'hit':>13} {'ttft_mean':>17} {'ttft_p90':>17} {'queue_p90':>17} {'sys_tps':>17} {'slow_tps':>15}")
for name, runs in by.items():
    cols = list(zip(*runs))
    cell = []
    for i, (width, worst) in enumerate([(6, min), (8, max), (8, max), (8, max), (8, min), (7, min)]):
        fmt = (lambda x: f"{x:.3f}") if i == 0 else (lambda x: f"{x:.0f}")
        unit = "ms" if i in (1, 2, 3) else ""
        med, bad = fmt(statistics.median(cols[i])) + unit, fmt(worst(cols[i])) + unit
        cell.append(f"{med:>{width}}|{bad:<{width}}")
    print(f"{name:<28} " + " ".join(cell))
PY
