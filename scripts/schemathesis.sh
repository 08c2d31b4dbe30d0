#!/usr/bin/env bash
# The admin API's contract: schemathesis (from PyPI, installed here into a venv under target/)
# generates requests from docs/admin-openapi.json and runs them against a live reflexd, checking
# every answer against the document (status codes, content types, schemas; schema-valid
# requests accepted, schema-violating ones refused). Bounded: examples per operation and time.
# Usage: scripts/schemathesis.sh   (after `cargo build --release`)
set -euo pipefail
cd "$(dirname "$0")/.."

SCHEMATHESIS_VERSION=4.32.5
VENV=target/schemathesis-venv
EXAMPLES=${SCHEMATHESIS_EXAMPLES:-50}
RUN_TIMEOUT=600

if ! "$VENV/bin/st" --version 2>/dev/null | grep -q "$SCHEMATHESIS_VERSION"; then
    echo "==> installing schemathesis $SCHEMATHESIS_VERSION into $VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "schemathesis==$SCHEMATHESIS_VERSION"
fi

work=$(mktemp -d)
reflexd_pid=
cleanup() {
    if [ -n "$reflexd_pid" ]; then kill "$reflexd_pid" 2>/dev/null || true; wait "$reflexd_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$work/reflexd.toml" <<TOML
port = 0
original_ports = []
arena_bytes_per_thread = "4M"
[nbd]
enabled = false
[admin]
listen = "127.0.0.1:$port"
state_file = "$work/state.json"
stats_window = "200ms"
[[tenant]]
name = "gold"
class = "lc"
latency_us_p95 = 500
iops = 1000
[[namespace]]
id = 1
backend = "emu:device-a-small"
size_bytes = "64M"
profile = "$PWD/profiles/device-a-small.toml"
tenant = "gold"
TOML
# From the scratch folder: POST /v1/namespaces may create backend files at relative paths.
root=$PWD
(cd "$work" && exec "$root/target/release/reflexd" --config "$work/reflexd.toml") 2>"$work/reflexd.log" &
reflexd_pid=$!
for _ in $(seq 1 100); do
    if grep -q "admin API listening" "$work/reflexd.log"; then break; fi
    if ! kill -0 "$reflexd_pid" 2>/dev/null; then cat "$work/reflexd.log"; exit 1; fi
    sleep 0.1
done
grep -q "admin API listening" "$work/reflexd.log" || { cat "$work/reflexd.log"; exit 1; }

# From the scratch folder: hypothesis keeps its database (.hypothesis/) in the working directory.
(cd "$work" && timeout "$RUN_TIMEOUT" "$root/$VENV/bin/st" run "$root/docs/admin-openapi.json" \
    --url "http://127.0.0.1:$port" --checks all --max-examples "$EXAMPLES" \
    --seed 1 --no-color)
# The server survived everything it was sent.
kill -0 "$reflexd_pid"
echo "schemathesis: reflexd answered every request as docs/admin-openapi.json says"
