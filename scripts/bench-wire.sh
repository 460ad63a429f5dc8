#!/usr/bin/env bash
# Figures for every agent's wire (Anthropic Messages, OpenAI Responses): sessions pinned by
# fingerprint without a header, lost caches noticed from each API's usage, turns exported
# against turns sent, the recorded first token against the client's, and chains continued
# by previous_response_id over four backends, failed when sent round robin straight to the
# backends against through agentrace (round robin too: only the response ids keep a chain).
#
#   scripts/bench-wire.sh [SESSIONS_PER_API]     (default 16)
#
# Prints the machine's load and one JSON line of figures. Counts, not speed: a debug build
# serves.
set -euo pipefail
cd "$(dirname "$0")/.."
uptime
WIRE_SESSIONS="${1:-16}" nice cargo test --test wire_apis wire_figures -- --ignored --nocapture 2>/dev/null \
  | grep '^{'
uptime
