#!/usr/bin/env bash
# Two or more reflexd builds side by side (a benchmark, not a test): replies per server
# core-second for 4 KiB random reads from `mem:1G` behind an original-protocol port, one
# dataplane thread, the builds alternating round by round so that the machine's drift falls on
# all of them alike, and limit-server (bench/limit) measured in the same run as the yardstick.
#
# Scenarios (SCENARIOS, all by default):
#   fresh      the device as started: never written, so reads find zero pages
#   written    the whole device written first (1 MiB sequential writes through the native
#              port), then reads at random over all of it: cold data, as a large device has
#   warm       written, then reads at random over its first 1 MiB only: the same footprint as
#              limit-server's static 1 MiB region, so the data is as warm as the limit's
# Shapes: 16 connections x 32 deep and 4 x 32 (limit-client, closed loop). Server pinned to
# SERVER_CPU, client to CLIENT_CPU; server CPU from /proc/PID/task/*/schedstat around the
# measured run (after a 1 s warm-up run on the same server). Each point prints one line on
# stderr; stdout gets the summary, a Markdown table of medians per build, scenario and shape,
# with each build's ratio to limit-server.
#
# Usage: bench/builds.sh BUILD... > docs/results/builds.md
#        e.g. bench/builds.sh /tmp/reflexd-before target/release/reflexd
#        ROUNDS=4 DURATION=3s SCENARIOS="written warm" bench/builds.sh A B
# Environment: ROUNDS (4) DURATION (3s) SCENARIOS (fresh written warm) SERVER_CPU (0)
#   CLIENT_CPU (another CPU) PORT (17181: original protocol; PORT+1: native, for the fill)
#   STEP_TIMEOUT (120 s per client run or fill)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

[ "$#" -ge 1 ] || die "usage: bench/builds.sh BUILD... (reflexd binaries)"
BUILDS=("$@")
ROUNDS=${ROUNDS:-4}
DURATION=${DURATION:-3s}
SCENARIOS=${SCENARIOS:-fresh written warm}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-$(( (SERVER_CPU + 1) % $(nproc) ))}
PORT=${PORT:-17181}
NATIVE_PORT=$((PORT + 1))
STEP_TIMEOUT=${STEP_TIMEOUT:-120}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
[ "$SERVER_CPU" != "$CLIENT_CPU" ] || die "SERVER_CPU and CLIENT_CPU must differ"
require taskset python3 timeout ss
for build in "${BUILDS[@]}"; do
    [ -x "$build" ] || die "not an executable: $build"
done

