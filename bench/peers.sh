#!/usr/bin/env bash
# Side-by-side benchmark of NBD servers on loopback: reflexd, nbdkit (memory and file plugins),
# qemu-nbd and nbd-server, each loaded by two clients (issue 5, item 3):
#   fio         the standard client: fio's nbd engine (libnbd, one connection), plus fio's
#               io_uring engine on the same file locally and a raw TCP ping-pong as the
#               latency floor;
#   saturating  `reflex bench --server nbd://...`: the bench engine over NBD, several
#               connections, requests batched per send, so that the server, not the client,
#               is the bottleneck (fio's client tops out near 65K IOPS on its core).
#
#   bench/peers.sh                  # everything, REPS repetitions, medians
#   REPS=1 RUNTIME_S=2 bench/peers.sh   # a quick smoke run
#   SECTIONS=saturating bench/peers.sh  # only the saturating-client section
#   QUIET_WAIT_S=600 bench/peers.sh     # wait for a quiet machine before each job
#
# Cases of the fio section, all 4 KiB random reads, one connection:
#   hot   data in memory (nbdkit memory, reflexd mem:, the others on a tmpfs file):
#         QD1 latency percentiles, QD32 IOPS, each server's CPU time -> IOPS per server core
#   disk  a file on the root (ext4) disk read with O_DIRECT where the server can (qemu-nbd
#         cache=none, reflexd, fio locally); nbdkit file uses cache=none (page cache evicted
#         after each read), nbd-server has no such option and reads through the page cache
#   floor `reflex pingpong`: TCP round trips of 32 B and 4 KiB messages
# Cases of the saturating section, 4 KiB random reads, closed loop, no warm-up:
#   hot   SAT_CONNECTIONS connections x SAT_QD (default 4 x 32) against reflexd (blocking and
#         --poll), nbdkit memory, qemu-nbd and nbd-server (tmpfs): IOPS, each server's CPU
#         time -> IOPS per server core
#   disk  SAT_DISK_CONNECTIONS x SAT_DISK_QD (default 1 x 32) against reflexd (blocking and
#         --poll), nbdkit file and qemu-nbd on the disk file, next to `reflex bench --local`
#         (io_uring, O_DIRECT) with the same queue depth on the same file: remote/local ratio
# Servers run pinned to SERVER_CPU, fio, `reflex bench` and the ping-pong client to CLIENT_CPU
# (taskset); the local baselines run on SERVER_CPU (see run_one).
# Writes docs/results/peers.md and docs/img/peers.svg; raw JSON stays under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

REPS=${REPS:-3}
RUNTIME_S=${RUNTIME_S:-5}
HOT_SIZE=${HOT_SIZE:-256M}
DISK_SIZE=${DISK_SIZE:-1G}
SERVER_CPU=${SERVER_CPU:-1}
CLIENT_CPU=${CLIENT_CPU:-0}
PINGPONG_COUNT=${PINGPONG_COUNT:-20000}
# Which sections to run: "fio", "saturating" or both.
SECTIONS=${SECTIONS:-fio saturating}
SAT_CONNECTIONS=${SAT_CONNECTIONS:-4}
SAT_QD=${SAT_QD:-32}
SAT_DISK_CONNECTIONS=${SAT_DISK_CONNECTIONS:-1}
SAT_DISK_QD=${SAT_DISK_QD:-32}
# Before each job, wait up to QUIET_WAIT_S for every CPU to be at most QUIET_MAX_PERCENT busy
# with other processes (0: do not wait). The report shows how busy the server CPU was anyway.
QUIET_WAIT_S=${QUIET_WAIT_S:-0}
QUIET_MAX_PERCENT=${QUIET_MAX_PERCENT:-10}
DISK_DIR=${DISK_DIR:-/var/tmp/reflex-peers}
HOT_DIR=${HOT_DIR:-/dev/shm/reflex-peers}
OUT=${OUT:-target/peers/$(date +%Y%m%d-%H%M%S)}
RESULTS_MD=${RESULTS_MD:-docs/results/peers.md}
PLOT_SVG=${PLOT_SVG:-docs/img/peers.svg}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
REFLEXD=${REFLEXD:-$CARGO_TARGET_DIR/release/reflexd}
REFLEX=${REFLEX:-$CARGO_TARGET_DIR/release/reflex}
PY=/usr/bin/python3
export PYTHONDONTWRITEBYTECODE=1

