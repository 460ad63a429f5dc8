#!/usr/bin/env bash
# Export time and peak RSS of a fleet capture (3 replica directories of 10,000 exchanges each)
# against the same 30,000 exchanges in one directory, measured in the same run with
# /usr/bin/time -v (Debian: apt-get install time). Prints the machine load first.
set -euo pipefail
cd "$(dirname "$0")/.."
uptime
nice -n 5 cargo bench --bench capture -- fleet
