#!/usr/bin/env bash
# Hostile-input benchmark (benches/hostile/): each attack (session-keys, big-bodies,
# interim-storm, slowloris, idle-conns, h2-idle-no-ack, h2-rapid-reset, tls-handshakes,
# replay-endless-sse, validate-long-line, self-loop, early-413; against `agentrace epp`:
# epp-idle-conns, epp-fd-limit, epp-big-bodies, epp-unanswered, epp-malformed, epp-sequential,
# pool-rewatch, pool-bookmarks, pool-metrics) against a fresh agentrace process, with its peak
# RSS, descriptors, CPU, what the attackers got, what reached the backend and a probe client's
# p50/p99 through the proxy (or the picker) meanwhile.
# Usage: scripts/bench-hostile.sh [--bin PATH] [--compare OTHER_BIN] [--peer haproxy|nginx]... [--proxy-config FILE]
#        [--only NAME,...] [--json PATH] [--scale F] [per-attack flags, see benches/hostile/main.rs]
# --bin defaults to target/release/agentrace, built by this script; --compare runs every attack
# against OTHER_BIN ("before") and --bin ("after") in turn and prints them side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
exec cargo bench --bench hostile -- "$@"
