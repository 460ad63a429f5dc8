#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from source and writes a tiny random-weight GGUF model, so
# agentrace can be tested against a real engine on a machine with no GPU and no model files.
#
# Everything comes from the package registries: llama.cpp as vendored in the llama-cpp-python
# source distribution (PyPI, through pip), cmake, gguf and numpy (PyPI). Both artefacts are cached outside
# the work tree; a second run finds them and returns at once.
#
#   scripts/real-engine.sh [--words FILE]...   # FILE: text whose words the vocabulary covers
#
# Prints, and writes to $CACHE/env, the two variables tests/real_engine.rs reads:
#   AGENTRACE_LLAMA_SERVER=…/llama-server  AGENTRACE_TINY_GGUF=…/tiny.gguf
set -euo pipefail

cache="${AGENTRACE_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrace/real-engine}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# The sdist's sha256 for that version; set both together to build another.
sha256="${LLAMA_CPP_PYTHON_SHA256:-832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e}"
here="$(cd "$(dirname "$0")" && pwd)"
words=()
while [ $# -gt 0 ]; do
    case "$1" in
        --words) words+=(--words "$(realpath "$2")"); shift 2 ;;
        *) echo "real-engine.sh: unknown argument '$1' (expected --words FILE)" >&2; exit 2 ;;
    esac
done

mkdir -p "$cache"
server="$cache/bin/llama-server"
model="$cache/tiny.gguf"
started=$(date +%s)

if [ ! -x "$cache/venv/bin/python" ]; then
    python3 -m venv "$cache/venv"
fi
"$cache/venv/bin/pip" install --quiet --disable-pip-version-check cmake gguf numpy

if [ ! -x "$server" ]; then
    src="$cache/src"
    if [ ! -d "$src/llama_cpp_python-$version" ]; then
        mkdir -p "$src"
        # The source distribution through pip's configured index, checked against the pinned
        # hash. Preparing its metadata needs cmake and scikit-build-core present, not a build.
        "$cache/venv/bin/pip" install --quiet --disable-pip-version-check scikit-build-core
        sdist="llama_cpp_python-$version.tar.gz"
        printf 'llama-cpp-python==%s --hash=sha256:%s\n' "$version" "$sha256" >"$src/requirement.txt"
        "$cache/venv/bin/pip" download --quiet --disable-pip-version-check --no-deps \
            --no-binary :all: --no-build-isolation --require-hashes -r "$src/requirement.txt" \
            -d "$src" ||
            { echo "real-engine.sh: pip could not download llama-cpp-python==$version with sha256 $sha256" >&2; exit 1; }
        tar -xzf "$src/$sdist" -C "$src"
    fi
    llama="$src/llama_cpp_python-$version/vendor/llama.cpp"
    # Only what llama-server needs: no tests, examples or web UI, no download or TLS
    # support, no ccache lookup. GGML_NATIVE=OFF builds for the AVX2 baseline instead of
    # asking the build machine which instructions it has, so a cached server runs on any
    # runner the cache is restored to.
    "$cache/venv/bin/cmake" -S "$llama" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=OFF -DGGML_CCACHE=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
        >"$cache/cmake-configure.log" 2>&1 ||
        { tail -20 "$cache/cmake-configure.log" >&2; echo "real-engine.sh: cmake configure failed ($cache/cmake-configure.log)" >&2; exit 1; }
    "$cache/venv/bin/cmake" --build "$cache/build" --target llama-server \
        -j "$(nproc)" >"$cache/cmake-build.log" 2>&1 ||
        { grep -m5 "error" "$cache/cmake-build.log" >&2; echo "real-engine.sh: the build failed ($cache/cmake-build.log)" >&2; exit 1; }
    mkdir -p "$cache/bin"
    cp "$cache/build/bin/llama-server" "$server"
fi

if [ ! -s "$model" ] || [ ${#words[@]} -gt 0 ]; then
    "$cache/venv/bin/python" "$here/tiny_gguf.py" "$model.tmp" "${words[@]}" >/dev/null
    mv "$model.tmp" "$model"
fi

cat >"$cache/env" <<EOF
AGENTRACE_LLAMA_SERVER=$server
AGENTRACE_TINY_GGUF=$model
EOF
echo "real engine ready in $(( $(date +%s) - started )) s:"
cat "$cache/env"