[ "$REPS" -ge 1 ] && [ "$REPS" -le 20 ] || die "REPS must be 1..20"
[ "$RUNTIME_S" -ge 1 ] && [ "$RUNTIME_S" -le 120 ] || die "RUNTIME_S must be 1..120"
for value in "$SAT_CONNECTIONS" "$SAT_DISK_CONNECTIONS"; do
    [ "$value" -ge 1 ] && [ "$value" -le 64 ] || die "SAT_*CONNECTIONS must be 1..64"
done
for value in "$SAT_QD" "$SAT_DISK_QD"; do
    [ "$value" -ge 1 ] && [ "$value" -le 1024 ] || die "SAT_*QD must be 1..1024"
done
section() { [[ " $SECTIONS " == *" $1 "* ]]; }
section fio || section saturating || die "SECTIONS must name fio and/or saturating"
require fio nbdkit qemu-nbd nbd-server nbdinfo taskset "$PY" cargo
[ "$(nproc)" -gt "$SERVER_CPU" ] && [ "$(nproc)" -gt "$CLIENT_CPU" ] || die "no CPU $SERVER_CPU/$CLIENT_CPU"
fio --enghelp=nbd >/dev/null 2>&1 || die "fio lacks the nbd engine"

mkdir -p "$OUT" "$DISK_DIR" "$HOT_DIR" "$(dirname "$RESULTS_MD")" "$(dirname "$PLOT_SVG")"
# Absolute paths: nbd-server changes to / when it daemonizes and writes its pid file after.
OUT=$(realpath "$OUT")
DISK_DIR=$(realpath "$DISK_DIR")
HOT_DIR=$(realpath "$HOT_DIR")
case "$(fs_type "$DISK_DIR")" in
    tmpfs | ramfs) die "DISK_DIR=$DISK_DIR is in memory; the disk case needs a disk filesystem" ;;
esac
RUNS="$OUT/runs.tsv"
SAT_RUNS="$OUT/sat.tsv"
: >"$RUNS"
: >"$SAT_RUNS"
trap 'stop_tracked; rm -rf "$HOT_DIR"' EXIT
trap 'exit 130' INT TERM

note "building reflex and reflexd (release) into $CARGO_TARGET_DIR"
if ! cargo build --release -q -p reflex-cli -p reflex-server 2>"$OUT/build.log"; then
    note "build failed (see $OUT/build.log); continuing with whatever binaries exist"
fi

# --- Machine facts for the report -------------------------------------------------------------
{
    echo "date=$(date -u +%Y-%m-%dT%H:%MZ)"
    echo "commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo '+dirty')"
    echo "cpu=$(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)"
    echo "cores=$(nproc)"
    echo "kernel=$(uname -r)"
    echo "memory=$(free -g | awk '/Mem:/ {print $2}') GiB"
    echo "disk=$(df --output=source "$DISK_DIR" | tail -1) ($(fs_type "$DISK_DIR"))"
    echo "load_start=$(cut -d' ' -f1-3 /proc/loadavg)"
    echo "fio=$(fio --version)"
    echo "nbdkit=$(nbdkit --version | head -1)"
    echo "qemu-nbd=$(qemu-nbd --version | head -1)"
    echo "nbd-server=$(nbd-server -V 2>&1 | head -1 | sed 's/.*version //')"
    echo "libnbd=$(nbdinfo --version | tail -1)"
    echo "reps=$REPS runtime_s=$RUNTIME_S hot_size=$HOT_SIZE disk_size=$DISK_SIZE server_cpu=$SERVER_CPU client_cpu=$CLIENT_CPU"
    echo "sections=$SECTIONS"
    echo "saturating=hot ${SAT_CONNECTIONS}x QD$SAT_QD, disk ${SAT_DISK_CONNECTIONS}x QD$SAT_DISK_QD"
} >"$OUT/machine.txt"

# --- Data ---------------------------------------------------------------------------------------
DISK_FILE="$DISK_DIR/disk.img"
HOT_FILE="$HOT_DIR/hot.img"
disk_bytes=$(numfmt --from=iec "$DISK_SIZE")
if [ ! -f "$DISK_FILE" ] || [ "$(stat -c %s "$DISK_FILE")" -ne "$disk_bytes" ]; then
    note "writing $DISK_SIZE of data to $DISK_FILE (O_DIRECT)"
    rm -f "$DISK_FILE"
    fio --name=fill --ioengine=io_uring --direct=1 --rw=write --bs=1M --iodepth=8 \
        --size="$DISK_SIZE" --filename="$DISK_FILE" --refill_buffers --output="$OUT/fill-disk.txt"
