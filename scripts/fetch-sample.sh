#!/usr/bin/env bash
# Downloads the public MLPerf agentic coding sample (20 SWE-bench trajectories, 2,014 rows) from
# its home in the MLCommons Endpoints repository and checks its SHA-256.
#
# Licence: the file is part of github.com/mlcommons/endpoints, distributed under the Apache
# License 2.0 (https://github.com/mlcommons/endpoints/blob/main/LICENSE); it is downloaded, not
# redistributed by agentrace.
#
# Usage: scripts/fetch-sample.sh [OUT]   (default datasets/mlperf_agentic_coding_sample.jsonl)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-datasets/mlperf_agentic_coding_sample.jsonl}"
commit=3f89306ea8bc63cd953fff96053d8c93e6729599
path=examples/11_Edge_Agentic_Example/agentic_coding_2.5h.jsonl
url="https://raw.githubusercontent.com/mlcommons/endpoints/$commit/$path"
sha256=b7da8c4ffbe1cabd79c4d8169e5201541e006364b4bfc016d01d893e20ee6f70

if [ -f "$out" ] && echo "$sha256  $out" | sha256sum --check --status; then
    echo "$out is already there (sha256 ok)"
    exit 0
fi
mkdir -p "$(dirname "$out")"
tmp="$out.part"
trap 'rm -f "$tmp"' EXIT
echo "downloading $url"
curl --fail --location --silent --show-error --output "$tmp" "$url"
if ! echo "$sha256  $tmp" | sha256sum --check --status; then
    echo "error: $url does not have the expected sha256 $sha256" >&2
    exit 1
fi
mv "$tmp" "$out"
echo "wrote $out (MLCommons Endpoints, Apache-2.0; 20 trajectories)"
