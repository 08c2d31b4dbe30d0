# Shared helpers for the bench/ scripts (sourced, not run). Bash only.
#
# - die / note: messages to stderr.
# - require TOOL...: fail (never skip) when a tool is missing.
# - free_port: an unused loopback TCP port.
# - wait_port PORT PID [SECONDS]: wait until PORT accepts connections while PID lives.
# - track PID / stop_tracked: processes this script started, stopped by PID on exit
#   (SIGTERM, then SIGKILL after 5 s); never by name.
# - cpu_ticks PID: CPU time in clock ticks of PID and all its descendants, including reaped
#   children (utime + stime + cutime + cstime), for servers that fork per connection.
# - cpu_ns PID: CPU time of PID in nanoseconds, summed over all its live threads from
#   /proc/PID/task/*/schedstat (first field: the scheduler's exact sum_exec_runtime, not
#   tick samples; steal time excluded). Read it before and after a run: the difference is
#   the server's core-seconds × 1e9 (threads that exit in between are lost, so use it on
#   servers whose threads live for the whole run). Prints 0 if PID is gone.
# - cpu_user_sys_ticks PID: "USER SYS", the clock ticks PID's live threads spent in user space
#   and in the kernel (utime and stime of /proc/PID/task/*/stat). Tick-sampled, so only for
#   the split of a run's CPU time between the two, next to cpu_ns's exact total.
# - listener_pid PORT: the process listening on loopback TCP PORT (for daemons that fork).
# - cpu_busy_ticks CPU: ticks CPU spent running processes (user + nice + system, any process;
#   interrupt time left out), from /proc/stat.
# - wait_quiet MAX_PERCENT SECONDS: wait (at most SECONDS) until, over one second, processes
#   used at most MAX_PERCENT of every CPU; returns 1 if the machine never got that quiet.
# - raise_fd_limit NEEDED WHAT: raise `ulimit -n` (to 65536, or the hard limit) and fail unless
#   it allows NEEDED descriptors (WHAT says what for).
# - build_release: build reflexd and reflex (release) and set REFLEXD and REFLEX to them, under
#   CARGO_TARGET_DIR (default target).
# - now_ns: monotonic-enough wall clock in nanoseconds.
# - fs_type DIR: the filesystem type of DIR (to refuse tmpfs where a disk is wanted).
# - autogroup_nice NICE: give this script's session (its scheduler autogroup) niceness NICE,
#   restored by autogroup_restore. With kernel.sched_autogroup_enabled (on here), CPU time is
#   shared between sessions first and `nice` orders tasks only inside a session: without this,
#   `nice -n -20` does not shield a benchmark from other sessions' builds at all.
# - isolate_cpu CPU: move every other task that may run elsewhere off CPU (the server's), as an
#   operator dedicates a core to a dataplane thread; isolate_restore gives them their masks
#   back (bench/lib/isolate.py says why: the VM's own agent, at niceness -10, otherwise takes
#   the server's CPU for milliseconds at a time). Needs root for other users' tasks; without
#   it, only this user's tasks move.

die() { echo "error: $*" >&2; exit 1; }
note() { echo "==> $(date -u +%H:%M:%S) $*" >&2; }

require() {
    local missing=()
    for tool in "$@"; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] || die "missing tools: ${missing[*]} (scripts/test.sh installs them)"
}