fi
note "writing $HOT_SIZE to $HOT_FILE (tmpfs)"
fio --name=fill --ioengine=psync --rw=write --bs=1M --size="$HOT_SIZE" \
    --filename="$HOT_FILE" --refill_buffers --output="$OUT/fill-hot.txt"

# --- Servers ------------------------------------------------------------------------------------
# Each start_* function starts one pinned server, waits for its port, and records
# NAME -> "pid port export" in SERVERS. A server that cannot start is recorded as unavailable.
declare -A SERVERS=()
declare -A UNAVAILABLE=()

launch() { # name export_name command...
    local name=$1 export=$2 port pid
    shift 2
    port=$(free_port)
    local args=("${@//@PORT@/$port}")
    taskset -c "$SERVER_CPU" "${args[@]}" >"$OUT/server-$name.log" 2>&1 &
    pid=$!
    track "$pid"
    if ! wait_port "$port" "$pid" 20; then
        UNAVAILABLE[$name]="did not start (see server-$name.log)"
        stop_pid "$pid"
        return 0
    fi
    SERVERS[$name]="$pid $port $export"
}

start_reflexd() { # name backend(mem:SIZE | file:PATH) [reflexd flags...]
    local name=$1 backend=$2
    shift 2
    if [ ! -x "$REFLEXD" ]; then
        UNAVAILABLE[$name]="not available: reflexd did not build"
        return 0
    fi
    if ! "$REFLEXD" --help 2>/dev/null | grep -q -- --nbd-port; then
        UNAVAILABLE[$name]="not available: reflexd does not serve NBD yet"
        return 0
    fi
    # One dataplane thread, pinned by taskset; namespace 1 is exported as "ns1".
    launch "$name" ns1 "$REFLEXD" --port 0 --no-original --threads 1 \
        --namespace "1=$backend" --nbd-port @PORT@ "$@"
}

stop_server() { # key
    local pid
    [ -n "${SERVERS[$1]:-}" ] || return 0
    read -r pid _ _ <<<"${SERVERS[$1]}"
    stop_pid "$pid"
    unset "SERVERS[$1]"
}

fill_over_nbd() { # key
    note "filling $1 over NBD"
    timeout 600 taskset -c "$CLIENT_CPU" fio --name=fill --ioengine=nbd --uri="$(uri_of "$1")" --rw=write \
        --bs=1M --iodepth=4 --size="$HOT_SIZE" --refill_buffers --output="$OUT/fill-$1.txt" \
        || die "filling $1 failed"
}

# Servers that run only during their own jobs: a polling reflexd spins on the server CPU even
# when idle and would slow down every other server's runs.
declare -A EPHEMERAL=(
    [hot:reflexd-mem-poll]="start_reflexd hot:reflexd-mem-poll mem:$HOT_SIZE --poll"
    [disk:reflexd-file-poll]="start_reflexd disk:reflexd-file-poll file:$DISK_FILE --poll"
)

start_nbdkit() { # name plugin args...
    local name=$1
    shift
    launch "$name" "" nbdkit --foreground --exit-with-parent --ipaddr 127.0.0.1 --port @PORT@ "$@"
}

start_qemu_nbd() { # name file extra-args...
    local name=$1 file=$2
    shift 2
    launch "$name" disk qemu-nbd --format=raw --persistent --shared=8 --bind=127.0.0.1 \
        --port=@PORT@ --export-name=disk "$@" "$file"
}

start_nbd_server() { # name file
    local name=$1 file=$2 port config="$OUT/nbd-server-$1.conf"
    port=$(free_port)
    cat >"$config" <<EOF
[generic]
    user = root
    group = root
    listenaddr = 127.0.0.1
    port = $port
    allowlist = true
[disk]
    exportname = $file
EOF
    # nbd-server daemonizes unless -d (debug mode: no fork, but then it serves one client and
    # exits), so run it normally and track the daemon through its pid file.
    rm -f "$OUT/nbd-server-$name.pid"
    taskset -c "$SERVER_CPU" nbd-server -C "$config" -p "$OUT/nbd-server-$name.pid" \
        >"$OUT/server-$name.log" 2>&1 || true
    local pid="" i
    for ((i = 0; i < 100; i++)); do
        pid=$(cat "$OUT/nbd-server-$name.pid" 2>/dev/null || true)
        # Without a pid file, the process listening on our port (so it is stopped on exit).
        [ -n "$pid" ] || pid=$(listener_pid "$port")
        [ -n "$pid" ] && break
        sleep 0.05
    done
    [ -z "$pid" ] || track "$pid"
    if [ -z "$pid" ] || ! wait_port "$port" "$pid" 20; then
        UNAVAILABLE[$name]="did not start (see server-$name.log)"
        return 0
    fi
    SERVERS[$name]="$pid $port disk"
}

