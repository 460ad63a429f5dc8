# Shared by the scripts/bench-*.sh that run agentrace beside other processes: sourced, not run.
# Sets `bin` (AGENTRACE, else a release build made here), `work` (a temporary directory) and
# `pids` (what the script started: stopped, and `work` removed, on exit), and defines
# `free_port`, `wait_http URL` and `address_in_log LOG PREFIX`.
bench_name="$(basename "$0")"
bin="${AGENTRACE:-target/release/agentrace}"
if [ -z "${AGENTRACE:-}" ]; then
    cargo build --release --quiet --bin agentrace
fi
work="$(mktemp -d)"
pids=()
stop_all() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT

# A TCP port free on 127.0.0.1 now.
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Waits up to 60 s for URL to answer 2xx.
wait_http() {
    for _ in $(seq 600); do
        curl -fs -o /dev/null "$1" && return
        sleep 0.1
    done
    echo "$bench_name: $1 never answered" >&2
    exit 1
}

# Waits for "$2" in log "$1" and prints what follows it on that line (up to whitespace).
address_in_log() {
    for _ in $(seq 600); do
        if grep -q "$2" "$1"; then
            grep -o "$2[^ ]*" "$1" | head -1 | sed "s|$2||"
            return
        fi
        sleep 0.1
    done
    echo "$bench_name: '$2' never appeared in $1" >&2
    tail -5 "$1" >&2
    exit 1
}
