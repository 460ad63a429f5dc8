#!/usr/bin/env bash
# Export time and peak RSS of a capture spread over 1, 3 and 10 replica directories, measured
# with /usr/bin/time -v (Debian: apt-get install time). Prints the machine load first.
# Usage: scripts/bench-capture-fleet.sh [WAVES] [BEFORE_BIN]
#   WAVES: batches of sessions recorded one after another (default 1), to show memory does
#          not grow with the capture.
#   BEFORE_BIN: another agentrace binary (an earlier commit's release build) that exports the
#          same captures in the same run, for an after/before ratio.
# Environment: FLEET_REPLICAS (1,3,10), FLEET_SESSIONS (5000), FLEET_TURNS (12): the peak RSS
# of an export grew with sessions x replicas before the export kept one budget for all.
set -euo pipefail
cd "$(dirname "$0")/.."
uptime
export FLEET_WAVES="${1:-1}"
export FLEET_REPLICAS="${FLEET_REPLICAS:-1,3,10}"
export FLEET_SESSIONS="${FLEET_SESSIONS:-5000}"
export FLEET_TURNS="${FLEET_TURNS:-12}"
if [ -n "${2:-}" ]; then
  export FLEET_BEFORE_BIN="$(realpath "$2")"
fi
nice -n 5 cargo bench --bench capture -- fleet
uptime