# Hot data: each server's in-memory (or tmpfs) path.
HOT_SERVERS=(reflexd-mem reflexd-mem-poll nbdkit-memory nbdkit-file qemu-nbd nbd-server)
declare -A HOT_LABEL=(
    [reflexd-mem]="reflexd (mem)"
    [reflexd-mem-poll]="reflexd --poll (mem)"
    [nbdkit-memory]="nbdkit memory"
    [nbdkit-file]="nbdkit file (tmpfs)"
    [qemu-nbd]="qemu-nbd io_uring (tmpfs)"
    [nbd-server]="nbd-server (tmpfs)"
)
start_reflexd hot:reflexd-mem "mem:$HOT_SIZE"
start_nbdkit hot:nbdkit-memory memory "size=$HOT_SIZE"
start_nbdkit hot:nbdkit-file file "file=$HOT_FILE"
start_qemu_nbd hot:qemu-nbd "$HOT_FILE" --aio=io_uring --cache=writeback
start_nbd_server hot:nbd-server "$HOT_FILE"

# Disk: the same file on the root disk.
DISK_SERVERS=(local reflexd-file reflexd-file-poll nbdkit-file qemu-nbd nbd-server)
declare -A DISK_LABEL=(
    [local]="fio io_uring, local (O_DIRECT)"
    [reflexd-file]="reflexd (file)"
    [reflexd-file-poll]="reflexd --poll (file)"
    [nbdkit-file]="nbdkit file cache=none"
    [qemu-nbd]="qemu-nbd io_uring cache=none"
    [nbd-server]="nbd-server (page cache)"
)
start_reflexd disk:reflexd-file "file:$DISK_FILE"
start_nbdkit disk:nbdkit-file file "file=$DISK_FILE" cache=none fadvise=random
start_qemu_nbd disk:qemu-nbd "$DISK_FILE" --aio=io_uring --cache=none
start_nbd_server disk:nbd-server "$DISK_FILE"

for key in "${!UNAVAILABLE[@]}"; do note "$key: ${UNAVAILABLE[$key]}"; done

uri_of() { # key -> nbd URI
    local pid port export
    read -r pid port export <<<"${SERVERS[$1]}"
    echo "nbd://127.0.0.1:$port/$export"
}

# Fill the in-memory exports through NBD so every server reads real data.
for key in hot:reflexd-mem hot:nbdkit-memory; do
    if [ -n "${SERVERS[$key]:-}" ]; then fill_over_nbd "$key"; fi
done

