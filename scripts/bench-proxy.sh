#!/usr/bin/env bash
# Proxy benchmark (benches/proxy.rs): 4 loopback backends, 1,000 session keys; requests/s and
# p50/p99 direct, through agentrace, nginx and HAProxy (those installed; HAProxy in TCP mode as
# the floor of what one more hop adds), closed loop and at fixed rates, with each proxy's CPU
# time per request; then an SSE run.
# Usage: scripts/bench-proxy.sh [--duration SECS] [--repeats N] [--loads 8,64] [--rates 2000,8000] [--sse-streams N]
#        [--sse-interval-us N] [--rust-client] [--only agentrace,nginx,haproxy,tcp-relay] [--workers N]
# Peers and wrk are optional: apt-get install -y wrk nginx haproxy
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"
for tool in wrk nginx haproxy; do
  if command -v "$tool" >/dev/null 2>&1; then
    echo "found $tool: $(command -v "$tool")"
  else
    echo "$tool not installed: its part is skipped"
  fi
done
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
exec cargo bench --bench proxy -- "$@"
