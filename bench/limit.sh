#!/usr/bin/env bash
# The physical limit (issue 10, a benchmark, not a test): how close reflexd comes to the
# fastest a one-thread io_uring loop can answer the original ReFlex protocol on this machine.
# In one run, medians of REPS repetitions of, for limit-server (bench/limit, the yardstick) and
# reflexd (`mem` namespace behind an original-protocol port, 1 dataplane thread), each blocking
# and with --poll:
#   (a) 4 KiB random reads, closed loop, 16 connections × 32 deep and 4 × 32, for DURATION:
#       replies per server core-second = replies / server CPU seconds, the server's CPU summed
#       over all its threads from /proc/PID/task/*/schedstat (cpu_ns in bench/lib/common.sh)
#       around the whole client run; and the ratio reflexd / limit-server;
#   (b) QD1 latency: one connection at depth 1, the client sleeping in the kernel between
#       replies (limit-client --qd1-sleep): p50 and p99.
# The same client (limit-client, one io_uring thread, never spinning) drives every server. The
# server runs pinned to SERVER_CPU, the client to CLIENT_CPU (taskset). Servers are started one
# at a time, in the same order in every repetition, after waiting (at most QUIET_WAIT_S) for
# the machine to be quiet. Every step is bounded in time. Results: docs/results/limit.md, raw
# JSON of every run in $WORK/raw/.
#
# Usage: bench/limit.sh                       (defaults below)
#        REPS=5 DURATION=10s bench/limit.sh
# Environment:
#   REPS (3)  DURATION (5s)  SERVER_CPU (0)  CLIENT_CPU (another CPU)
#   PORT (17080: limit-server; PORT+1: reflexd's original-protocol port)
#   WORK (target/bench-limit)  OUT (docs/results/limit.md)
#   REFLEXD (the release build of this tree): another reflexd binary, to compare builds
#   NICE (0): niceness of servers and client (negative, as root, shields them from other work)
#   RT_PRIO (unset): run blocking servers and the client SCHED_FIFO at this priority; polling
#   servers then keep the normal policy (a spinning real-time task would starve the machine)
#   QUIET_MAX_PERCENT (20) QUIET_WAIT_S (60): before each server starts, wait at most
#   QUIET_WAIT_S for one second in which no CPU was more than QUIET_MAX_PERCENT busy.
#   OTHERS_MAX_PERCENT (10) RETRIES (2): a point during which other processes were busy more
#   than OTHERS_MAX_PERCENT of the server's or the client's CPU (from /proc/stat, minus our
#   server or client and that CPU's ksoftirqd) is run again, after waiting for quiet, at most
#   RETRIES times; the last attempt counts and the report says how disturbed it was.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

REPS=${REPS:-3}
DURATION=${DURATION:-5s}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-$(( (SERVER_CPU + 1) % $(nproc) ))}
PORT=${PORT:-17080}
WORK=${WORK:-target/bench-limit}
OUT=${OUT:-docs/results/limit.md}
NICE=${NICE:-0}
RT_PRIO=${RT_PRIO:-}
QUIET_MAX_PERCENT=${QUIET_MAX_PERCENT:-20}
QUIET_WAIT_S=${QUIET_WAIT_S:-60}
OTHERS_MAX_PERCENT=${OTHERS_MAX_PERCENT:-10}
RETRIES=${RETRIES:-2}
STEP_TIMEOUT=${STEP_TIMEOUT:-120}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}

[ "$SERVER_CPU" != "$CLIENT_CPU" ] || die "SERVER_CPU and CLIENT_CPU must differ"
require taskset python3 awk

note "building release binaries"
cargo build --release -q -p reflex-server -p reflex-limit
REFLEXD=${REFLEXD:-"$CARGO_TARGET_DIR/release/reflexd"}
LIMIT_SERVER="$CARGO_TARGET_DIR/release/limit-server"
LIMIT_CLIENT="$CARGO_TARGET_DIR/release/limit-client"