# --- Runs ---------------------------------------------------------------------------------------
# One fio job: 4 KiB random reads at queue depth QD for RUNTIME_S. No --ramp_time: the server's
# CPU time is read around the whole job, so every request it served must be counted too.
run_one() { # case name qd rep
    local case=$1 name=$2 qd=$3 rep=$4 key="$1:$2" json engine size pid=""
    json="$OUT/$case-$name-qd$qd-rep$rep.json"
    size=$([ "$case" = hot ] && echo "$HOT_SIZE" || echo "$DISK_SIZE")
    if [ -n "${EPHEMERAL[$key]:-}" ]; then
        ${EPHEMERAL[$key]}
        [ -z "${SERVERS[$key]:-}" ] || [ "$case" != hot ] || fill_over_nbd "$key"
    fi
    # The local baseline runs on the server's CPU: local Flash is what an application on the
    # server machine sees, and that CPU takes the disk's interrupts in the default pinning.
    local fio_cpu=$CLIENT_CPU
    if [ "$name" = local ]; then
        engine=(--ioengine=io_uring --direct=1 --filename="$DISK_FILE")
        fio_cpu=$SERVER_CPU
    else
        [ -n "${SERVERS[$key]:-}" ] || return 0
        read -r pid _ _ <<<"${SERVERS[$key]}"
        engine=(--ioengine=nbd --uri="$(uri_of "$key")")
    fi
    local before=0 after=0 start end busy_before busy_after
    if [ "$QUIET_WAIT_S" -gt 0 ] && ! wait_quiet "$QUIET_MAX_PERCENT" "$QUIET_WAIT_S"; then
        note "the machine stayed busy for ${QUIET_WAIT_S}s; running anyway"
    fi
    [ -z "$pid" ] || before=$(cpu_ticks "$pid")
    busy_before=$(cpu_busy_ticks "$SERVER_CPU")
    start=$(now_ns)
    if ! timeout $((RUNTIME_S + 60)) taskset -c "$fio_cpu" fio --name="$case-$name" "${engine[@]}" --rw=randread --bs=4k \
        --iodepth="$qd" --size="$size" --time_based --runtime="$RUNTIME_S" \
        --norandommap --randrepeat=0 --clat_percentiles=0 --lat_percentiles=1 \
        --percentile_list=50:90:99:99.9 --output-format=json --output="$json"; then
        note "fio failed: $case $name QD$qd rep $rep"
        [ -z "${EPHEMERAL[$key]:-}" ] || stop_server "$key"
        return 0
    fi
    end=$(now_ns)
    busy_after=$(cpu_busy_ticks "$SERVER_CPU")
    sleep 0.2 # nbd-server's per-connection child exits and is reaped into its parent's cutime
    [ -z "$pid" ] || after=$(cpu_ticks "$pid")
    [ -z "${EPHEMERAL[$key]:-}" ] || stop_server "$key"
    # Last column: ticks the server CPU was busy during the job, whoever ran there; minus the
    # server's own ticks it says how much other processes took from the server.
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$case" "$name" "$qd" "$rep" "$json" \
        "$((after - before))" "$((end - start))" "$((busy_after - busy_before))" >>"$RUNS"
}

# Servers the saturating section loads (a subset of the fio section's, same instances).
SAT_HOT_SERVERS=(reflexd-mem reflexd-mem-poll nbdkit-memory qemu-nbd nbd-server)
SAT_DISK_SERVERS=(local reflexd-file reflexd-file-poll nbdkit-file qemu-nbd)
declare -A SAT_UNAVAILABLE=()
if [ ! -x "$REFLEX" ] || ! "$REFLEX" bench --help 2>/dev/null | grep -q 'nbd://'; then
    for name in "${SAT_HOT_SERVERS[@]}"; do SAT_UNAVAILABLE[hot:$name]="reflex bench has no NBD mode"; done
    for name in "${SAT_DISK_SERVERS[@]}"; do SAT_UNAVAILABLE[disk:$name]="reflex bench has no NBD mode"; done
fi

# One `reflex bench` run of the saturating section: closed loop, 4 KiB random reads, one bench
# thread, no warm-up (the server's CPU time is read around the whole run, so every request it
# served must be counted), bounded by `timeout`. The local baseline runs on the server's CPU,
# as in run_one.
run_sat() { # case name rep
    local case=$1 name=$2 rep=$3 key="$1:$2" json pid="" connections qd cpu=$CLIENT_CPU
    [ -z "${SAT_UNAVAILABLE[$key]:-}" ] || return 0
    if [ "$case" = hot ]; then
        connections=$SAT_CONNECTIONS qd=$SAT_QD
    else
        connections=$SAT_DISK_CONNECTIONS qd=$SAT_DISK_QD
    fi
    json="$OUT/sat-$case-$name-rep$rep.json"
    if [ -n "${EPHEMERAL[$key]:-}" ]; then
        ${EPHEMERAL[$key]}
        [ -z "${SERVERS[$key]:-}" ] || [ "$case" != hot ] || fill_over_nbd "$key"
    fi
    local target=()
    if [ "$name" = local ]; then
        target=(--local "$DISK_FILE")
        cpu=$SERVER_CPU
    else
        [ -n "${SERVERS[$key]:-}" ] || return 0
        read -r pid _ _ <<<"${SERVERS[$key]}"
        target=(--server "$(uri_of "$key")")
    fi
    local before=0 after=0 start end busy_before busy_after
    if [ "$QUIET_WAIT_S" -gt 0 ] && ! wait_quiet "$QUIET_MAX_PERCENT" "$QUIET_WAIT_S"; then
        note "the machine stayed busy for ${QUIET_WAIT_S}s; running anyway"
    fi
    [ -z "$pid" ] || before=$(cpu_ticks "$pid")
    busy_before=$(cpu_busy_ticks "$SERVER_CPU")
    start=$(now_ns)
    if ! timeout $((RUNTIME_S + 60)) taskset -c "$cpu" "$REFLEX" bench "${target[@]}" \
        --threads 1 --connections "$connections" --qd "$qd" --io-size 4k --read-ratio 1 \
        --pattern random --warmup 0 --duration "${RUNTIME_S}s" --seed "$rep" --json -q \
        >"$json" 2>"$OUT/sat-$case-$name-rep$rep.err"; then
        note "reflex bench failed: $case $name rep $rep (see $OUT/sat-$case-$name-rep$rep.err)"
        [ -z "${EPHEMERAL[$key]:-}" ] || stop_server "$key"
        return 0
    fi
    end=$(now_ns)
    busy_after=$(cpu_busy_ticks "$SERVER_CPU")
    sleep 0.2 # nbd-server's per-connection children exit and are reaped into its cutime
    [ -z "$pid" ] || after=$(cpu_ticks "$pid")
    [ -z "${EPHEMERAL[$key]:-}" ] || stop_server "$key"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$case" "$name" "$qd" "$rep" "$json" \
        "$((after - before))" "$((end - start))" "$((busy_after - busy_before))" \
        "$connections" >>"$SAT_RUNS"
}

