#!/usr/bin/env bash
# NVMe/TCP: SPDK's nvmf_tgt (malloc bdev) against reflexd (mem namespace), side by side
# (issue 15; a benchmark, not a test). Each target runs on one core (TARGET_CPU); SPDK's
# spdk_nvme_perf drives it from CLIENT_CPU. Targets: nvmf_tgt (always spins), reflexd in
# blocking mode (sleeps in its ring when idle) and reflexd --poll (spins). Workloads: 4 KiB
# random reads at QD32, 4 KiB 50/50 random read/write at QD32, 4 KiB random reads at QD1
# (latency). Every (target, workload) cell runs REPS times, targets alternating within each
# rep so drift hits all alike; the table reports medians.
#
# Measured: IOPS and mean latency as spdk_nvme_perf prints them ("Total" line); the target's
# CPU time over the perf run from /proc/PID/task/*/schedstat (the scheduler's exact run time,
# all threads), as cores busy = CPU seconds / wall seconds; IOPS per target core = IOPS /
# cores busy (a target that spins is busy 1.0 core whatever the load; one that sleeps when
# idle uses less at partial load). Both targets serve RAM: nothing here measures Flash.
# This VM drops into a slow state for whole runs now and then (every target, the same
# workload: ~300K instead of ~500K IOPS), so the table gives the median and the best run.
#
# Usage: bench/nvme-tcp.sh
# Environment: SPDK_DIR (required: an SPDK v24.01 source tree built as docs/NVME-TCP.md says) REPS (5) DURATION (5, seconds) TARGET_CPU (0)
#   CLIENT_CPU (1) WORK (target/bench-nvme-tcp) OUT (docs/results/nvme-tcp.md) ISOLATE (on:
#   every other task that can leaves TARGET_CPU for the run, bench/lib/isolate.py; off: shared)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