free_port() {
    /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

wait_port() {
    local port=$1 pid=$2 seconds=${3:-15} i
    for ((i = 0; i < seconds * 20; i++)); do
        kill -0 "$pid" 2>/dev/null || return 1
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            return 0
        fi
        sleep 0.05
    done
    return 1
}

TRACKED_PIDS=()
track() { TRACKED_PIDS+=("$1"); }

stop_pid() {
    local pid=$1 i
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
        sleep 0.05
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

stop_tracked() {
    local pid
    for pid in "${TRACKED_PIDS[@]}"; do
        stop_pid "$pid"
    done
    TRACKED_PIDS=()
}

descendants() {
    local pid=$1 child
    for child in $(cat /proc/"$pid"/task/*/children 2>/dev/null); do
        echo "$child"
        descendants "$child"
    done
}

cpu_ticks() {
    local pid=$1 total=0 p fields
    for p in "$pid" $(descendants "$pid"); do
        # Fields after the ")" of the command name: state is field 3, utime 14 ... cstime 17.
        fields=$(sed 's/^.*) //' /proc/"$p"/stat 2>/dev/null) || continue
        set -- $fields
        total=$((total + ${12} + ${13} + ${14} + ${15}))
    done
    echo "$total"
}

cpu_ns() {
    # A thread may exit between the glob and the read: skip it rather than fail.
    { cat /proc/"$1"/task/*/schedstat 2>/dev/null || true; } |
        awk '{ total += $1 } END { printf "%.0f\n", total }'
}

cpu_user_sys_ticks() {
    # The comm field may hold spaces: fields are counted after its closing parenthesis, where
    # utime and stime are the 12th and 13th.
    { cat /proc/"$1"/task/*/stat 2>/dev/null || true; } |
        awk '{ sub(/^.*\) /, ""); user += $12; sys += $13 } END { printf "%d %d\n", user, sys }'
}

listener_pid() {
    ss -H -l -t -n -p "sport = :$1" 2>/dev/null | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -1
}

cpu_busy_ticks() {
    # cpuN user nice system idle iowait irq softirq steal ...
    awk -v cpu="cpu$1" '$1 == cpu { print $2 + $3 + $4 }' /proc/stat
}

wait_quiet() {
    local max_percent=$1 seconds=$2 deadline cpus c busiest before after
    deadline=$((SECONDS + seconds))
    cpus=$(nproc)
    while :; do
        before=()
        for ((c = 0; c < cpus; c++)); do before+=("$(cpu_busy_ticks "$c")"); done
        sleep 1
        busiest=0
        for ((c = 0; c < cpus; c++)); do
            after=$(cpu_busy_ticks "$c")
            # ticks per second are CLK_TCK (100 on Linux): a delta of N ticks is N % of a CPU.
            ((after - before[c] > busiest)) && busiest=$((after - before[c]))
        done
        ((busiest * 100 / $(getconf CLK_TCK) <= max_percent)) && return 0
        ((SECONDS < deadline)) || return 1
        sleep 1
    done
}

raise_fd_limit() {
    ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
    [ "$(ulimit -n)" -ge "$1" ] || die "ulimit -n $(ulimit -n) is too low for $2"
}

build_release() {
    note "building release binaries"
    cargo build --release -q -p reflex-server -p reflex-cli
    REFLEXD="${CARGO_TARGET_DIR:-target}/release/reflexd"
    REFLEX="${CARGO_TARGET_DIR:-target}/release/reflex"
}

# The two servers that the issue-10 dataplane benchmarks (limit.sh, builds.sh, profile.sh,
# instructions.sh) compare, spelled once so every script measures the same thing: each sets
# SERVER_COMMAND to a command line.
# reflexd_mem_command BINARY ORIGINAL_PORT NATIVE_PORT [FLAG...]: one dataplane thread, a
# 1 GiB `mem` namespace behind an original-protocol port, no NBD (NATIVE_PORT 0: any port).
reflexd_mem_command() {
    local binary=$1 original_port=$2 native_port=$3
    shift 3
    SERVER_COMMAND=("$binary" --port "$native_port" --no-nbd --original-port "$original_port=1"
        -n 1=mem:1G --threads 1 "$@")
}
# limit_server_command BINARY PORT [FLAG...]: bench/limit's server, room for 64 connections.
limit_server_command() {
    local binary=$1 port=$2
    shift 2
    SERVER_COMMAND=("$binary" --port "$port" --connections-max 64 "$@")
}

now_ns() { date +%s%N; }

fs_type() { findmnt -n -o FSTYPE --target "$1"; }

AUTOGROUP_NICE_BEFORE=""
autogroup_nice() {
    [ -w /proc/self/autogroup ] || return 0
    AUTOGROUP_NICE_BEFORE=$(awk '{ print $3 }' /proc/self/autogroup)
    echo "$1" >/proc/self/autogroup 2>/dev/null || AUTOGROUP_NICE_BEFORE=""
}
autogroup_restore() {
    [ -z "$AUTOGROUP_NICE_BEFORE" ] || echo "$AUTOGROUP_NICE_BEFORE" >/proc/self/autogroup 2>/dev/null || true
    AUTOGROUP_NICE_BEFORE=""
}

# isolate_option: reads ISOLATE from the environment (on, the default, or off), checks it and
# exports it (reports print it).
isolate_option() {
    export ISOLATE=${ISOLATE:-on}
    case "$ISOLATE" in on | off) ;; *) die "ISOLATE must be on or off, not $ISOLATE" ;; esac
}
# isolate_cpu CPU: with ISOLATE on, moves every other task that can run elsewhere off CPU
# (bench/lib/isolate.py) until isolate_restore; with ISOLATE off, does nothing.
ISOLATE_STATE=""
isolate_cpu() {
    [ "${ISOLATE:-on}" = on ] || return 0
    ISOLATE_STATE=$(mktemp)
    /usr/bin/python3 "$(dirname "${BASH_SOURCE[0]}")/isolate.py" isolate "$1" "$ISOLATE_STATE"
}
isolate_restore() {
    [ -z "$ISOLATE_STATE" ] || /usr/bin/python3 "$(dirname "${BASH_SOURCE[0]}")/isolate.py" restore "$ISOLATE_STATE"
    ISOLATE_STATE=""
}

# wait_file FILE PID SECONDS: waits until FILE exists; fails when PID exits first or after
# SECONDS.
wait_file() {
    local file=$1 pid=$2 seconds=$3 i
    for ((i = 0; i < seconds * 10; i++)); do
        [ -e "$file" ] && return 0
        kill -0 "$pid" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# The commit a result comes from, for its header: sets COMMIT (the short hash, "unknown"
# outside git) and DIRTY (" (with uncommitted changes)" when the tree differs, else empty).
set_revision() {
    COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    DIRTY=$(git status --porcelain 2>/dev/null | grep -q . && echo " (with uncommitted changes)" || true)
}

# zero_counters PID: callgrind_control -z, tried three times (once on 2026-11-30 the first
# attempt after a start failed and the next run went through), with its output on failure.
zero_counters() {
    local pid=$1 attempt output
    for attempt in 1 2 3; do
        output=$(timeout 60 callgrind_control -z "$pid" 2>&1) && return 0
        note "callgrind_control -z $pid failed (attempt $attempt): $output"
        sleep 1
    done
    die "callgrind_control -z $pid failed three times"
}

# dump_counters PID PREFIX: callgrind_control -d, tried three times like zero_counters (once
# on 2026-11-30 a dump after a loaded window failed and the rerun went through). An attempt
# that reported an error but left a new PREFIX.* file within 2 s counts as done, so no
# window is dumped twice.
dump_counters() {
    local pid=$1 prefix=$2 before attempt output i
    before=$(dumps "$prefix")
    for attempt in 1 2 3; do
        output=$(timeout 60 callgrind_control -d "$pid" 2>&1) && return 0
        for ((i = 0; i < 20; i++)); do # (a dump may still be being written)
            [ "$(dumps "$prefix")" -gt "$before" ] && return 0
            sleep 0.1
        done
        note "callgrind_control -d $pid failed (attempt $attempt): $output"
        sleep 1
    done
    die "callgrind_control -d $pid failed three times"
}

# dumps PREFIX: how many dumps PREFIX.N exist (the base file PREFIX is written at start).
dumps() {
    local count=0 file
    for file in "$1".*; do
        [ -e "$file" ] && count=$((count + 1))
    done
    echo "$count"
}

# new_dump_ir PREFIX BEFORE: waits (at most 30 s) for dump number BEFORE + 1 of PREFIX to be
# complete and prints its total Ir; fails if it never appears.
new_dump_ir() {
    local prefix=$1 before=$2 file="$1.$(($2 + 1))" ir="" i
    for ((i = 0; i < 300; i++)); do
        if [ "$(dumps "$prefix")" -gt "$before" ] && [ -e "$file" ]; then
            ir=$(awk '/^(totals|summary):/ { print $2; exit }' "$file")
            [ -z "$ir" ] || break
        fi
        sleep 0.1
    done
    [[ "$ir" =~ ^[0-9,]+$ ]] || die "no complete callgrind dump $file (dumps: $(dumps "$prefix"))"
    echo "$ir"
}

# dump_total PID PREFIX: dumps PID's counters and prints the new dump's total Ir.
dump_total() {
    local pid=$1 prefix=$2 before
    before=$(dumps "$prefix")
    dump_counters "$pid" "$prefix"
    new_dump_ir "$prefix" "$before"
}