for ((rep = 1; rep <= REPS; rep++)); do
    if section fio; then
        note "repetition $rep of $REPS: ping-pong"
        if [ -x "$REFLEX" ] && "$REFLEX" pingpong --help >/dev/null 2>&1; then
            timeout 600 "$REFLEX" pingpong --sizes 32,4k --count "$PINGPONG_COUNT" \
                --server-cpu "$SERVER_CPU" --client-cpu "$CLIENT_CPU" --json \
                >"$OUT/pingpong-rep$rep.json" || note "reflex pingpong failed"
        else
            note "reflex pingpong is not available; no latency floor"
        fi
        for qd in 1 32; do
            for name in "${HOT_SERVERS[@]}"; do
                note "repetition $rep: hot $name QD$qd"
                run_one hot "$name" "$qd" "$rep"
            done
            for name in "${DISK_SERVERS[@]}"; do
                note "repetition $rep: disk $name QD$qd"
                run_one disk "$name" "$qd" "$rep"
            done
        done
    fi
    if section saturating; then
        for name in "${SAT_HOT_SERVERS[@]}"; do
            note "repetition $rep: saturating client, hot $name ${SAT_CONNECTIONS}x QD$SAT_QD"
            run_sat hot "$name" "$rep"
        done
        for name in "${SAT_DISK_SERVERS[@]}"; do
            note "repetition $rep: saturating client, disk $name ${SAT_DISK_CONNECTIONS}x QD$SAT_DISK_QD"
            run_sat disk "$name" "$rep"
        done
    fi
done
echo "load_end=$(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/machine.txt"

# --- Report -------------------------------------------------------------------------------------
{
    for name in "${HOT_SERVERS[@]}"; do
        printf 'label\thot\t%s\t%s\t%s\n' "$name" "${HOT_LABEL[$name]}" "${UNAVAILABLE[hot:$name]:-}"
    done
    for name in "${DISK_SERVERS[@]}"; do
        printf 'label\tdisk\t%s\t%s\t%s\n' "$name" "${DISK_LABEL[$name]}" "${UNAVAILABLE[disk:$name]:-}"
    done
    for name in "${SAT_HOT_SERVERS[@]}"; do
        why=${SAT_UNAVAILABLE[hot:$name]:-${UNAVAILABLE[hot:$name]:-}}
        printf 'label\tsat-hot\t%s\t%s\t%s\n' "$name" "${HOT_LABEL[$name]}" "$why"
    done
    for name in "${SAT_DISK_SERVERS[@]}"; do
        why=${SAT_UNAVAILABLE[disk:$name]:-${UNAVAILABLE[disk:$name]:-}}
        label=${DISK_LABEL[$name]}
        [ "$name" != local ] || label="reflex bench --local (io_uring, O_DIRECT)"
        printf 'label\tsat-disk\t%s\t%s\t%s\n' "$name" "$label" "$why"
    done
} >"$OUT/labels.tsv"
stop_tracked
"$PY" bench/lib/peers_report.py "$OUT" "$RESULTS_MD" "$PLOT_SVG"
note "wrote $RESULTS_MD and $PLOT_SVG (raw results in $OUT)"
