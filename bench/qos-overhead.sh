#!/usr/bin/env bash
# Cost of the QoS scheduler on the dataplane (a benchmark, not a test): 4 KiB random reads at
# QD32 over 4 connections against a `mem` namespace, one dataplane thread pinned to SERVER_CPU,
# the bench pinned to CLIENT_CPU, in three server setups:
#   fifo   - no profile: the plain FIFO dataplane (no tenants at all);
#   off    - profile, --no-qos: tenants, charging and accounting, FIFO scheduling;
#   tokens - profile, QoS on: every request through the token scheduler (one BE tenant, the
#            namespace's default, since the bench never BINDs).
# The profile (profiles/mem-unlimited.toml) has rates no core can reach, so tokens
# never hold a request back: the difference is the scheduler's own cost. Reports IOPS and IOPS
# per server core (IOPS / the server's CPU utilisation from /proc/PID/stat), medians of REPS.
# Usage: bench/qos-overhead.sh   Environment: REPS (3), DURATION (5s), BIN (target/release),
#   SERVER_CPU (1), CLIENT_CPU (0), PORT (17080).
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${REPS:-3}
DURATION=${DURATION:-5s}
BIN=${BIN:-target/release}
SERVER_CPU=${SERVER_CPU:-1}
CLIENT_CPU=${CLIENT_CPU:-0}
PORT=${PORT:-17080}
TICKS=$(getconf CLK_TCK)
server_pid=""
stop_server() {
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
        kill -INT "$server_pid"
        timeout 20 tail --pid="$server_pid" -f /dev/null || kill -KILL "$server_pid"
    fi
    server_pid=""
}
trap stop_server EXIT
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
declare -A results
for rep in $(seq 1 "$REPS"); do
    for mode in fifo off tokens; do
        namespace="1=mem:256M"
        flags=()
        case $mode in
            off) namespace+=",profile=profiles/mem-unlimited.toml"; flags+=(--no-qos) ;;
            tokens) namespace+=",profile=profiles/mem-unlimited.toml" ;;
        esac
        taskset -c "$SERVER_CPU" "$BIN/reflexd" --port "$PORT" --no-nbd --no-original \
            -n "$namespace" "${flags[@]}" 2>/dev/null &
        server_pid=$!
        sleep 0.5
        before=$(cpu_ticks "$server_pid"); started=$(date +%s.%N)
        iops=$(timeout 60 taskset -c "$CLIENT_CPU" "$BIN/reflex" bench --server "127.0.0.1:$PORT" \
            --qd 32 --connections 4 --duration "$DURATION" --warmup 1s --cpus "$CLIENT_CPU" \
            --json -q | python3 -c 'import json,sys; print(json.load(sys.stdin)["rows"][0]["iops"])')
        after=$(cpu_ticks "$server_pid"); ended=$(date +%s.%N)
        stop_server
        busy=$(python3 -c "print(($after - $before) / $TICKS / ($ended - $started))")
        results[$mode-$rep]="$iops $busy"
        echo "$mode run $rep: $iops IOPS, server CPU $busy" >&2
    done
done
python3 - "$REPS" <<PY
import statistics, sys
reps = int(sys.argv[1])
raw = {$(for k in "${!results[@]}"; do printf '"%s": "%s", ' "$k" "${results[$k]}"; done)}
print("| server | IOPS | server CPU | IOPS per server core |")
print("|---|---:|---:|---:|")
for mode, label in [("fifo", "no profile (FIFO)"), ("off", "profile, --no-qos"), ("tokens", "QoS on, one BE tenant")]:
    runs = [tuple(map(float, raw[f"{mode}-{r}"].split())) for r in range(1, reps + 1)]
    iops = statistics.median(r[0] for r in runs)
    cpu = statistics.median(r[1] for r in runs)
    per_core = statistics.median(r[0] / r[1] for r in runs)
    print(f"| {label} | {iops/1e3:.0f}K | {cpu*100:.0f} % | {per_core/1e3:.0f}K |")
PY