SPDK_DIR=${SPDK_DIR:?set SPDK_DIR to a built SPDK tree (docs/NVME-TCP.md)}
REPS=${REPS:-5}
DURATION=${DURATION:-5}
TARGET_CPU=${TARGET_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
WORK=${WORK:-target/bench-nvme-tcp}
OUT=${OUT:-docs/results/nvme-tcp.md}
NQN_SPDK=nqn.2016-06.io.spdk:bench
NQN_REFLEX=nqn.2026-01.io.reflex:default
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
export PATH=/usr/bin:$PATH # SPDK's rpc.py wants Debian's python3
isolate_option

require taskset python3
PERF="$SPDK_DIR/build/bin/spdk_nvme_perf"
NVMF_TGT="$SPDK_DIR/build/bin/nvmf_tgt"
RPC="$SPDK_DIR/scripts/rpc.py"
[ -x "$PERF" ] && [ -x "$NVMF_TGT" ] || die "no SPDK build in $SPDK_DIR (docs/NVME-TCP.md says how to build it)"
note "building reflexd (release)"
cargo build --release -q -p reflex-server --bin reflexd
REFLEXD="$CARGO_TARGET_DIR/release/reflexd"
mkdir -p "$WORK/raw"
rm -f "$WORK"/raw/*
trap 'stop_tracked; isolate_restore' EXIT
isolate_cpu "$TARGET_CPU"
wait_quiet 30 30 || note "the machine stayed busy; measuring anyway"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)

TARGET_PID=
TARGET_PORT=
# start_target NAME: starts it on TARGET_CPU, sets TARGET_PID and TARGET_PORT.
start_target() {
    local name=$1 port
    port=$(free_port)
    case "$name" in
    spdk)
        local sock="$WORK/spdk.sock"
        rm -f "$sock"
        taskset -c "$TARGET_CPU" "$NVMF_TGT" --no-huge -s 512 -m 0x1 --no-pci -r "$sock" \
            >"$WORK/nvmf_tgt.log" 2>&1 &
        TARGET_PID=$!
        track "$TARGET_PID"
        for ((i = 0; i < 100; i++)); do [ -S "$sock" ] && break; sleep 0.1; done
        local rpc=("$RPC" -s "$sock")
        "${rpc[@]}" nvmf_create_transport -t TCP -u 16384 -m 8 -c 8192 >/dev/null
        "${rpc[@]}" bdev_malloc_create -b Malloc0 64 512 >/dev/null
        "${rpc[@]}" nvmf_create_subsystem "$NQN_SPDK" -a -s SPDK0001 >/dev/null
        "${rpc[@]}" nvmf_subsystem_add_ns "$NQN_SPDK" Malloc0 >/dev/null
        "${rpc[@]}" nvmf_subsystem_add_listener "$NQN_SPDK" -t tcp -a 127.0.0.1 -s "$port" >/dev/null
        ;;
    reflexd | reflexd-poll)
        local poll=()
        [ "$name" = reflexd-poll ] && poll=(--poll)
        taskset -c "$TARGET_CPU" "$REFLEXD" --threads 1 "${poll[@]}" -n 1=mem:64M \
            --port 0 --no-original --no-nbd --nvme-tcp-port "$port" >"$WORK/$name.log" 2>&1 &
        TARGET_PID=$!
        track "$TARGET_PID"
        ;;
    esac
    wait_port "$port" "$TARGET_PID" 30 || die "$name did not start"
    TARGET_PORT=$port
}

# run_perf NAME WORKLOAD REP: one spdk_nvme_perf run; appends "name workload rep iops lat_us cores".
run_perf() {
    local name=$1 workload=$2 rep=$3 nqn=$NQN_REFLEX args cpu_before cpu_after start end raw
    [ "$name" = spdk ] && nqn=$NQN_SPDK
    case "$workload" in
    randread-qd32) args=(-q 32 -w randread) ;;
    randrw50-qd32) args=(-q 32 -w randrw -M 50) ;;
    randread-qd1) args=(-q 1 -w randread) ;;
    esac
    raw="$WORK/raw/$name-$workload-$rep.txt"
    cpu_before=$(cpu_ns "$TARGET_PID")
    start=$(now_ns)
    timeout $((DURATION + 60)) taskset -c "$CLIENT_CPU" "$PERF" --no-huge -s 512 \
        -c "$((1 << CLIENT_CPU))" -o 4096 "${args[@]}" -t "$DURATION" \
        -r "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$TARGET_PORT subnqn:$nqn" >"$raw" 2>&1 ||
        die "spdk_nvme_perf against $name failed: $(tail -5 "$raw")"
    end=$(now_ns)
    cpu_after=$(cpu_ns "$TARGET_PID")
    awk -v name="$name" -v workload="$workload" -v rep="$rep" \
        -v cpu=$((cpu_after - cpu_before)) -v wall=$((end - start)) \
        '/^Total/ { printf "%s %s %s %s %s %.3f\n", name, workload, rep, $3, $5, cpu / wall }' \
        "$raw" >>"$WORK/results.txt"
}

: >"$WORK/results.txt"
TARGETS=(spdk reflexd reflexd-poll)
WORKLOADS=(randread-qd32 randrw50-qd32 randread-qd1)
for rep in $(seq 1 "$REPS"); do
    for name in "${TARGETS[@]}"; do
        note "rep $rep/$REPS: $name"
        start_target "$name"
        for workload in "${WORKLOADS[@]}"; do
            run_perf "$name" "$workload" "$rep"
        done
        stop_tracked
    done
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

mkdir -p "$(dirname "$OUT")"
set_revision
python3 - "$WORK/results.txt" "$REPS" "$DURATION" "$LOAD_BEFORE" "$LOAD_AFTER" "$ISOLATE" "$COMMIT$DIRTY" >"$OUT" <<'EOF'
import datetime, statistics, sys
path, reps, duration, load_before, load_after, isolate, commit = sys.argv[1:8]
rows = [line.split() for line in open(path) if line.strip()]
cells = {}
for name, workload, rep, iops, latency, cores in rows:
    cells.setdefault((name, workload), []).append((float(iops), float(latency), float(cores)))
labels = {"spdk": "SPDK nvmf_tgt (malloc, spins)", "reflexd": "reflexd (mem, blocking)",
          "reflexd-poll": "reflexd --poll (mem, spins)"}
print(f"# NVMe/TCP: SPDK nvmf_tgt vs reflexd (bench/nvme-tcp.sh)\n")
print(f"spdk_nvme_perf, 4 KiB, {duration} s per run, medians of {reps} runs; each target on one core,"
      f" perf on another. Load average before {load_before}, after {load_after}. Commit {commit},"
      f" {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC (end). Target CPU "
      + ("kept for the target (`ISOLATE=on`: every other task that could run elsewhere moved off it)"
         if isolate == "on" else "shared with every other task (`ISOLATE=off`)") + ".\n")
for workload in ["randread-qd32", "randrw50-qd32", "randread-qd1"]:
    print(f"## {workload}\n")
    print("| target | IOPS | mean latency (us) | target cores busy | IOPS per target core | best run's IOPS per target core | IOPS of each run |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in ["spdk", "reflexd", "reflexd-poll"]:
        runs = cells.get((name, workload), [])
        if not runs:
            continue
        iops = statistics.median(r[0] for r in runs)
        latency = statistics.median(r[1] for r in runs)
        cores = statistics.median(r[2] for r in runs)
        per_core = statistics.median(r[0] / r[2] if r[2] > 0 else 0 for r in runs)
        best = max(r[0] / r[2] if r[2] > 0 else 0 for r in runs)
        each = ", ".join(f"{r[0]:.0f}" for r in runs)
        print(f"| {labels[name]} | {iops:.0f} | {latency:.1f} | {cores:.2f} | {per_core:.0f} | {best:.0f} | {each} |")
    print()
EOF
cat "$OUT"
