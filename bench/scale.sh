#!/usr/bin/env bash
# Scale per core (issue 10, a benchmark, not a test): one reflexd dataplane thread pinned to
# SERVER_CPU, every client pinned to CLIENT_CPU, a `mem` namespace with the QoS profile
# profiles/mem-unlimited.toml (token rates no core reaches: the scheduler runs and
# charges every request but never holds one back). Three parts (PARTS), REPS repetitions each:
#
#   connections - 10,000 connections per core: reflexd with connections_per_thread_max 10240.
#     (1) ACTIVE connections (ACTIVE_THREADS bench threads × ACTIVE_PER_THREAD) do 4 KiB random
#     reads, closed loop at QD each, for DURATION after WARMUP: IOPS, p50/p99 and the server's
#     CPU per request (`reflex bench --server-pid`: /proc/PID/task/*/schedstat read at the
#     start and end of the measurement). (2) `reflex flood --idle IDLE` opens IDLE connections
#     that each complete a HELLO and then stay idle; after PARK_WAIT_S (they park after
#     recv_buffer_park_after, 1 s) the server's VmRSS is read: bytes per idle connection = RSS
#     delta / IDLE. (3) The same active load again with all of them open, RSS read mid-run.
#     Kernel memory (Slab in /proc/meminfo, TCP pages in /proc/net/sockstat) is recorded too:
#     both ends of every connection live on this machine.
#   tenants - 10,000 tenants per core: the same active load against four servers/states:
#     "off" (profile, --no-qos: FIFO, tenants and accounting stay), "one" (QoS on, every
#     connection on the namespace's default tenant), "reg" (QoS on, TENANTS best-effort tenants
#     registered by `reflex flood --register` over TENANTS/TENANTS_PER_CONNECTION connections,
#     the load still on the default tenant), "bound" (the same TENANTS registered, connection k
#     BOUND to tenant k: ACTIVE active tenants). Scheduler cost = server CPU per request minus
#     that of "off".
#   threads - `--threads 1` against `--threads 2` (the server on both CPUs, the client on
#     CLIENT_CPU; 2 vCPUs cannot show scaling): IOPS and server CPU, no profile (`mem`), 4
#     connections × QD 32; and whether the 2-thread server counts one LC reservation once.
#
# Machine care: servers and clients run at niceness NICE (negative as root), each server
# starts after waiting at most QUIET_WAIT_S for a second in which no CPU was more than
# QUIET_MAX_PERCENT busy; each measured bench records how busy other processes kept the
# server's CPU (from /proc/stat, minus the server). Every step is bounded in time.
# Results: docs/results/scale.md (OUT), raw JSON in $WORK/raw/.
#
# Usage: bench/scale.sh            REPS=1 PARTS=tenants bench/scale.sh
# Environment: REPS (3) PARTS ("connections tenants threads") DURATION (10s) WARMUP (2s)
#   IDLE (9000) ACTIVE_THREADS (4) ACTIVE_PER_THREAD (250) QD (1) TENANTS (10000)
#   TENANTS_PER_CONNECTION (100) PARK_WAIT_S (3) SERVER_CPU (0) CLIENT_CPU (1) PORT (17180)
#   NICE (-20 as root, else 0) QUIET_MAX_PERCENT (20) QUIET_WAIT_S (60) WORK (target/bench-scale)
#   OUT (docs/results/scale.md)
set -euo pipefail
# Command substitutions (others=$(measure ...)) stop at their first failure too.
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
source bench/lib/common.sh

REPS=${REPS:-3}
PARTS=${PARTS:-"connections tenants threads"}
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-2s}
IDLE=${IDLE:-9000}
ACTIVE_THREADS=${ACTIVE_THREADS:-4}
ACTIVE_PER_THREAD=${ACTIVE_PER_THREAD:-250}
QD=${QD:-1}
TENANTS=${TENANTS:-10000}
TENANTS_PER_CONNECTION=${TENANTS_PER_CONNECTION:-100}
PARK_WAIT_S=${PARK_WAIT_S:-3}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
PORT=${PORT:-17180}
if [ "$(id -u)" = 0 ]; then NICE=${NICE:--20}; else NICE=${NICE:-0}; fi
QUIET_MAX_PERCENT=${QUIET_MAX_PERCENT:-20}
QUIET_WAIT_S=${QUIET_WAIT_S:-60}
WORK=${WORK:-target/bench-scale}
OUT=${OUT:-docs/results/scale.md}
STEP_TIMEOUT=${STEP_TIMEOUT:-180}
# A flood holds its connections across several measurements (each at most STEP_TIMEOUT plus a
# quiet wait per retry); its stop file ends it, FLOOD_TIMEOUT_S kills it if something hangs.
FLOOD_TIMEOUT_S=${FLOOD_TIMEOUT_S:-1200}
STALL_MAX_MS=${STALL_MAX_MS:-100}
RETRIES=${RETRIES:-2}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}

