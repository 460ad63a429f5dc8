#!/usr/bin/env bash
# Export time and peak RSS of a fleet capture (3 replica directories of 10,000 exchanges each)
# against the same 30,000 exchanges in one directory, measured in the same run with
# /usr/bin/time -v (Debian: apt-get install time). Prints the machine load first.
# Usage: scripts/bench-capture-fleet.sh [WAVES]  (WAVES batches of 1,500 sessions x 20 turns,
# one after another: 3 gives 3 x 30,000 exchanges, to show memory does not grow with them.)
set -euo pipefail
cd "$(dirname "$0")/.."
uptime
FLEET_WAVES="${1:-1}" nice -n 5 cargo bench --bench capture -- fleet
