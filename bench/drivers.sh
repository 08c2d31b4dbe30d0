#!/usr/bin/env bash
# io_uring vs epoll driver (issue 10; a benchmark, not a test): 4 KiB random reads at QD32 over
# 4 connections against reflexd on a `mem` namespace with one dataplane thread, for each driver
# in turn, REPS times (alternating, so drift hits both alike). The server is pinned to
# SERVER_CPU, the client to CLIENT_CPU. Server CPU is the sum over its threads of the first
# field of /proc/PID/task/*/schedstat (nanoseconds on a CPU) across the bench run, divided by
# the run's wall time; per request, that CPU time divided by the requests the server answered
# over its life (one bench run per server, warm-up included). Writes a markdown table of medians to OUT (and stdout); raw JSON in
# $WORK/raw/. Waits (at most a minute) for a quiet machine first, and records the load.
#
# Usage: bench/drivers.sh
# Environment: REPS (3) DURATION (5s) WARMUP (1s) SERVER_CPU (0) CLIENT_CPU (1)
#   READ_RATIO (1) WORK (target/bench-drivers) OUT (docs/results/drivers.md)
#   NICE (0): niceness of server and client; a negative value (as root) shields the
#   measurement from other work on a shared machine, and is recorded in the results.
#   RT_PRIO (unset): run server and client SCHED_FIFO at this priority (chrt -f) instead, so
#   their wake-ups preempt other work at once (both sleep when idle, nothing spins).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

REPS=${REPS:-3}
DURATION=${DURATION:-5s}
WARMUP=${WARMUP:-1s}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
READ_RATIO=${READ_RATIO:-1}
WORK=${WORK:-target/bench-drivers}
OUT=${OUT:-docs/results/drivers.md}
NICE=${NICE:-0}
RT_PRIO=${RT_PRIO:-}
PRIO=(nice -n "$NICE")
[ -z "$RT_PRIO" ] || PRIO=(chrt -f "$RT_PRIO")
STEP_TIMEOUT=120
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}

require taskset python3 ss
note "building release binaries"
cargo build --release -q -p reflex-server -p reflex-cli
REFLEXD="$CARGO_TARGET_DIR/release/reflexd"
REFLEX="$CARGO_TARGET_DIR/release/reflex"
RAW="$WORK/raw"
mkdir -p "$RAW"
rm -f "$RAW"/*.json
trap stop_tracked EXIT
wait_quiet 30 60 || note "the machine stayed busy; measuring anyway"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)

# server_cpu_ns PID: nanoseconds every thread of PID has run (schedstat's first field).
server_cpu_ns() { cat /proc/"$1"/task/*/schedstat | awk '{ sum += $1 } END { printf "%.0f\n", sum }'; }

for rep in $(seq 1 "$REPS"); do
    for driver in uring epoll; do
        port=$(free_port)
        "${PRIO[@]}" taskset -c "$SERVER_CPU" "$REFLEXD" --driver "$driver" -n 1=mem:1G --threads 1 \
            --port "$port" --no-original --no-nbd >"$WORK/reflexd-$driver.log" 2>&1 &
        pid=$!
        track "$pid"
        wait_port "$port" "$pid" || die "reflexd ($driver) did not start: $(cat "$WORK/reflexd-$driver.log")"
        for ((i = 0; i < 100; i++)); do
            grep -q "reflexd serving" "$WORK/reflexd-$driver.log" && break
            sleep 0.05
        done
        expected=$([ "$driver" = uring ] && echo io_uring || echo epoll)
        grep -q "reflexd serving.*driver=\"$expected\"" "$WORK/reflexd-$driver.log" ||
            die "reflexd did not run on $driver: $(cat "$WORK/reflexd-$driver.log")"
        name="$driver-$rep"
        before=$(server_cpu_ns "$pid")
        start=$(now_ns)
        timeout "$STEP_TIMEOUT" "${PRIO[@]}" taskset -c "$CLIENT_CPU" "$REFLEX" bench --json -q \
            -s "127.0.0.1:$port" --qd 32 --connections 4 --read-ratio "$READ_RATIO" \
            --warmup "$WARMUP" --duration "$DURATION" >"$RAW/$name.json"
        end=$(now_ns)
        after=$(server_cpu_ns "$pid")
        stop_tracked
        answered=$(sed -n 's/.*reflexd stopped requests_answered=\([0-9]*\).*/\1/p' "$WORK/reflexd-$driver.log")
        [ -n "$answered" ] || die "reflexd ($driver) did not stop cleanly: $(tail -5 "$WORK/reflexd-$driver.log")"
        echo "{\"cpu_ns\": $((after - before)), \"wall_ns\": $((end - start)), \"requests\": $answered}" \
            >"$RAW/$name.cpu.json"
        note "$name done"
    done
done

LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
mkdir -p "$(dirname "$OUT")"
{
    echo "# io_uring vs epoll driver"
    echo
    echo "\`REPS=$REPS DURATION=$DURATION NICE=$NICE${RT_PRIO:+ RT_PRIO=$RT_PRIO} bench/drivers.sh\` at $COMMIT, $(date -u +"%Y-%m-%d %H:%M UTC");"
    echo "$(nproc --all) vCPU, kernel $(uname -r); load average $LOAD_BEFORE before, $LOAD_AFTER after."
    echo "reflexd \`-n 1=mem:1G --threads 1\` on CPU $SERVER_CPU, \`reflex bench --qd 32 --connections 4"
    echo "--read-ratio $READ_RATIO\` (4 KiB random) on CPU $CLIENT_CPU; medians of $REPS, IOPS range in brackets."
    echo
    python3 - "$RAW" "$REPS" <<'PY'
import json, os, statistics, sys
raw, reps = sys.argv[1], int(sys.argv[2])

def load(name):
    with open(os.path.join(raw, name + ".json")) as f:
        return json.load(f)

print("| driver | IOPS | read p50 µs | read p99 µs | server CPU (cores) | IOPS per server core "
      "| server CPU µs per request |")
print("|---|---|---|---|---|---|---|")
for driver in ("uring", "epoll"):
    iops, p50, p99, cores, per_core, per_request = [], [], [], [], [], []
    for rep in range(1, reps + 1):
        row = load(f"{driver}-{rep}")["rows"][0]
        cpu = load(f"{driver}-{rep}.cpu")
        used = cpu["cpu_ns"] / cpu["wall_ns"]
        iops.append(row["iops"])
        p50.append(row["read"]["p50_us"])
        p99.append(row["read"]["p99_us"])
        cores.append(used)
        per_core.append(row["iops"] / max(used, 1e-9))
        per_request.append(cpu["cpu_ns"] / 1e3 / max(cpu["requests"], 1))
    med = statistics.median
    spread = f"{min(iops) / 1e3:.0f}–{max(iops) / 1e3:.0f}K"
    print(f"| {driver} | {med(iops) / 1e3:.0f}K ({spread}) | {med(p50):.0f} | {med(p99):.0f} | "
          f"{med(cores):.2f} | {med(per_core) / 1e3:.0f}K | {med(per_request):.2f} |")
PY
} | tee "$OUT"
