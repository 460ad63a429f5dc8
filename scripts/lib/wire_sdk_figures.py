"""Figures of one SDK run through the proxy: the loops' per-turn lines (stdin of the run's
files), the proxy's metrics and the capture's records. Prints one JSON object.

Usage: wire_sdk_figures.py LABEL TURNS_JSONL METRICS_TXT CAPTURE_CAT_JSONL EXPORT_STDOUT
"""
import json
import re
import sys

label, turns_path, metrics_path, cat_path, export_path = sys.argv[1:6]
turns = [json.loads(l) for l in open(turns_path) if l.startswith("{")]
metrics = open(metrics_path).read()
records = [json.loads(l) for l in open(cat_path) if l.startswith("{")]
exported = open(export_path).read()


def pct(values, p):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


out = {"label": label}
for api in ("messages", "responses"):
    mine = [t for t in turns if t["api"] == api]
    sessions = {}
    for t in mine:
        sessions.setdefault(t["session"], set()).add(t.get("pod"))
    pinned = sum(1 for pods in sessions.values() if len(pods) == 1 and None not in pods)
    out[api] = {"turns_sent": len(mine), "failed": sum(1 for t in mine if "failed" in t),
                "sessions": len(sessions), "sessions_pinned": pinned}
moves = {m.group(1): int(m.group(2)) for m in
         re.finditer(r'agentrace_affinity_moves_total\{reason="(\w+)"\} (\d+)', metrics)}
out["moves"] = moves
m = re.search(r"(\d+) client turns", exported)
out["turns_exported"] = int(m.group(1)) if m else None
# Client TTFT minus captured first-token time, streamed turns in arrival order (the loops are
# sequential, so the n-th streamed record is the n-th streamed turn).
client = [t["ttft_s"] for t in turns if t.get("ttft_s") is not None]
captured = [r["t"]["first_token_us"] / 1e6 for r in records
            if r.get("t", {}).get("first_token_us") is not None]
if len(client) == len(captured):
    diff = [(c - r) * 1e3 for c, r in zip(client, captured)]
    out["ttft_client_minus_capture_ms"] = {"n": len(diff), "p50": pct(diff, 50), "p99": pct(diff, 99)}
else:
    out["ttft_client_minus_capture_ms"] = {"unmatched": [len(client), len(captured)]}
print(json.dumps(out))
