#!/usr/bin/env bash
# Dataplane benchmark of issue 2 (a benchmark, not a test): in one run, medians of REPS
# repetitions of
#   (a) QD1 4 KiB random-read latency: remote (reflexd on an O_DIRECT file) vs `reflex bench
#       --local` on the same file, next to a raw TCP ping-pong on loopback (32 B .. 4 KiB);
#   (b) 4 KiB random-read IOPS at QD32 on a `mem` namespace with 1 dataplane thread, and the
#       server's CPU time from /proc/PID/stat (utime + stime) -> IOPS per server core;
#   (c) remote vs local IOPS at QD32 on the O_DIRECT file.
# The server runs pinned to SERVER_CPU, the remote clients to CLIENT_CPU (taskset), and the
# local baseline on SERVER_CPU: local Flash is what an application on the server machine sees.
# SERVER_CPU defaults to the CPU that takes the data disk's interrupts, so the server is not
# charged a cross-CPU wake-up per completion that the local run does not pay. Every step is
# bounded in time. Results go to docs/results/dataplane.md (markdown) and the raw JSON of
# every run to $WORK/raw/.
#
# Usage: bench/dataplane.sh                 (defaults below)
#        REPS=5 DURATION=10s SPIN=1 bench/dataplane.sh
# Environment:
#   REPS (3)  DURATION (5s)  WARMUP (1s)  FILE_SIZE_MIB (1024)
#   SERVER_CPU (the data disk's interrupt CPU, else 0)  CLIENT_CPU (another CPU)
#   SPIN (0: server and clients sleep when idle; 1: reflexd --poll, clients --spin)
#   WORK (target/bench-dataplane: must be on a disk, not tmpfs)  PORT (17070)
#   OUT (docs/results/dataplane.md)
#   NICE (0): niceness of server and clients; a negative value (as root) shields the
#   measurement from other work on a shared machine, and is recorded in the results.
#   RT_PRIO (unset): run server and clients SCHED_FIFO at this priority (chrt -f), so their
#   wake-ups preempt other work at once; only sensible without SPIN (spinning real-time
#   tasks would starve the machine).
#   LIMIT (1): then run bench/limit.sh (reflexd against the physical limit, issue 10) with the
#   same REPS, DURATION, CPUs and priority; LIMIT=0 skips it.
#   TLS (1): then run bench/tls.sh (NBD with TLS on and off, reflexd and nbdkit, issue 13)
#   with the same REPS, DURATION and CPUs; TLS=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

REPS=${REPS:-3}
DURATION=${DURATION:-5s}
WARMUP=${WARMUP:-1s}
FILE_SIZE_MIB=${FILE_SIZE_MIB:-1024}
WORK=${WORK:-target/bench-dataplane}
# disk_irq_cpu DIR: the CPU that received most interrupts of the virtio/NVMe device holding DIR.
disk_irq_cpu() {
    local source disk device irq_names
    source=$(df --output=source "$1" 2>/dev/null | tail -1)
    disk=$(lsblk -no pkname "$source" 2>/dev/null | head -1)
    disk=${disk:-$(basename "$source")}
    device=$(basename "$(readlink -f "/sys/block/$disk/device" 2>/dev/null)" 2>/dev/null)
    case "$device" in
        virtio*) irq_names="$device-req" ;;
        nvme*) irq_names="${disk%n*}q" ;;
        *) return 1 ;;
    esac
    awk -v name="$irq_names" 'index($NF, name) == 1 {
        for (cpu = 2; cpu <= NF - 3; cpu++) count[cpu - 2] += $cpu }
        END { best = -1; for (c in count) if (best < 0 || count[c] > count[best]) best = c;
              if (best < 0) exit 1; print best }' /proc/interrupts
}
mkdir -p "$WORK"
SERVER_CPU=${SERVER_CPU:-$(disk_irq_cpu "$WORK" || echo 0)}
CLIENT_CPU=${CLIENT_CPU:-$(( (SERVER_CPU + 1) % $(nproc) ))}
SPIN=${SPIN:-0}
PORT=${PORT:-17070}
OUT=${OUT:-docs/results/dataplane.md}
STEP_TIMEOUT=${STEP_TIMEOUT:-120}
NICE=${NICE:-0}
RT_PRIO=${RT_PRIO:-}
PRIO=(nice -n "$NICE")
if [ -n "$RT_PRIO" ]; then
    if [ "$SPIN" = "1" ]; then
        echo "RT_PRIO with SPIN=1 would starve the machine" >&2
        exit 1
    fi
    PRIO=(chrt -f "$RT_PRIO")
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}

