#!/usr/bin/env bash
# Where a server's CPU goes under load (issue 10, a benchmark, not a test): `perf record -e
# cpu-clock` of one server while limit-client drives it, then the hottest symbols, user space
# and kernel apart. The VM has no hardware counters, so the samples are timer ticks of the
# software clock (PERF_FREQ per second): a share of the server's time, not cycles or misses.
#
# The server is pinned to SERVER_CPU, the client to CLIENT_CPU; the client first runs for 1 s
# (connections up, caches warm), then perf records the server for DURATION while the client
# runs a little longer than that. SERVER: reflexd (this tree's release build, `mem:1G` behind
# an original-protocol port, one dataplane thread) or limit-server (bench/limit).
#
# Usage: bench/profile.sh > docs/results/profile.md
#        SERVER=limit-server bench/profile.sh
#        CONNECTIONS=4 POLL=1 LBA_RANGE=1M bench/profile.sh
# Environment: SERVER (reflexd) CONNECTIONS (16) DEPTH (32) DURATION (4s) POLL (0)
#   LBA_RANGE (unset: the whole device) PERF_FREQ (4999) TOP (30) SERVER_CPU (0)
#   CLIENT_CPU (another CPU) PORT (17281) REFLEXD (this tree's release build)
#   WORK (target/bench-profile: perf.data and the report stay there)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

SERVER=${SERVER:-reflexd}
CONNECTIONS=${CONNECTIONS:-16}
DEPTH=${DEPTH:-32}
DURATION=${DURATION:-4s}
POLL=${POLL:-0}
LBA_RANGE=${LBA_RANGE:-}
PERF_FREQ=${PERF_FREQ:-4999}
TOP=${TOP:-30}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-$(( (SERVER_CPU + 1) % $(nproc) ))}
PORT=${PORT:-17281}
WORK=${WORK:-target/bench-profile}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
[ "$SERVER_CPU" != "$CLIENT_CPU" ] || die "SERVER_CPU and CLIENT_CPU must differ"
case "$SERVER" in
    reflexd | limit-server) ;;
    *) die "SERVER must be reflexd or limit-server, not '$SERVER'" ;;
esac
require perf taskset timeout python3
DURATION_S=$(python3 -c 'import sys, re
m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s)?", sys.argv[1])
if not m: sys.exit("DURATION must look like 4s or 500ms")
print(float(m[1]) / (1000 if m[2] == "ms" else 1))' "$DURATION") || die "bad DURATION '$DURATION'"

note "building release binaries (debug line info: profile.release debug = 1)"
cargo build --release -q -p reflex-server -p reflex-limit
REFLEXD=${REFLEXD:-"$CARGO_TARGET_DIR/release/reflexd"}
LIMIT_SERVER="$CARGO_TARGET_DIR/release/limit-server"
LIMIT_CLIENT="$CARGO_TARGET_DIR/release/limit-client"
mkdir -p "$WORK"
rm -f "$WORK/perf.data" "$WORK/perf.data.old"

SERVER_PID=""
CLIENT_PID=""
cleanup() {
    [ -z "$CLIENT_PID" ] || stop_pid "$CLIENT_PID"
    [ -z "$SERVER_PID" ] || stop_pid "$SERVER_PID"
}
trap cleanup EXIT

flags=()
[ "$POLL" = 0 ] || flags+=(--poll)
LABEL="$SERVER${flags[*]:+ ${flags[*]}}"
if [ "$SERVER" = reflexd ]; then
    reflexd_mem_command "$REFLEXD" "$PORT" 0 "${flags[@]}"
else
    limit_server_command "$LIMIT_SERVER" "$PORT" "${flags[@]}"
fi
taskset -c "$SERVER_CPU" "${SERVER_COMMAND[@]}" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
wait_port "$PORT" "$SERVER_PID" 20 || { cat "$WORK/server.log" >&2; die "$SERVER did not start"; }

