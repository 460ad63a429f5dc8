#!/usr/bin/env bash
# Installs the official `anthropic` and `openai` Python SDKs that tests/agent_sdks.rs drives
# through the proxy: a virtualenv under the cache directory, packages by name with pinned
# versions. Prints the venv's python; exits non-zero when they cannot be installed (offline,
# no python3).
set -euo pipefail
venv="${AGENTRACE_SDK_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrace/sdk-venv}"
anthropic_version="${AGENTRACE_ANTHROPIC_VERSION:-2.10.0}"
openai_version="${AGENTRACE_OPENAI_VERSION:-3.51.0}"
python="$venv/bin/python"
installed() {
    [ -x "$python" ] && "$python" - "$anthropic_version" "$openai_version" <<'PY' 2>/dev/null
import sys, anthropic, openai
sys.exit(0 if (anthropic.__version__, openai.__version__) == tuple(sys.argv[1:3]) else 1)
PY
}
if ! installed; then
    command -v python3 >/dev/null || { echo "python-sdks.sh: python3 not found" >&2; exit 1; }
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "anthropic==$anthropic_version" "openai==$openai_version" >&2
fi
installed || { echo "python-sdks.sh: anthropic $anthropic_version / openai $openai_version not importable from $venv" >&2; exit 1; }
echo "$python"