[ "$SERVER_CPU" != "$CLIENT_CPU" ] || die "SERVER_CPU and CLIENT_CPU must differ"
require taskset python3 awk
# 10,000 connections need as many descriptors in the server and in the flood.
raise_fd_limit $((IDLE + ACTIVE_THREADS * ACTIVE_PER_THREAD + 256)) \
    "$IDLE + $((ACTIVE_THREADS * ACTIVE_PER_THREAD)) connections"
build_release

RAW="$WORK/raw"
mkdir -p "$RAW"
rm -f "$RAW"/*.json "$RAW"/*.log "$RAW"/*.txt
RUNS="$RAW/runs.jsonl"
: >"$RUNS"
PROFILE=profiles/mem-unlimited.toml
ACTIVE=$((ACTIVE_THREADS * ACTIVE_PER_THREAD))

# Configurations (written here so the script is the whole record).
cat >"$WORK/connections.toml" <<EOF
# bench/scale.sh, part "connections": 10,000 connections on one dataplane thread.
listen = "127.0.0.1"
port = $PORT
original_ports = []
threads = 1
connections_per_thread_max = 10240
requests_per_thread_max = 4096
[nbd]
enabled = false
[[namespace]]
id = 1
backend = "mem:256M"
profile = "$PROFILE"
EOF
sed 's/^connections_per_thread_max = 10240/connections_per_thread_max = 1024/' \
    "$WORK/connections.toml" >"$WORK/connections-1024.toml"
cat >"$WORK/tenants.toml" <<EOF
# bench/scale.sh, part "tenants": 10,000 best-effort tenants on one dataplane thread.
listen = "127.0.0.1"
port = $PORT
original_ports = []
threads = 1
connections_per_thread_max = 2048
tenants_per_connection_max = $TENANTS_PER_CONNECTION
tenants_per_source_max = 16384
[nbd]
enabled = false
[qos_config]
tenants_max = 16384
[[namespace]]
id = 1
backend = "mem:256M"
profile = "$PROFILE"
EOF

SERVER_PID=""
FLOOD_PID=""
cleanup() {
    [ -z "$FLOOD_PID" ] || stop_pid "$FLOOD_PID"
    [ -z "$SERVER_PID" ] || stop_pid "$SERVER_PID"
    FLOOD_PID=""
    SERVER_PID=""
    autogroup_restore
}
trap cleanup EXIT
# Niceness counts only inside a scheduler autogroup (a session): give ours NICE too.
[ "$NICE" -ge 0 ] || autogroup_nice "$NICE"
AUTOGROUP=$(cat /proc/self/autogroup 2>/dev/null || echo none)

# start_server NAME ARGS...: reflexd pinned to SERVER_CPU (or CPUS), log in $RAW/NAME.log.
start_server() {
    local name=$1 cpus=${SERVER_CPUS:-$SERVER_CPU}
    shift
    if [ "$QUIET_WAIT_S" -gt 0 ] && ! wait_quiet "$QUIET_MAX_PERCENT" "$QUIET_WAIT_S"; then
        note "the machine stayed busy for ${QUIET_WAIT_S}s; starting $name anyway"
        echo "busy_start $name" >>"$RAW/notes.txt"
    fi
    nice -n "$NICE" taskset -c "$cpus" "$REFLEXD" "$@" >"$RAW/$name.log" 2>&1 &
    SERVER_PID=$!
    local i
    for ((i = 0; i < 200; i++)); do
        grep -qs "reflexd serving" "$RAW/$name.log" && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.05
    done
    cat "$RAW/$name.log" >&2
    die "reflexd ($name) did not start"
}

stop_server() {
    [ -z "$SERVER_PID" ] || stop_pid "$SERVER_PID"
    SERVER_PID=""
}

rss_kb() { awk '/^VmRSS:/ { print $2 }' /proc/"$1"/status; }
slab_kb() { awk '/^Slab:/ { print $2 }' /proc/meminfo; }
tcp_pages() { awk '$1 == "TCP:" { for (i = 2; i < NF; i++) if ($i == "mem") print $(i + 1) }' /proc/net/sockstat; }

# client ARGS...: a client command pinned to CLIENT_CPU at NICE, bounded in time.
client() { timeout "$STEP_TIMEOUT" nice -n "$NICE" taskset -c "$CLIENT_CPU" "$@"; }

# measure NAME EXTRA_BENCH_ARGS...: the active load against the running server; writes
# $RAW/NAME.json and prints "others" (share of SERVER_CPU other processes were busy). A run
# with a stall, a request that waited more than STALL_MAX_MS and 4 × the run's p99 (our
# processes did not run: other sessions on this machine run real-time tasks at times), is run
# again after waiting for quiet, at most RETRIES times; the last attempt counts.
measure() {
    local name=$1 busy_before busy_after cpu_before cpu_after start end attempt max_ms
    shift
    for ((attempt = 0; attempt <= RETRIES; attempt++)); do
        busy_before=$(cpu_busy_ticks "$SERVER_CPU")
        cpu_before=$(cpu_ns "$SERVER_PID")
        start=$(now_ns)
        client "$REFLEX" bench -s "127.0.0.1:$PORT" --threads "$ACTIVE_THREADS" \
            --connections "$ACTIVE_PER_THREAD" --qd "$QD" --duration "$DURATION" \
            --warmup "$WARMUP" --server-pid "$SERVER_PID" --cpus "$CLIENT_CPU" --json -q "$@" \
            >"$RAW/$name.json" || die "bench $name failed"
        end=$(now_ns)
        cpu_after=$(cpu_ns "$SERVER_PID")
        busy_after=$(cpu_busy_ticks "$SERVER_CPU")
        max_ms=$(python3 -c "
import json
read = json.load(open('$RAW/$name.json'))['rows'][0]['read']
print(int(read['max_us'] / 1000) if read['max_us'] > 4 * read['p99_us'] else 0)")
        if ((max_ms <= STALL_MAX_MS)) || ((attempt == RETRIES)); then
            break
        fi
        note "$name: a request waited $max_ms ms (a stall): again"
        echo "stall $name $max_ms" >>"$RAW/notes.txt"
        [ "$QUIET_WAIT_S" -le 0 ] || wait_quiet "$QUIET_MAX_PERCENT" "$QUIET_WAIT_S" || true
    done
    python3 -c "
import sys
busy = ($busy_after - $busy_before) / $(getconf CLK_TCK)
server = ($cpu_after - $cpu_before) / 1e9
print(f'{max(0.0, busy - server) / (($end - $start) / 1e9):.3f}')"
}

# rss_trimmed_kb PID: VmRSS after the server's allocator gave its free pages back
# (malloc_trim(0) called through gdb, which stops the server for a moment): what the
# server really holds, without memory that was freed but not yet returned. Empty without gdb.
rss_trimmed_kb() {
    command -v gdb >/dev/null || return 0
    timeout 60 gdb -p "$1" -batch -ex 'call (int) malloc_trim(0)' >/dev/null 2>&1 || return 0
    rss_kb "$1"
}

# record KEY=VALUE...: one JSON line in $RUNS.
record() {
    python3 -c '
import json, sys
row = {}
for item in sys.argv[1:]:
    key, value = item.split("=", 1)
    try:
        row[key] = json.loads(value)
    except ValueError:
        row[key] = value
print(json.dumps(row))' "$@" >>"$RUNS"
}

# stop_flood ERR_FILE: ends the running flood's hold through its stop file, waits (at most
# 60 s) for it to unregister and report, and fails if it did not exit cleanly.
stop_flood() {
    local err=$1 i status=0
    touch "$STOP"
    for ((i = 0; i < 600; i++)); do
        kill -0 "$FLOOD_PID" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$FLOOD_PID" 2>/dev/null; then
        stop_pid "$FLOOD_PID"
        FLOOD_PID=""
        die "the flood did not end within 60 s of its stop file ($err)"
    fi
    wait "$FLOOD_PID" || status=$?
    FLOOD_PID=""
    rm -f "$STOP"
    [ "$status" -eq 0 ] || die "the flood failed (exit $status): $(cat "$err")"
}
STOP=$RAW/stop

part_connections() {
    local rep=$1 rss_empty rss_before rss_unparked rss_idle rss_loaded slab_before slab_idle
    local tcp_before tcp_idle others_base others_idle ready=$RAW/ready-connections-$rep
    local rss_default_trim rss_empty_trim rss_before_trim rss_idle_trim
    note "connections, repetition $rep: the table's own cost (1024 slots, then 10240)"
    start_server "connections-default-$rep" --config "$WORK/connections-1024.toml"
    rss_default_trim=$(rss_trimmed_kb "$SERVER_PID")
    stop_server
    note "connections, repetition $rep: reflexd with 10240 connection slots; $ACTIVE active"
    start_server "connections-$rep" --config "$WORK/connections.toml"
    rss_empty=$(rss_kb "$SERVER_PID")
    rss_empty_trim=$(rss_trimmed_kb "$SERVER_PID")
    others_base=$(measure "connections-active-$rep")
    rss_before=$(rss_kb "$SERVER_PID")
    rss_before_trim=$(rss_trimmed_kb "$SERVER_PID")
    slab_before=$(slab_kb)
    tcp_before=$(tcp_pages)
    note "connections, repetition $rep: $IDLE idle connections"
    rm -f "$ready"
    timeout "$FLOOD_TIMEOUT_S" nice -n "$NICE" taskset -c "$CLIENT_CPU" "$REFLEX" flood \
        -s "127.0.0.1:$PORT" --idle "$IDLE" --duration 900s --connect-rate 5000 \
        --ready-file "$ready" --stop-file "$STOP" --json -q >"$RAW/connections-flood-$rep.json" \
        2>"$RAW/connections-flood-$rep.err" &
    FLOOD_PID=$!
    wait_file "$ready" "$FLOOD_PID" 120 ||
        die "the idle flood did not set up: $(cat "$RAW/connections-flood-$rep.err")"
    rss_unparked=$(rss_kb "$SERVER_PID")
    sleep "$PARK_WAIT_S"
    rss_idle=$(rss_kb "$SERVER_PID")
    rss_idle_trim=$(rss_trimmed_kb "$SERVER_PID")
    slab_idle=$(slab_kb)
    tcp_idle=$(tcp_pages)
    note "connections, repetition $rep: $ACTIVE active beside $IDLE idle"
    # RSS with all of them open, half way through the measurement.
    (sleep "$(python3 -c "
import re
def s(t):
    v, u = re.fullmatch(r'([0-9.]+)(ms|s)', t).groups()
    return float(v) / (1000 if u == 'ms' else 1)
print(s('$WARMUP') + s('$DURATION') / 2 + 1)")"
        rss_kb "$SERVER_PID" >"$RAW/rss-loaded-$rep.txt") &
    local sampler=$!
    others_idle=$(measure "connections-with-idle-$rep")
    wait "$sampler" || true
    rss_loaded=$(cat "$RAW/rss-loaded-$rep.txt")
    stop_flood "$RAW/connections-flood-$rep.err"
    stop_server
    record part=connections rep="$rep" active_json="\"$RAW/connections-active-$rep.json\"" \
        idle_json="\"$RAW/connections-with-idle-$rep.json\"" rss_empty_kb="$rss_empty" \
        rss_before_kb="$rss_before" rss_unparked_kb="$rss_unparked" rss_idle_kb="$rss_idle" \
        rss_loaded_kb="$rss_loaded" slab_before_kb="$slab_before" slab_idle_kb="$slab_idle" \
        tcp_pages_before="$tcp_before" tcp_pages_idle="$tcp_idle" others_active="$others_base" \
        others_idle="$others_idle" idle="$IDLE" rss_default_trim_kb="${rss_default_trim:-null}" \
        rss_empty_trim_kb="${rss_empty_trim:-null}" rss_before_trim_kb="${rss_before_trim:-null}" \
        rss_idle_trim_kb="${rss_idle_trim:-null}" flood_json="\"$RAW/connections-flood-$rep.json\""
}

part_tenants() {
    local rep=$1 others ready=$RAW/ready-tenants-$rep handles=$RAW/handles-$rep.txt
    note "tenants, repetition $rep: QoS off"
    start_server "tenants-off-$rep" --config "$WORK/tenants.toml" --no-qos
    others=$(measure "tenants-off-$rep")
    record part=tenants mode=off rep="$rep" json="\"$RAW/tenants-off-$rep.json\"" others="$others"
    stop_server
    note "tenants, repetition $rep: QoS on, one tenant; then $TENANTS registered"
    start_server "tenants-on-$rep" --config "$WORK/tenants.toml"
    others=$(measure "tenants-one-$rep")
    record part=tenants mode=one rep="$rep" json="\"$RAW/tenants-one-$rep.json\"" others="$others"
    rm -f "$ready" "$handles"
    timeout "$FLOOD_TIMEOUT_S" nice -n "$NICE" taskset -c "$CLIENT_CPU" "$REFLEX" flood \
        -s "127.0.0.1:$PORT" --register "$TENANTS" \
        --tenants-per-connection "$TENANTS_PER_CONNECTION" --handles "$handles" \
        --duration 900s --ready-file "$ready" --stop-file "$STOP" --json -q \
        >"$RAW/tenants-flood-$rep.json" \
        2>"$RAW/tenants-flood-$rep.err" &
    FLOOD_PID=$!
    wait_file "$ready" "$FLOOD_PID" 120 ||
        die "registering $TENANTS tenants did not finish: $(cat "$RAW/tenants-flood-$rep.err")"
    [ "$(wc -l <"$handles")" -eq "$TENANTS" ] || die "expected $TENANTS handles in $handles"
    others=$(measure "tenants-reg-$rep")
    record part=tenants mode=reg rep="$rep" json="\"$RAW/tenants-reg-$rep.json\"" others="$others"
    others=$(measure "tenants-bound-$rep" --bind-handles "$handles")
    record part=tenants mode=bound rep="$rep" json="\"$RAW/tenants-bound-$rep.json\"" \
        others="$others"
    stop_flood "$RAW/tenants-flood-$rep.err"
    stop_server
}

part_threads() {
    local rep=$1 threads others
    for threads in 1 2; do
        note "threads, repetition $rep: --threads $threads"
        SERVER_CPUS="$SERVER_CPU,$CLIENT_CPU" start_server "threads-$threads-$rep" --port "$PORT" \
            --no-nbd --no-original -n "1=mem:256M,profile=$PROFILE" --threads "$threads"
        others=$(ACTIVE_THREADS=1 ACTIVE_PER_THREAD=4 QD=32 measure "threads-$threads-$rep")
        record part=threads threads="$threads" rep="$rep" json="\"$RAW/threads-$threads-$rep.json\"" \
            others="$others"
        stop_server
    done
}

# Tenant reservations are counted once, however many threads serve the namespace: the QoS
# plan of a 2-thread server with one LC tenant of 12K IOPS, and the threads that served a
# short load (each logs its scheduler's tokens at shutdown).
reservation_check() {
    note "threads: one LC reservation on a 2-thread server"
    SERVER_CPUS="$SERVER_CPU,$CLIENT_CPU" start_server "threads-reservation" --port "$PORT" \
        --no-nbd --no-original --threads 2 --tenant gold=lc,latency_us=500,iops=12000 \
        -n 1=emu:device-a-small,profile=profiles/device-a-small.toml,tenant=gold
    client "$REFLEX" bench -s "127.0.0.1:$PORT" --connections 8 --qd 4 --duration 2s \
        --warmup 0 --json -q >"$RAW/threads-reservation.json" || die "reservation bench failed"
    stop_server
}

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
for rep in $(seq 1 "$REPS"); do
    for part in $PARTS; do
        "part_$part" "$rep"
    done
done
case " $PARTS " in *" threads "*) reservation_check ;; esac
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

note "writing $OUT"
set_revision
CPU_MODEL=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
export AUTOGROUP RUN_DATE MACHINE COMMIT DIRTY COMMAND LOAD_BEFORE LOAD_AFTER SERVER_CPU CLIENT_CPU NICE \
    DURATION WARMUP IDLE ACTIVE ACTIVE_THREADS ACTIVE_PER_THREAD QD TENANTS TENANTS_PER_CONNECTION \
    PARK_WAIT_S RAW
RUN_DATE=$(date -u +"%Y-%m-%d %H:%M UTC")
MACHINE="$(nproc --all) vCPU ${CPU_MODEL}, $(free -g | awk '/Mem:/ {print $2}') GiB RAM, kernel $(uname -r)"
COMMAND="REPS=$REPS PARTS=\"$PARTS\" DURATION=$DURATION WARMUP=$WARMUP QUIET_WAIT_S=$QUIET_WAIT_S"
# Sizes that differ from their defaults, so the command reruns the same run.
[ "$IDLE" = 9000 ] || COMMAND+=" IDLE=$IDLE"
[ "$TENANTS" = 10000 ] || COMMAND+=" TENANTS=$TENANTS"
[ "$ACTIVE_THREADS" = 4 ] || COMMAND+=" ACTIVE_THREADS=$ACTIVE_THREADS"
[ "$ACTIVE_PER_THREAD" = 250 ] || COMMAND+=" ACTIVE_PER_THREAD=$ACTIVE_PER_THREAD"
[ "$QD" = 1 ] || COMMAND+=" QD=$QD"
[ "$OUT" = docs/results/scale.md ] || COMMAND+=" OUT=$OUT"
COMMAND+=" bench/scale.sh"
mkdir -p "$(dirname "$OUT")"
python3 bench/lib/scale_report.py "$RUNS" "$OUT"