client_args=(--addr "127.0.0.1:$PORT" --connections "$CONNECTIONS" --depth "$DEPTH" --json)
[ -z "$LBA_RANGE" ] || client_args+=(--lba-range "$LBA_RANGE")
CLIENT_S=$(python3 -c "print(f'{$DURATION_S + 2:g}s')")
note "$LABEL: limit-client $CONNECTIONS x $DEPTH for $CLIENT_S, perf over $DURATION"
taskset -c "$CLIENT_CPU" "$LIMIT_CLIENT" "${client_args[@]}" --duration "$CLIENT_S" \
    >"$WORK/client.json" 2>"$WORK/client.err" &
CLIENT_PID=$!
sleep 1
kill -0 "$CLIENT_PID" 2>/dev/null || { cat "$WORK/client.err" >&2; die "limit-client stopped"; }
ticks_before=$(cpu_user_sys_ticks "$SERVER_PID")
perf record -q -e cpu-clock -F "$PERF_FREQ" -p "$SERVER_PID" -o "$WORK/perf.data" \
    -- sleep "$DURATION_S" 2>"$WORK/perf.err" || { cat "$WORK/perf.err" >&2; die "perf record failed"; }
ticks_after=$(cpu_user_sys_ticks "$SERVER_PID")
wait "$CLIENT_PID" || { cat "$WORK/client.err" >&2; die "limit-client failed"; }
CLIENT_PID=""
REPLIES_PER_S=$(python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
print("%.0f" % r["replies_per_sec"])' "$WORK/client.json" 2>/dev/null || true)
stop_pid "$SERVER_PID"
SERVER_PID=""

perf report -i "$WORK/perf.data" --no-children --sort dso,sym --stdio -q --percent-limit 0.3 \
    2>/dev/null >"$WORK/report.txt" || die "perf report failed"
user_ticks=$((${ticks_after% *} - ${ticks_before% *}))
sys_ticks=$((${ticks_after#* } - ${ticks_before#* }))

python3 - "$WORK/report.txt" "$TOP" <<EOF
import re, sys
path, top = sys.argv[1], int(sys.argv[2])
rows = []
for line in open(path):
    m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[([k.])\]\s+(.*\S)", line)
    if m:
        rows.append((float(m[1]), m[2], "kernel" if m[3] == "k" else "user", m[4]))
user = sum(r[0] for r in rows if r[2] == "user")
kernel = sum(r[0] for r in rows if r[2] == "kernel")
print("# Where the server's CPU goes (issue 10)\n")
print("- server: $LABEL; commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with uncommitted changes)'); date: $(date -u '+%Y-%m-%d %H:%M UTC')")
print("- command: \`SERVER=$SERVER CONNECTIONS=$CONNECTIONS DEPTH=$DEPTH DURATION=$DURATION POLL=$POLL${LBA_RANGE:+ LBA_RANGE=$LBA_RANGE} bench/profile.sh\`")
print("- server pinned to CPU $SERVER_CPU, limit-client ($CONNECTIONS x $DEPTH, 4 KiB random reads) to CPU $CLIENT_CPU; \`perf record -e cpu-clock -F $PERF_FREQ\` of the server for $DURATION after 1 s of load")
print("- replies per second during the run: ${REPLIES_PER_S:-unknown}; server CPU ticks in user space / kernel over the recording: $user_ticks / $sys_ticks")
print(f"- samples in symbols above 0.3 %: user space {user:.1f} %, kernel {kernel:.1f} % (the rest in smaller symbols)\n")
print("| share of samples | where | symbol | object |")
print("|---:|---|---|---|")
for share, dso, where, sym in sorted(rows, reverse=True)[:top]:
    sym = sym.replace("|", "\\\\|")
    print(f"| {share:.2f} % | {where} | \`{sym[:110]}\` | {dso} |")
print("\nperf.data and the full report: \`$WORK/\` (\`perf report -i $WORK/perf.data\`).")
EOF