RAW="$WORK/raw"
mkdir -p "$RAW"
rm -f "$RAW"/*.json "$RAW"/*.log
RUNS="$RAW/runs.tsv"
: >"$RUNS"

# prio POLLING: the command prefix that sets a process's priority.
prio() {
    if [ -n "$RT_PRIO" ] && [ "$1" != "1" ]; then
        echo chrt -f "$RT_PRIO"
    else
        echo nice -n "$NICE"
    fi
}

SERVER_PID=""
stop_server() {
    [ -z "$SERVER_PID" ] || stop_pid "$SERVER_PID"
    SERVER_PID=""
}
trap stop_server EXIT

# start_server NAME: limit, limit-poll, reflexd or reflexd-poll, pinned to SERVER_CPU.
start_server() {
    local name=$1 port polling=0 flags=()
    case "$name" in
        *-poll) polling=1; flags+=(--poll) ;;
    esac
    case "$name" in
        limit*)
            port=$PORT
            limit_server_command "$LIMIT_SERVER" "$port" "${flags[@]}"
            ;;
        reflexd*)
            port=$((PORT + 1))
            reflexd_mem_command "$REFLEXD" "$port" 0 "${flags[@]}"
            ;;
    esac
    if [ "$QUIET_WAIT_S" -gt 0 ] && ! wait_quiet "$QUIET_MAX_PERCENT" "$QUIET_WAIT_S"; then
        note "the machine stayed busy for ${QUIET_WAIT_S}s; running $name anyway"
        echo "busy_start $name" >>"$RAW/notes.txt"
    fi
    # nice/chrt and taskset exec the server: $! is the server's own pid.
    # shellcheck disable=SC2046
    $(prio "$polling") taskset -c "$SERVER_CPU" "${SERVER_COMMAND[@]}" >"$RAW/$name.log" 2>&1 &
    SERVER_PID=$!
    wait_port "$port" "$SERVER_PID" 20 || { cat "$RAW/$name.log" >&2; die "$name did not start"; }
    SERVER_PORT=$port
}

# Softirq work the kernel defers to a CPU's ksoftirqd thread is charged to neither server nor
# client: it is measured separately.
KSOFTIRQD_SERVER=$(pgrep -x "ksoftirqd/$SERVER_CPU" || echo 0)
KSOFTIRQD_CLIENT=$(pgrep -x "ksoftirqd/$CLIENT_CPU" || echo 0)
ksoftirqd_ns() { if [ "$1" = 0 ]; then echo 0; else cpu_ns "$1"; fi; }

# point REP NAME SHAPE CLIENT_ARGS...: one client run against the running server, with the
# server's CPU time, the ksoftirqd threads' and both CPUs' busy ticks read around it; run again
# (at most RETRIES times) while other processes disturbed it.
point() {
    local rep=$1 name=$2 shape=$3 attempt json err
    shift 3
    json="$RAW/$name-$shape-$rep.json"
    err="$RAW/$name-$shape-$rep.err"
    for ((attempt = 0; attempt <= RETRIES; attempt++)); do
        local cpu_before cpu_after soft_server_before soft_server_after soft_client_before
        local soft_client_after server_busy_before server_busy_after client_busy_before
        local client_busy_after start end ticks_before ticks_after
        cpu_before=$(cpu_ns "$SERVER_PID")
        ticks_before=$(cpu_user_sys_ticks "$SERVER_PID")
        soft_server_before=$(ksoftirqd_ns "$KSOFTIRQD_SERVER")
        soft_client_before=$(ksoftirqd_ns "$KSOFTIRQD_CLIENT")
        server_busy_before=$(cpu_busy_ticks "$SERVER_CPU")
        client_busy_before=$(cpu_busy_ticks "$CLIENT_CPU")
        start=$(now_ns)
        # shellcheck disable=SC2046
        if ! timeout "$STEP_TIMEOUT" $(prio 0) taskset -c "$CLIENT_CPU" "$LIMIT_CLIENT" \
            --addr "127.0.0.1:$SERVER_PORT" --duration "$DURATION" --seed "$rep" --json "$@" \
            >"$json" 2>"$err"; then
            cat "$err" >&2
            die "limit-client failed against $name ($shape, repetition $rep)"
        fi
        end=$(now_ns)
        cpu_after=$(cpu_ns "$SERVER_PID")
        ticks_after=$(cpu_user_sys_ticks "$SERVER_PID")
        soft_server_after=$(ksoftirqd_ns "$KSOFTIRQD_SERVER")
        soft_client_after=$(ksoftirqd_ns "$KSOFTIRQD_CLIENT")
        server_busy_after=$(cpu_busy_ticks "$SERVER_CPU")
        client_busy_after=$(cpu_busy_ticks "$CLIENT_CPU")
        kill -0 "$SERVER_PID" 2>/dev/null || die "$name exited during the run"
        local row
        local user_ticks sys_ticks
        user_ticks=$((${ticks_after% *} - ${ticks_before% *}))
        sys_ticks=$((${ticks_after#* } - ${ticks_before#* }))
        row=$(printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s' "$rep" "$name" "$shape" \
            "$json" "$((cpu_after - cpu_before))" "$((end - start))" \
            "$((server_busy_after - server_busy_before))" \
            "$((client_busy_after - client_busy_before))" \
            "$((soft_server_after - soft_server_before))" \
            "$((soft_client_after - soft_client_before))" "$attempt" "$user_ticks" "$sys_ticks")
        if ! python3 - "$row" "$OTHERS_MAX_PERCENT" "$(getconf CLK_TCK)" <<'PY'
import json, sys
row, limit, clk_tck = sys.argv[1].split("\t"), float(sys.argv[2]), int(sys.argv[3])
wall_s = int(row[5]) / 1e9
client_s = json.load(open(row[3])).get("client_cpu_s") or 0.0
others_server = int(row[6]) / clk_tck - int(row[4]) / 1e9 - int(row[8]) / 1e9
others_client = int(row[7]) / clk_tck - client_s - int(row[9]) / 1e9
sys.exit(0 if max(others_server, others_client) / wall_s * 100 <= limit else 1)
PY
        then
            if ((attempt < RETRIES)); then
                note "$name $shape repetition $rep was disturbed by other work: again"
                [ "$QUIET_WAIT_S" -le 0 ] || wait_quiet "$QUIET_MAX_PERCENT" "$QUIET_WAIT_S" || true
                continue
            fi
            note "$name $shape repetition $rep was disturbed by other work $((RETRIES + 1)) times: kept"
        fi
        echo "$row" >>"$RUNS"
        return 0
    done
}

SERVERS=(limit reflexd limit-poll reflexd-poll)
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
for rep in $(seq 1 "$REPS"); do
    for name in "${SERVERS[@]}"; do
        note "repetition $rep of $REPS: $name"
        start_server "$name"
        point "$rep" "$name" c16d32 --connections 16 --depth 32
        point "$rep" "$name" c4d32 --connections 4 --depth 32
        point "$rep" "$name" qd1 --qd1-sleep
        stop_server
    done
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

note "writing $OUT"
set_revision
CPU_MODEL=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
export RUN_DATE MACHINE COMMIT DIRTY COMMAND DURATION SERVER_CPU CLIENT_CPU NICE RT_PRIO \
    LOAD_BEFORE LOAD_AFTER CLK_TCK
RUN_DATE=$(date -u +"%Y-%m-%d %H:%M UTC")
MACHINE="$(nproc --all) vCPU ${CPU_MODEL}, $(free -g | awk '/Mem:/ {print $2}') GiB RAM, kernel $(uname -r)"
COMMAND="REPS=$REPS DURATION=$DURATION NICE=$NICE${RT_PRIO:+ RT_PRIO=$RT_PRIO} QUIET_WAIT_S=$QUIET_WAIT_S RETRIES=$RETRIES OTHERS_MAX_PERCENT=$OTHERS_MAX_PERCENT bench/limit.sh"
CLK_TCK=$(getconf CLK_TCK)
mkdir -p "$(dirname "$OUT")"
python3 - "$RUNS" "$OUT" "$RAW" <<'PY'
import json, os, statistics, sys

runs_path, out, raw = sys.argv[1:4]
clk_tck = int(os.environ["CLK_TCK"])
points = {}
for line in open(runs_path):
    (rep, name, shape, path, cpu_ns, wall_ns, server_busy, client_busy, soft_server, soft_client,
     attempt, user_ticks, sys_ticks) = line.rstrip("\n").split("\t")
    report = json.load(open(path))
    wall_s = int(wall_ns) / 1e9
    server_cpu_s = int(cpu_ns) / 1e9
    client_cpu_s = report.get("client_cpu_s") or 0.0
    points.setdefault((name, shape), []).append({
        "replies_per_sec": report["replies_per_sec"],
        "replies_total": report["replies_total"],
        "server_cores": server_cpu_s / wall_s,
        "per_core": report["replies_total"] / server_cpu_s if server_cpu_s > 0 else float("nan"),
        "client_cores": client_cpu_s / wall_s,
        "ksoftirqd_server_cores": int(soft_server) / 1e9 / wall_s,
        # Busy time on each CPU that neither our server or client nor that CPU's ksoftirqd
        # accounts for.
        "others_server_cpu": max(0.0, (int(server_busy) / clk_tck - server_cpu_s - int(soft_server) / 1e9) / wall_s),
        "others_client_cpu": max(0.0, (int(client_busy) / clk_tck - client_cpu_s - int(soft_client) / 1e9) / wall_s),
        "attempt": int(attempt),
        # Tick-sampled split of the server's CPU time: the share spent in user space.
        "user_share": int(user_ticks) / max(1, int(user_ticks) + int(sys_ticks)),
        "p50_us": report["latency"]["p50_us"],
        "p99_us": report["latency"]["p99_us"],
    })

def med(name, shape, key):
    return statistics.median(run[key] for run in points[(name, shape)])

def spread(name, shape, key, scale=1e3, unit="K"):
    values = sorted(run[key] for run in points[(name, shape)])
    return f"{values[0]/scale:.0f}–{values[-1]/scale:.0f}{unit}"

env = os.environ
lines = []
add = lines.append
add("# The physical limit: reflexd against a minimal io_uring server (issue 10)")
add("")
add(f"- date: {env['RUN_DATE']}")
add(f"- machine: {env['MACHINE']}")
add(f"- commit: {env['COMMIT']}{env['DIRTY']}")
add(f"- command: `{env['COMMAND']}`")
reps = len(points[("limit", "qd1")])
add(f"- every figure is the median of {reps} runs of {env['DURATION']}; servers pinned to CPU "
    f"{env['SERVER_CPU']}, the client (`limit-client`, one io_uring thread that sleeps in the kernel "
    f"when it waits) to CPU {env['CLIENT_CPU']}; loopback TCP; 4 KiB random reads over 1 GiB.")
add("- `limit-server` (bench/limit): one thread, one io_uring, 24-byte header parsing only, data from "
    "one static 1 MiB region sent as iovecs of one `sendmsg` per batch, one `io_uring_enter` per loop "
    "iteration. `reflexd`: `--threads 1 -n 1=mem:1G --original-port PORT=1 --no-nbd` (full "
    "validation, tenant accounting, the `mem` device copying into its registered arena).")
add("- server CPU: the sum over all the server's threads of `/proc/PID/task/*/schedstat` (first field, "
    "ns: exact, steal time excluded) read just before and just after the client run, connecting "
    "included; replies per server core-second = all replies of the run / that. This kernel has no "
    "IRQ time accounting: softirq work done in the server's context (loopback delivery of its "
    "replies into the client's socket) is charged to the server, the same way for both servers.")
prio = (f"SCHED_FIFO priority {env['RT_PRIO']} for blocking servers and the client"
        if env.get("RT_PRIO") else f"niceness {env['NICE']}")
add(f"- {prio}; load average before {env['LOAD_BEFORE']}, after {env['LOAD_AFTER']}. "
    "\"ksoftirqd\": softirq work the kernel deferred to the server CPU's ksoftirqd thread, charged to "
    "no one else; \"others\": time other processes were busy on that CPU during the run beyond our "
    "server or client and that ksoftirqd (from /proc/stat ticks, 1 % resolution); large values mean "
    "a disturbed run.")
add("")
add("## Throughput per server core")
add("")
add("| server | mode | client shape | replies/s | server CPU (cores) | replies per server core-second | range over runs | server CPU in user space | client CPU (cores) | ksoftirqd on server CPU (cores) | others on server / client CPU |")
add("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
labels = {"limit": ("limit-server", "blocking"), "limit-poll": ("limit-server", "--poll"),
          "reflexd": ("reflexd", "blocking"), "reflexd-poll": ("reflexd", "--poll")}
shapes = {"c16d32": "16 × 32", "c4d32": "4 × 32"}
for mode in ("", "-poll"):
    for shape in shapes:
        for server in ("limit", "reflexd"):
            name = server + mode
            label, mode_label = labels[name]
            add(f"| {label} | {mode_label} | {shapes[shape]} | {med(name, shape, 'replies_per_sec')/1e3:.0f}K | "
                f"{med(name, shape, 'server_cores'):.2f} | **{med(name, shape, 'per_core')/1e3:.0f}K** | "
                f"{spread(name, shape, 'per_core')} | {med(name, shape, 'user_share')*100:.0f} % | "
                f"{med(name, shape, 'client_cores'):.2f} | "
                f"{med(name, shape, 'ksoftirqd_server_cores'):.2f} | "
                f"{med(name, shape, 'others_server_cpu')*100:.0f} % / {med(name, shape, 'others_client_cpu')*100:.0f} % |")
add("")
add("## reflexd / limit-server, replies per server core-second")
add("")
add("| mode | 16 × 32 | 4 × 32 |")
add("|---|---:|---:|")
for mode, label in (("", "blocking"), ("-poll", "--poll")):
    cells = []
    for shape in shapes:
        ratio = med("reflexd" + mode, shape, "per_core") / med("limit" + mode, shape, "per_core")
        cells.append(f"**{ratio*100:.0f} %**")
    add(f"| {label} | {' | '.join(cells)} |")
add("")
add("Server CPU in user space: utime over utime + stime of the server's threads "
    "(`/proc/PID/task/*/stat`, clock ticks, so a split rather than a measure); the rest is the kernel "
    "(system calls, TCP, the copy into the socket, loopback delivery). Its kernel time per reply, "
    "(1 − share) / replies per core-second, compares the two servers' kernel work.")
add("")
add("A polling server is busy 100 % of the time whatever its load, so with `--poll` replies per "
    "core-second equal replies per second and measure the *pair*: when the client's CPU column is "
    "near 1.00 the client, not the server, sets the pace, and the ratio understates the gap.")
add("")
add("## QD1 latency, sleeping client (µs)")
add("")
add("| server | mode | p50 | p99 | replies/s |")
add("|---|---|---:|---:|---:|")
for name in ("limit", "reflexd", "limit-poll", "reflexd-poll"):
    label, mode_label = labels[name]
    add(f"| {label} | {mode_label} | **{med(name, 'qd1', 'p50_us'):.1f}** | {med(name, 'qd1', 'p99_us'):.1f} | "
        f"{med(name, 'qd1', 'replies_per_sec')/1e3:.1f}K |")
add("")
retried = sorted({f"{name} {shape}" for (name, shape), runs in points.items() for run in runs if run["attempt"] > 0})
if retried:
    add(f"Points run again because other processes were busy on our CPUs: {', '.join(retried)} "
        f"(the last attempt counts).")
    add("")
notes_path = os.path.join(raw, "notes.txt")
if os.path.exists(notes_path):
    busy = [line.split()[1] for line in open(notes_path) if line.startswith("busy_start")]
    if busy:
        add(f"Started without a quiet second first (the machine stayed busy): {', '.join(busy)}.")
        add("")
add(f"Raw JSON of every run: `{raw}/`.")
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