note "building limit-server, limit-client and reflex"
cargo build --release -q -p reflex-limit -p reflex-cli
LIMIT_SERVER="$CARGO_TARGET_DIR/release/limit-server"
LIMIT_CLIENT="$CARGO_TARGET_DIR/release/limit-client"
REFLEX="$CARGO_TARGET_DIR/release/reflex"
WORK=$(mktemp -d)
RESULTS="$WORK/results.tsv"
SERVER_PID=""
cleanup() {
    [ -z "$SERVER_PID" ] || kill "$SERVER_PID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

wait_listening() {
    local port=$1
    for _ in $(seq 100); do
        ss -Hltn "sport = :$port" | grep -q . && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# measure NAME SCENARIO SHAPE ROUND CLIENT_ARGS...: a warm-up run, then the measured one.
measure() {
    local name=$1 scenario=$2 shape=$3 round=$4 before after json
    shift 4
    timeout "$STEP_TIMEOUT" taskset -c "$CLIENT_CPU" "$LIMIT_CLIENT" --duration 1s "$@" \
        >/dev/null || die "warm-up against $name failed"
    before=$(cpu_ns "$SERVER_PID")
    json=$(timeout "$STEP_TIMEOUT" taskset -c "$CLIENT_CPU" "$LIMIT_CLIENT" \
        --duration "$DURATION" --seed "$round" --json "$@") || die "client against $name failed"
    after=$(cpu_ns "$SERVER_PID")
    python3 - "$name" "$scenario" "$shape" "$round" "$((after - before))" "$json" \
        >>"$RESULTS" <<'PY'
import json, sys
name, scenario, shape, round_, cpu_ns, report = sys.argv[1:]
replies = json.loads(report)["replies"]
per_core = replies / (int(cpu_ns) / 1e9)
print(f"{name}\t{scenario}\t{shape}\t{round_}\t{replies}\t{per_core:.0f}")
PY
    tail -1 "$RESULTS" | awk -F'\t' '{ printf "  %s %s %s round %s: %d replies, %.0fK per server core-second\n", $1, $2, $3, $4, $5, $6 / 1000 }' >&2
}

stop_server() {
    kill -INT "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}

SHAPES=("16 32" "4 32")
for ((round = 1; round <= ROUNDS; round++)); do
    note "round $round of $ROUNDS"
    for scenario in $SCENARIOS; do
        case "$scenario" in
            fresh | written | warm) ;;
            *) die "unknown scenario $scenario (fresh, written, warm)" ;;
        esac
        for build in "${BUILDS[@]}"; do
            for shape in "${SHAPES[@]}"; do
                read -r connections depth <<<"$shape"
                reflexd_mem_command "$build" "$PORT" "$NATIVE_PORT"
                taskset -c "$SERVER_CPU" "${SERVER_COMMAND[@]}" >"$WORK/server.log" 2>&1 &
                SERVER_PID=$!
                wait_listening "$PORT" && wait_listening "$NATIVE_PORT" ||
                    { cat "$WORK/server.log" >&2; die "$build did not start"; }
                range=()
                if [ "$scenario" != fresh ]; then
                    timeout "$STEP_TIMEOUT" "$REFLEX" bench -s "127.0.0.1:$NATIVE_PORT" \
                        --read-ratio 0 --pattern sequential --io-size 1m --range 1G --qd 8 \
                        --ops 1024 --warmup 0s --duration 60s >"$WORK/fill.log" 2>&1 ||
                        { cat "$WORK/fill.log" >&2; die "filling the device of $build failed"; }
                fi
                [ "$scenario" != warm ] || range=(--lba-range 1M)
                measure "$build" "$scenario" "${connections}x$depth" "$round" \
                    --addr "127.0.0.1:$PORT" --connections "$connections" --depth "$depth" \
                    "${range[@]}"
                stop_server
            done
        done
    done
    for shape in "${SHAPES[@]}"; do
        read -r connections depth <<<"$shape"
        limit_server_command "$LIMIT_SERVER" "$PORT"
        taskset -c "$SERVER_CPU" "${SERVER_COMMAND[@]}" >"$WORK/limit.log" 2>&1 &
        SERVER_PID=$!
        wait_listening "$PORT" || { cat "$WORK/limit.log" >&2; die "limit-server did not start"; }
        measure limit-server limit "${connections}x$depth" "$round" \
            --addr "127.0.0.1:$PORT" --connections "$connections" --depth "$depth"
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=""
    done
done

note "medians of $ROUNDS rounds, replies per server core-second"
python3 - "$RESULTS" <<'PY'
import statistics, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1])]
points = {}
for name, scenario, shape, _, _, per_core in rows:
    points.setdefault((name, scenario, shape), []).append(float(per_core))
limit = {shape: statistics.median(v) for (n, s, shape), v in points.items() if s == "limit"}
print("| build | scenario | shape | median | runs | / limit-server |")
print("|---|---|---|---:|---|---:|")
for (name, scenario, shape), values in points.items():
    median = statistics.median(values)
    runs = ", ".join(f"{v / 1000:.0f}K" for v in values)
    ratio = "" if scenario == "limit" else f"{median / limit[shape]:.2f}"
    print(f"| {name} | {scenario} | {shape} | {median / 1000:.0f}K | {runs} | {ratio} |")
PY
