#!/usr/bin/env bash
# Runs the demo and photographs its index.html in headless Chromium (Debian: chromium), for
# docs/src/getting-started/demo-page.png. The page loads from disk with the network off; the command fails if the
# browser logs any console message.
#
# Usage: scripts/demo-screenshot.sh [OUT_PNG] [-- DEMO FLAGS]   (default docs/src/getting-started/demo-page.png)
# AGENTRACE_BIN runs a binary already built instead of `cargo run --release`.
set -euo pipefail
cd "$(dirname "$0")/.."
png="docs/src/getting-started/demo-page.png"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then png="$1"; shift; fi
[ "${1:-}" = "--" ] && shift
browser="${AGENTRACE_CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
if [ -z "$browser" ]; then
    echo "no chromium: apt-get install -y chromium (or set AGENTRACE_CHROMIUM)" >&2
    exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [ -n "${AGENTRACE_BIN:-}" ]; then
    "$AGENTRACE_BIN" demo --no-progress --out "$work" "$@"
else
    cargo run --release -- demo --no-progress --out "$work" "$@"
fi
page="$(ls -d "$work"/demo-*/index.html)"
"$browser" --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run --hide-scrollbars \
    --enable-logging=stderr --v=0 --user-data-dir="$work/profile" \
    --window-size=1280,3300 --screenshot="$png" "file://$page" 2>"$work/browser.log" >/dev/null
if grep ':CONSOLE' "$work/browser.log"; then
    echo "console messages above: the page is broken" >&2
    exit 1
fi
echo "wrote $png"
