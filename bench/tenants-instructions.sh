#!/usr/bin/env bash
# The scheduler's cost with 10,000 tenants, counted in instructions (issue 10): timings of a
# ~1 % difference drown in the noise of a shared 2-vCPU machine, instruction counts repeat.
#
# For each mode of bench/scale.sh's tenants part (off: profile with --no-qos; one: QoS on, the
# default tenant; reg: QoS on, TENANTS registered, the load on the default tenant; bound: QoS
# on, TENANTS registered, connection k bound to tenant k), reflexd (tenants config of
# bench/scale.sh, one dataplane thread, `mem:256M` with profiles/mem-unlimited.toml)
# runs under `valgrind --tool=callgrind`; the load is the scale benchmark's (ACTIVE_THREADS ×
# ACTIVE_PER_THREAD connections, QD 1, 4 KiB random reads) for WARMUP + DURATION, and the bench
# itself zeroes the server's counters when its measurement starts and dumps them when it ends
# (`reflex bench --at-measure-start 'callgrind_control -z PID' --at-measure-end '... -d PID'`):
# Ir per request = Ir of that window / requests measured (set-up and tear-down of the
# connections are outside the window; the requests in flight at either edge cancel out in a
# steady closed loop). Then the cost of a connection's life (connect, HELLO, BIND when bound,
# one request, close): counters zeroed, SETUP_OPS requests on ACTIVE fresh connections,
# dumped: (Ir − SETUP_OPS × Ir per request) / connections. User space only (the kernel's TCP
# and io_uring work is not counted). The top functions by inclusive Ir of each mode's
# measurement go to $WORK/MODE-inclusive.txt.
# Results: docs/results/tenants-instructions.md (OUT).
#
# Usage: bench/tenants-instructions.sh
# Environment: TENANTS (10000) TENANTS_PER_CONNECTION (100) ACTIVE_THREADS (4)
#   ACTIVE_PER_THREAD (250) WARMUP (5s) DURATION (20s) PORT (17380) MODES
#   ("off one reg bound") WORK (target/bench-tenants-instructions)
#   OUT (docs/results/tenants-instructions.md)
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
source bench/lib/common.sh

TENANTS=${TENANTS:-10000}
TENANTS_PER_CONNECTION=${TENANTS_PER_CONNECTION:-100}
ACTIVE_THREADS=${ACTIVE_THREADS:-4}
ACTIVE_PER_THREAD=${ACTIVE_PER_THREAD:-250}
WARMUP=${WARMUP:-5s}
DURATION=${DURATION:-20s}
PORT=${PORT:-17380}
MODES=${MODES:-"off one reg bound"}
WORK=${WORK:-target/bench-tenants-instructions}
OUT=${OUT:-docs/results/tenants-instructions.md}
SETUP_OPS=${SETUP_OPS:-1000}
START_WAIT_S=${START_WAIT_S:-120}
CLIENT_TIMEOUT_S=${CLIENT_TIMEOUT_S:-900}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}