log() { echo "==> $*" >&2; }

log "building release binaries"
cargo build --release -q -p reflex-server -p reflex-cli
REFLEXD="$CARGO_TARGET_DIR/release/reflexd"
REFLEX="$CARGO_TARGET_DIR/release/reflex"

mkdir -p "$WORK/raw"
RAW="$WORK/raw"
rm -f "$RAW"/*.json
FS_TYPE=$(stat -f -c %T "$WORK")
if [ "$FS_TYPE" = "tmpfs" ] || [ "$FS_TYPE" = "ramfs" ]; then
    echo "$WORK is on $FS_TYPE: the O_DIRECT file must live on a disk (set WORK)" >&2
    exit 1
fi
DATA="$WORK/ns1.img"
if [ ! -f "$DATA" ] || [ "$(stat -c %s "$DATA")" -ne $((FILE_SIZE_MIB << 20)) ]; then
    log "writing a ${FILE_SIZE_MIB} MiB data file (real blocks, not sparse) at $DATA"
    timeout "$STEP_TIMEOUT" dd if=/dev/urandom of="$DATA" bs=1M count="$FILE_SIZE_MIB" \
        oflag=direct status=none
fi

SERVER_FLAGS=()
CLIENT_FLAGS=()
PINGPONG_FLAGS=()
if [ "$SPIN" = "1" ]; then
    SERVER_FLAGS+=(--poll)
    CLIENT_FLAGS+=(--spin)
    PINGPONG_FLAGS+=(--spin)
fi

SERVER_PID=""       # the `timeout` wrapper started by this script
SERVER_CORE_PID=""  # reflexd itself, its child
stop_server() {
    if [ -n "$SERVER_CORE_PID" ] && kill -0 "$SERVER_CORE_PID" 2>/dev/null; then
        kill -INT "$SERVER_CORE_PID" 2>/dev/null || true
        for _ in $(seq 1 100); do
            kill -0 "$SERVER_CORE_PID" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$SERVER_CORE_PID" 2>/dev/null; then
            log "reflexd $SERVER_CORE_PID did not stop within 10 s of SIGINT: killing it"
            kill -KILL "$SERVER_CORE_PID" 2>/dev/null || true
        fi
    fi
    if [ -n "$SERVER_PID" ]; then
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
    SERVER_CORE_PID=""
}
trap stop_server EXIT

# start_server BACKEND: reflexd with one namespace and one dataplane thread on SERVER_CPU.
start_server() {
    stop_server
    "${PRIO[@]}" taskset -c "$SERVER_CPU" timeout 900 "$REFLEXD" --port "$PORT" --no-original --threads 1 \
        -n "1=$1" "${SERVER_FLAGS[@]}" >"$WORK/reflexd.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
            # `timeout` is the child of the shell; reflexd is its child.
            SERVER_CORE_PID=$(pgrep -P "$SERVER_PID" -x reflexd || true)
            if [ -z "$SERVER_CORE_PID" ]; then
                echo "cannot find reflexd under $SERVER_PID" >&2
                exit 1
            fi
            return 0
        fi
        sleep 0.1
    done
    echo "reflexd did not start; log:" >&2
    cat "$WORK/reflexd.log" >&2
    exit 1
}

# cpu_ticks PID: utime + stime of a process, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# bench NAME ARGS...: one remote `reflex bench` run pinned to CLIENT_CPU, JSON in $RAW/NAME.json.
bench() { bench_on "$CLIENT_CPU" "$@"; }
# bench_on CPU NAME ARGS...: the same, pinned to CPU.
bench_on() {
    local cpu=$1 name=$2
    shift 2
    timeout "$STEP_TIMEOUT" "${PRIO[@]}" taskset -c "$cpu" "$REFLEX" bench --json -q \
        --warmup "$WARMUP" --duration "$DURATION" "${CLIENT_FLAGS[@]}" "$@" >"$RAW/$name.json"
}

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
log "(a) ping-pong floor"
for rep in $(seq 1 "$REPS"); do
    timeout "$STEP_TIMEOUT" "${PRIO[@]}" "$REFLEX" pingpong --json --count 20000 --warmup-count 2000 \
        --server-cpu "$SERVER_CPU" --client-cpu "$CLIENT_CPU" "${PINGPONG_FLAGS[@]}" \
        >"$RAW/pingpong-$rep.json"
done

log "(a, c) remote and local on the O_DIRECT file"
start_server "file:$DATA"
for rep in $(seq 1 "$REPS"); do
    bench "remote-file-qd1-$rep" -s "127.0.0.1:$PORT" --qd 1
    bench_on "$SERVER_CPU" "local-file-qd1-$rep" --local "$DATA" --qd 1
    bench "remote-file-qd32-$rep" -s "127.0.0.1:$PORT" --qd 32
    bench_on "$SERVER_CPU" "local-file-qd32-$rep" --local "$DATA" --qd 32
done
stop_server

log "(b) IOPS per server core on mem"
start_server "mem:1G"
CLK_TCK=$(getconf CLK_TCK)
for rep in $(seq 1 "$REPS"); do
    for connections in 1 4; do
        name="remote-mem-qd32-c$connections-$rep"
        before=$(cpu_ticks "$SERVER_CORE_PID")
        start_ns=$(date +%s%N)
        bench "$name" -s "127.0.0.1:$PORT" --qd 32 --connections "$connections"
        end_ns=$(date +%s%N)
        after=$(cpu_ticks "$SERVER_CORE_PID")
        echo "{\"cpu_ticks\": $((after - before)), \"clk_tck\": $CLK_TCK, \"wall_ns\": $((end_ns - start_ns))}" \
            >"$RAW/$name.cpu.json"
    done
done
stop_server

log "writing $OUT"
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
DIRTY=$(git status --porcelain 2>/dev/null | grep -q . && echo " (with uncommitted changes)" || true)
CPU_MODEL=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
mkdir -p "$(dirname "$OUT")"
export RUN_DATE MACHINE COMMIT DIRTY COMMAND DURATION WARMUP SERVER_CPU CLIENT_CPU FILE_SIZE_MIB FS_TYPE SPIN NICE RT_PRIO LOAD_BEFORE
RUN_DATE=$(date -u +"%Y-%m-%d %H:%M UTC")
MACHINE="$(nproc --all) vCPU ${CPU_MODEL}, $(free -g | awk '/Mem:/ {print $2}') GiB RAM, kernel $(uname -r)"
COMMAND="REPS=$REPS DURATION=$DURATION WARMUP=$WARMUP SPIN=$SPIN NICE=$NICE${RT_PRIO:+ RT_PRIO=$RT_PRIO} bench/dataplane.sh"
python3 - "$RAW" "$REPS" "$OUT" <<'PY'
import json, statistics, sys, glob, os
raw, reps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def load(name):
    with open(os.path.join(raw, name + ".json")) as f:
        return json.load(f)

def med(values):
    return statistics.median(values)

def runs(prefix):
    return [load(f"{prefix}-{rep}") for rep in range(1, reps + 1)]

def row0(report):
    return report["rows"][0]

pingpong = [load(f"pingpong-{rep}") for rep in range(1, reps + 1)]
sizes = [row["size_bytes"] for row in pingpong[0]]
pp = {size: {k: med([next(r for r in run if r["size_bytes"] == size)["round_trip"][k] for run in pingpong])
             for k in ("p50_us", "p99_us", "avg_us")} for size in sizes}

def lat(prefix):
    rows = [row0(r)["read"] for r in runs(prefix)]
    return {k: med([row[k] for row in rows]) for k in ("p50_us", "p90_us", "p99_us", "p999_us", "avg_us")}

def iops(prefix):
    return med([row0(r)["iops"] for r in runs(prefix)])

remote_qd1, local_qd1 = lat("remote-file-qd1"), lat("local-file-qd1")
remote_qd32, local_qd32 = iops("remote-file-qd32"), iops("local-file-qd32")
remote_qd32_lat, local_qd32_lat = lat("remote-file-qd32"), lat("local-file-qd32")

def mem(connections):
    iops_values, util_values, per_core = [], [], []
    for rep in range(1, reps + 1):
        name = f"remote-mem-qd32-c{connections}-{rep}"
        report = load(name)
        cpu = load(name + ".cpu")
        utilisation = cpu["cpu_ticks"] / cpu["clk_tck"] / (cpu["wall_ns"] / 1e9)
        value = row0(report)["iops"]
        iops_values.append(value)
        util_values.append(utilisation)
        per_core.append(value / max(utilisation, 1e-9))
    return med(iops_values), med(util_values), med(per_core)

mem1, mem4 = mem(1), mem(4)
floor = pp[4096]["p50_us"]
gap = remote_qd1["p50_us"] - local_qd1["p50_us"]
ratio = remote_qd32 / local_qd32 if local_qd32 else float("nan")
best_per_core = max(mem1[2], mem4[2])

def verdict(ok):
    return "met" if ok else "**not met**"

spin = os.environ.get("SPIN", "0") == "1"
lines = []
add = lines.append
add("# Dataplane benchmark (issue 2)")
add("")
add(f"- date: {os.environ['RUN_DATE']}")
add(f"- machine: {os.environ['MACHINE']}")
add(f"- commit: {os.environ['COMMIT']}{os.environ['DIRTY']}")
add(f"- command: `{os.environ['COMMAND']}`")
add(f"- each figure is the median of {reps} runs of {os.environ['DURATION']} after {os.environ['WARMUP']} of warm-up; "
    f"reflexd pinned to CPU {os.environ['SERVER_CPU']} (the data disk's interrupt CPU unless overridden) with 1 dataplane thread "
    f"({'polling (--poll)' if spin else 'blocking (sleeps in the ring when idle)'}), remote clients pinned to CPU "
    f"{os.environ['CLIENT_CPU']} ({'--spin' if spin else 'sleeping in the ring'}), the local baseline on the server's CPU "
    f"(local Flash is what an application on the server machine sees); loopback TCP.")
add(f"- data file: {os.environ['FILE_SIZE_MIB']} MiB written with random data through O_DIRECT on {os.environ['FS_TYPE']} "
    f"(not tmpfs); reflexd serves it as `file:` (O_DIRECT), `reflex bench --local` opens the same file with O_DIRECT; "
    "random 4 KiB reads over the whole file.")
add("- latencies are measured by `reflex bench` from the intended send time to the parsed response, in µs.")
prio = f"SCHED_FIFO priority {os.environ['RT_PRIO']}" if os.environ.get('RT_PRIO') else f"niceness {os.environ['NICE']}"
add(f"- {prio}; load average before the run: {os.environ['LOAD_BEFORE']} "
    "(other work on the machine competes for the same 2 cores and shows up as tail latency and lost IOPS).")
add("")
add("## Targets")
add("")
add("| target | measured | verdict |")
add("|---|---|---|")
add(f"| ≥ 300K IOPS per server core (4 KiB reads, QD32, mem, 1 thread) | {best_per_core/1e3:.0f}K IOPS per core | {verdict(best_per_core >= 300e3)} |")
add(f"| remote QD1 p50 − local QD1 p50 ≤ ping-pong p50 (4 KiB) + 5 µs | {gap:.1f} µs vs {floor:.1f} + 5 = {floor+5:.1f} µs | {verdict(gap <= floor + 5)} |")
add(f"| remote ≥ 95 % of local IOPS at QD32 on the O_DIRECT file | {ratio*100:.1f} % | {verdict(ratio >= 0.95)} |")
add("")
add("## (a) QD1 4 KiB random-read latency (µs)")
add("")
add("| path | avg | p50 | p90 | p99 | p99.9 |")
add("|---|---|---|---|---|---|")
for name, l in (("remote (reflexd, file O_DIRECT)", remote_qd1), ("local (io_uring, same file, O_DIRECT)", local_qd1)):
    add(f"| {name} | {l['avg_us']:.1f} | {l['p50_us']:.1f} | {l['p90_us']:.1f} | {l['p99_us']:.1f} | {l['p999_us']:.1f} |")
add(f"| remote − local | {remote_qd1['avg_us']-local_qd1['avg_us']:.1f} | {gap:.1f} | | | |")
add("")
add("TCP ping-pong on loopback, QD1 (round trip, µs):")
add("")
add("| bytes | avg | p50 | p99 |")
add("|---|---|---|---|")
for size in sizes:
    add(f"| {size} | {pp[size]['avg_us']:.1f} | {pp[size]['p50_us']:.1f} | {pp[size]['p99_us']:.1f} |")
add("")
add("## (b) IOPS per server core: 4 KiB random reads at QD32 on `mem`, 1 dataplane thread")
add("")
add("| client | IOPS | server CPU (cores busy) | IOPS per server core |")
add("|---|---|---|---|")
for label, (value, utilisation, per) in (("1 connection × QD32", mem1), ("4 connections × QD32", mem4)):
    add(f"| {label} | {value/1e3:.0f}K | {utilisation:.2f} | {per/1e3:.0f}K |")
add("")
add("Server CPU = (utime + stime) of reflexd from /proc/PID/stat over the whole client run "
    "(connect, warm-up, measurement) divided by its wall time; IOPS per core = IOPS / that.")
add("")
add("## (c) QD32 4 KiB random reads on the O_DIRECT file")
add("")
add("| path | IOPS | p50 µs | p99 µs |")
add("|---|---|---|---|")
add(f"| remote | {remote_qd32/1e3:.1f}K | {remote_qd32_lat['p50_us']:.0f} | {remote_qd32_lat['p99_us']:.0f} |")
add(f"| local | {local_qd32/1e3:.1f}K | {local_qd32_lat['p50_us']:.0f} | {local_qd32_lat['p99_us']:.0f} |")
add(f"| remote / local | {ratio*100:.1f} % | | |")
add("")
add(f"Raw JSON of every run: `{raw}/`.")
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY

if [ "${LIMIT:-1}" = "1" ]; then
    log "(d) the physical limit: bench/limit.sh"
    stop_server
    REPS=$REPS DURATION=$DURATION SERVER_CPU=$SERVER_CPU CLIENT_CPU=$CLIENT_CPU NICE=$NICE \
        RT_PRIO=$RT_PRIO bench/limit.sh
fi

if [ "${TLS:-1}" = "1" ]; then
    log "(e) what TLS costs: bench/tls.sh"
    stop_server
    REPS=$REPS RUNTIME_S=${DURATION%s} SERVER_CPU=$SERVER_CPU CLIENT_CPU=$CLIENT_CPU \
        bench/tls.sh
fi