require valgrind callgrind_annotate callgrind_control python3
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
note "building release binaries"
cargo build --release -q -p reflex-server -p reflex-cli
REFLEXD="$CARGO_TARGET_DIR/release/reflexd"
REFLEX="$CARGO_TARGET_DIR/release/reflex"
mkdir -p "$WORK"
rm -f "$WORK"/callgrind.*.out* "$WORK"/*.json "$WORK"/*.log "$WORK"/*.txt "$WORK"/ready "$WORK"/stop
CONFIG="$WORK/tenants.toml"
cat >"$CONFIG" <<EOF
# bench/tenants-instructions.sh (as bench/scale.sh's tenants part).
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
profile = "$PWD/profiles/mem-unlimited.toml"
EOF

SERVER_PID=""
FLOOD_PID=""
cleanup() {
    [ -z "$FLOOD_PID" ] || stop_pid "$FLOOD_PID"
    [ -z "$SERVER_PID" ] || stop_valgrind "$SERVER_PID"
    FLOOD_PID=""
    SERVER_PID=""
}
trap cleanup EXIT

# stop_valgrind PID: SIGTERM and a connection to the port (valgrind 3.19 does not deliver the
# signal while the server sleeps in io_uring_enter: see bench/instructions.sh), SIGKILL after 5 s.
stop_valgrind() {
    local pid=$1 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < 50; i++)); do
        kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
        ((i % 5 != 0)) || (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null || true
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

# load MODE: the load with the counters zeroed and dumped by the bench around its
# measurement; prints "Ir requests".
load() {
    local mode=$1 prefix="$WORK/callgrind.$1.out" bind=() before ir ops
    [ "$mode" != bound ] || bind=(--bind-handles "$WORK/handles.txt")
    before=$(dumps "$prefix")
    timeout "$CLIENT_TIMEOUT_S" "$REFLEX" bench -s "127.0.0.1:$PORT" --threads "$ACTIVE_THREADS" \
        --connections "$ACTIVE_PER_THREAD" --qd 1 --warmup "$WARMUP" --duration "$DURATION" \
        "${bind[@]}" --at-measure-start "timeout 60 callgrind_control -z $SERVER_PID >/dev/null" \
        --at-measure-end "timeout 60 callgrind_control -d $SERVER_PID >/dev/null" \
        --json -q >"$WORK/$mode-load.json" || die "bench failed ($mode)"
    ir=$(new_dump_ir "$prefix" "$before")
    ops=$(python3 -c "import json; print(json.load(open('$WORK/$mode-load.json'))['rows'][0]['ops'])")
    [[ "$ops" =~ ^[0-9]+$ ]] && [ "$ops" -gt 0 ] || die "no requests measured ($mode)"
    echo "$ir $ops"
}

# setup MODE: zero, SETUP_OPS requests on fresh connections, dump; prints Ir.
setup() {
    local mode=$1 bind=()
    [ "$mode" != bound ] || bind=(--bind-handles "$WORK/handles.txt")
    zero_counters "$SERVER_PID"
    timeout "$CLIENT_TIMEOUT_S" "$REFLEX" bench -s "127.0.0.1:$PORT" --threads "$ACTIVE_THREADS" \
        --connections "$ACTIVE_PER_THREAD" --qd 1 --ops "$SETUP_OPS" --warmup 0 --duration 600s \
        "${bind[@]}" --json -q >"$WORK/$mode-setup.json" || die "bench failed ($mode setup)"
    sleep 1 # the server closes the connections
    dump_total "$SERVER_PID" "$WORK/callgrind.$mode.out"
}

declare -A IR
for mode in $MODES; do
    flags=()
    [ "$mode" != off ] || flags+=(--no-qos)
    note "$mode: reflexd under callgrind"
    valgrind --tool=callgrind --callgrind-out-file="$WORK/callgrind.$mode.out" \
        "$REFLEXD" --config "$CONFIG" "${flags[@]}" >"$WORK/$mode.log" 2>&1 &
    SERVER_PID=$!
    deadline=$((SECONDS + START_WAIT_S))
    until timeout 30 "$REFLEX" bench -s "127.0.0.1:$PORT" --ops 1 --warmup 0 -q >/dev/null 2>&1; do
        kill -0 "$SERVER_PID" 2>/dev/null && ((SECONDS < deadline)) ||
            { cat "$WORK/$mode.log" >&2; die "reflexd did not start under valgrind"; }
        sleep 0.5
    done
    if [ "$mode" = reg ] || [ "$mode" = bound ]; then
        note "$mode: registering $TENANTS tenants"
        rm -f "$WORK/ready" "$WORK/stop"
        timeout "$CLIENT_TIMEOUT_S" "$REFLEX" flood -s "127.0.0.1:$PORT" --register "$TENANTS" \
            --tenants-per-connection "$TENANTS_PER_CONNECTION" --handles "$WORK/handles.txt" \
            --duration 1800s --setup-timeout 600s --ready-file "$WORK/ready" \
            --stop-file "$WORK/stop" --json -q >"$WORK/$mode-flood.json" 2>"$WORK/$mode-flood.err" &
        FLOOD_PID=$!
        for ((i = 0; i < 6000; i++)); do
            [ -e "$WORK/ready" ] && break
            kill -0 "$FLOOD_PID" 2>/dev/null || die "registering tenants failed: $(cat "$WORK/$mode-flood.err")"
            ((i == 0 || i % 300 != 0)) || note "$mode: still registering after $((i / 10)) s"
            sleep 0.1
        done
        [ -e "$WORK/ready" ] || die "registering tenants took too long"
    fi
    note "$mode: the load, counted in its measurement"
    result=$(load "$mode")
    read -r IR[$mode-load] IR[$mode-ops] <<<"$result"
    note "$mode: Ir ${IR[$mode-load]} for ${IR[$mode-ops]} requests"
    callgrind_annotate --inclusive=yes --threshold=99 "$(ls "$WORK/callgrind.$mode.out".* | sort -V | tail -1)" \
        >"$WORK/$mode-inclusive.txt" 2>/dev/null || true
    note "$mode: $SETUP_OPS requests on $((ACTIVE_THREADS * ACTIVE_PER_THREAD)) fresh connections"
    IR[$mode-setup]=$(setup "$mode")
    if [ -n "$FLOOD_PID" ]; then
        touch "$WORK/stop"
        status=0
        wait "$FLOOD_PID" || status=$?
        FLOOD_PID=""
        [ "$status" -eq 0 ] || die "the tenant flood failed (exit $status): $(cat "$WORK/$mode-flood.err")"
    fi
    stop_valgrind "$SERVER_PID"
    SERVER_PID=""
done

set_revision
RUN_DATE=$(date -u +"%Y-%m-%d %H:%M UTC")
VALGRIND=$(valgrind --version)
# The command as run: every setting that differs from its default.
COMMAND=""
[ "$TENANTS" = 10000 ] || COMMAND+="TENANTS=$TENANTS "
[ "$MODES" = "off one reg bound" ] || COMMAND+="MODES=\"$MODES\" "
[ "$WARMUP" = 5s ] || COMMAND+="WARMUP=$WARMUP "
[ "$DURATION" = 20s ] || COMMAND+="DURATION=$DURATION "
[ "$WORK" = target/bench-tenants-instructions ] || COMMAND+="WORK=$WORK "
[ "$OUT" = docs/results/tenants-instructions.md ] || COMMAND+="OUT=$OUT "
COMMAND+="bench/tenants-instructions.sh"
export RUN_DATE COMMIT DIRTY VALGRIND COMMAND TENANTS WARMUP DURATION ACTIVE_THREADS ACTIVE_PER_THREAD WORK \
    SETUP_OPS
args=()
for mode in $MODES; do
    args+=("$mode" "${IR[$mode-load]}" "${IR[$mode-ops]}" "${IR[$mode-setup]}")
done
mkdir -p "$(dirname "$OUT")"
python3 - "$OUT" "${args[@]}" <<'PY'
import os, re, sys

out = sys.argv[1]
env = os.environ
values = sys.argv[2:]
number = lambda text: int(text.replace(",", ""))
connections = int(env["ACTIVE_THREADS"]) * int(env["ACTIVE_PER_THREAD"])
setup_ops = int(env["SETUP_OPS"])
per, ops, life = {}, {}, {}
for index in range(0, len(values), 4):
    mode = values[index]
    ops[mode] = number(values[index + 2])
    per[mode] = number(values[index + 1]) / ops[mode]
    life[mode] = (number(values[index + 3]) - setup_ops * per[mode]) / connections
labels = {
    "off": "profile, `--no-qos` (FIFO; tenants and accounting stay)",
    "one": "QoS on, 1 tenant (the namespace's default)",
    "reg": f"QoS on, {env['TENANTS']} BE tenants registered, the load on the default tenant",
    "bound": f"QoS on, {env['TENANTS']} BE tenants registered, connection k bound to tenant k",
}

def top(path, count=40):
    rows = []
    if not os.path.exists(path):
        return rows
    for line in open(path):
        match = re.match(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(\S.*)$", line)
        if match is None or ":" not in match.group(2):
            continue
        file, _, function = match.group(2).strip().partition(":")
        function = re.sub(r"\s*\[[^\]]*\]$", "", function)
        row = (int(match.group(1).replace(",", "")), function)
        if row not in rows:
            rows.append(row)
    return rows[:count]

lines = []
add = lines.append
add("# The scheduler's cost with 10,000 tenants, in instructions (issue 10)")
add("")
add(f"- date: {env['RUN_DATE']}; commit: {env['COMMIT']}{env['DIRTY']}; {env['VALGRIND']}")
add(f"- command: `{env['COMMAND']}`")
add(f"- reflexd (one dataplane thread, blocking, `mem:256M` with `profiles/mem-unlimited.toml`) "
    f"under `valgrind --tool=callgrind`; load: {env['ACTIVE_THREADS']} × {env['ACTIVE_PER_THREAD']} "
    f"connections at QD 1, 4 KiB random reads, {env['WARMUP']} warm-up and {env['DURATION']} measured; the "
    "bench zeroes the server's counters when its measurement starts and dumps them when it ends "
    "(`--at-measure-start/--at-measure-end`): Ir per request = Ir of that window / requests measured. "
    f"A connection's life: counters zeroed, {setup_ops} requests on {connections} fresh connections "
    f"(connect, HELLO, BIND when bound, close), dumped: (Ir − {setup_ops} × Ir per request) / "
    f"{connections}. User space only (not the kernel's TCP and io_uring work). Under valgrind the "
    "server is the bottleneck, so batches are full.")
add("")
add("| server | requests measured | Ir per request | extra vs `--no-qos` | extra, % | Ir per connection's life |")
add("|---|---:|---:|---:|---:|---:|")
base = per.get("off")
for mode in ("off", "one", "reg", "bound"):
    if mode not in per:
        continue
    extra = "—" if base is None or mode == "off" else f"{per[mode] - base:+,.0f}"
    pct = "—" if base is None or mode == "off" else f"{(per[mode] / base - 1) * 100:+.1f} %"
    add(f"| {labels[mode]} | {ops[mode]:,} | **{per[mode]:,.0f}** | {extra} | {pct} | {life[mode]:,.0f} |")
add("")
for mode in ("one", "bound"):
    rows = top(os.path.join(env["WORK"], f"{mode}-inclusive.txt"))
    qos = [(ir, f) for ir, f in rows if "qos" in f or "dispatch" in f or "tenant" in f.lower() or "schedul" in f.lower()]
    if qos:
        add(f"Scheduler and tenant functions by inclusive Ir, mode `{mode}` (the measurement, {ops[mode]:,} requests):")
        add("")
        add("| Ir | Ir per request | function |")
        add("|---:|---:|---|")
        for ir, function in qos[:15]:
            name = function if len(function) <= 110 else function[:107] + "..."
            add(f"| {ir:,} | {ir / ops[mode]:,.0f} | `{name}` |")
        add("")
add(f"callgrind files and annotations: `{env['WORK']}/`.")
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
