#!/usr/bin/env bash
# Instructions per request (issue 10): user-space instructions (callgrind's Ir) reflexd and
# limit-server execute to answer one 4 KiB original-protocol read, counted exactly, so the
# figure repeats from run to run on a noisy machine where times do not.
#
# For each server: run it under `valgrind --tool=callgrind` (blocking mode, 1 dataplane
# thread; reflexd on a `mem` namespace); zero its counters, send exactly REQUESTS reads with
# limit-client (--requests, CONNECTIONS × DEPTH in flight, the client itself not under
# valgrind), dump the counters: Ir per request = that dump's total Ir (all the server's
# threads) / REQUESTS. Then zero again, wait IDLE_S with no client and dump, to show what the
# server costs while idle (should be ~0: it sleeps in io_uring_enter). Zeroing and dumping go
# through vgdb (callgrind_control -z / -d) rather than a SIGTERM at the end: valgrind 3.19
# treats io_uring_enter as a non-blocking call, keeps its big lock and signals blocked while a
# thread sleeps in it, so neither server ever sees a SIGTERM under valgrind (a SIGTERM is still
# sent, then SIGKILL). The kernel's work (TCP, io_uring) is not counted: callgrind sees user
# space only. Under valgrind the server is the bottleneck, so every io_uring_enter finds a full
# batch: these are large-batch figures.
# Results: docs/results/instructions.md, with reflexd's top functions by inclusive cost
# (callgrind_annotate); the callgrind files stay in $WORK.
#
# Usage: bench/instructions.sh          (defaults below)
# Environment: REQUESTS (100000) CONNECTIONS (16) DEPTH (32) PORT (17090) IDLE_S (1)
#   WORK (target/bench-instructions) OUT (docs/results/instructions.md) TOP (25)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

REQUESTS=${REQUESTS:-100000}
CONNECTIONS=${CONNECTIONS:-16}
DEPTH=${DEPTH:-32}
PORT=${PORT:-17090}
IDLE_S=${IDLE_S:-1}
WORK=${WORK:-target/bench-instructions}
OUT=${OUT:-docs/results/instructions.md}
TOP=${TOP:-25}
# Valgrind runs the server some 50× slower: generous but finite bounds.
START_WAIT_S=${START_WAIT_S:-120}
CLIENT_TIMEOUT_S=${CLIENT_TIMEOUT_S:-900}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}

require valgrind callgrind_annotate python3
note "building release binaries (with debug line info, profile.release debug = 1)"
cargo build --release -q -p reflex-server -p reflex-limit
REFLEXD="$CARGO_TARGET_DIR/release/reflexd"
LIMIT_SERVER="$CARGO_TARGET_DIR/release/limit-server"
LIMIT_CLIENT="$CARGO_TARGET_DIR/release/limit-client"
mkdir -p "$WORK"
rm -f "$WORK"/callgrind.*.out* "$WORK"/*.json "$WORK"/*.log

SERVER_PID=""
stop_server() {
    [ -z "$SERVER_PID" ] || stop_valgrind "$SERVER_PID"
    SERVER_PID=""
}
trap stop_server EXIT

# stop_valgrind PID: SIGTERM and a connection to the port (so a sleeping loop returns), then
# SIGKILL after 5 s (see the header: valgrind 3.19 does not deliver the SIGTERM).
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

# measure NAME: one callgrind run of server NAME; sets LOADED_IR, IDLE_IR and LOADED_DUMP.
measure() {
    local name=$1 prefix
    prefix="$WORK/callgrind.$name.out"
    case "$name" in
        reflexd) reflexd_mem_command "$REFLEXD" "$PORT" 0 ;;
        limit-server) limit_server_command "$LIMIT_SERVER" "$PORT" ;;
    esac
    valgrind --tool=callgrind --callgrind-out-file="$prefix" "${SERVER_COMMAND[@]}" \
        >"$WORK/$name.log" 2>&1 &
    SERVER_PID=$!
    # Ready once it answers a request: a listening port is not enough (reflexd binds its ports
    # before opening the namespace, which takes a while under valgrind).
    local deadline=$((SECONDS + START_WAIT_S))
    until "$LIMIT_CLIENT" --addr "127.0.0.1:$PORT" --requests 1 --timeout 10s >/dev/null 2>&1; do
        kill -0 "$SERVER_PID" 2>/dev/null && ((SECONDS < deadline)) ||
            { cat "$WORK/$name.log" >&2; die "$name did not start under valgrind"; }
        sleep 0.5
    done
    zero_counters "$SERVER_PID"
    timeout $((CLIENT_TIMEOUT_S + 10)) "$LIMIT_CLIENT" --addr "127.0.0.1:$PORT" \
        --requests "$REQUESTS" --connections "$CONNECTIONS" --depth "$DEPTH" \
        --timeout "${CLIENT_TIMEOUT_S}s" --json >"$WORK/$name.json" ||
        die "limit-client failed against $name under valgrind"
    LOADED_IR=$(dump_total "$SERVER_PID" "$prefix")
    LOADED_DUMP=$(ls -t "$prefix".* | head -1)
    zero_counters "$SERVER_PID"
    sleep "$IDLE_S"
    IDLE_IR=$(dump_total "$SERVER_PID" "$prefix")
    stop_server
    [ -n "$LOADED_IR" ] && [ -n "$IDLE_IR" ] || die "no totals in the dumps of $name"
}

declare -A IR DUMP
for name in limit-server reflexd; do
    note "$name: $REQUESTS requests under callgrind"
    measure "$name"
    IR[$name-loaded]=$LOADED_IR
    IR[$name-idle]=$IDLE_IR
    DUMP[$name]=$LOADED_DUMP
    note "$name: Ir $LOADED_IR for $REQUESTS requests, $IDLE_IR idle for ${IDLE_S}s"
done

note "annotating reflexd"
callgrind_annotate --inclusive=yes --threshold=100 "${DUMP[reflexd]}" \
    >"$WORK/reflexd-inclusive.txt" 2>/dev/null
callgrind_annotate --inclusive=yes --threshold=100 "${DUMP[limit-server]}" \
    >"$WORK/limit-server-inclusive.txt" 2>/dev/null

set_revision
export RUN_DATE COMMIT DIRTY VALGRIND REQUESTS CONNECTIONS DEPTH TOP WORK IDLE_S
RUN_DATE=$(date -u +"%Y-%m-%d %H:%M UTC")
VALGRIND=$(valgrind --version)
mkdir -p "$(dirname "$OUT")"
python3 - "$OUT" "${IR[limit-server-idle]}" "${IR[limit-server-loaded]}" \
    "${IR[reflexd-idle]}" "${IR[reflexd-loaded]}" <<'PY'
import os, re, sys

out = sys.argv[1]
limit_idle, limit_loaded, reflexd_idle, reflexd_loaded = (int(v.replace(",", "")) for v in sys.argv[2:6])
env = os.environ
requests = int(env["REQUESTS"])
work = env["WORK"]
top = int(env["TOP"])

limit_per = limit_loaded / requests
reflexd_per = reflexd_loaded / requests

def top_functions(path, count, total):
    """(Ir, function, source file) rows of a callgrind_annotate listing, largest first,
    without the thread start-up frames that hold everything (above 99 % of the total)."""
    rows = []
    for line in open(path):
        match = re.match(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(\S.*)$", line)
        if match is None or ":" not in match.group(2):
            continue
        ir = int(match.group(1).replace(",", ""))
        if ir > 0.99 * total:
            continue
        file, _, function = match.group(2).strip().partition(":")
        function = re.sub(r"\s*\[[^\]]*\]$", "", function)
        row = (ir, function, os.path.basename(file))
        # The same function is listed once per spelling of its file's path: keep one.
        if row not in rows:
            rows.append(row)
    return rows[:count]

def cell(text, width=100):
    text = text if len(text) <= width else text[: width - 3] + "..."
    return text.replace("|", "\\|")

lines = []
add = lines.append
add("# Instructions per request (issue 10)")
add("")
add(f"- date: {env['RUN_DATE']}; commit: {env['COMMIT']}{env['DIRTY']}; {env['VALGRIND']}")
add("- command: `bench/instructions.sh`")
add(f"- each server runs under `valgrind --tool=callgrind` (blocking mode, one dataplane thread; reflexd "
    f"serves `-n 1=mem:1G` on an original-protocol port). Its counters are zeroed (`callgrind_control -z`), "
    f"`limit-client --requests {requests} --connections {env['CONNECTIONS']} --depth {env['DEPTH']}` sends exactly "
    f"{requests:,} 4 KiB reads, and the counters are dumped (`callgrind_control -d`): Ir = instructions executed "
    "in user space by all the server's threads in that window (accepting the connections included; the "
    "kernel's TCP and io_uring work is not counted). Ir per request = that / requests. The idle column is "
    f"the same for {env['IDLE_S']} s with no client.")
add("- the counters are read through vgdb, not at exit after a SIGTERM: valgrind 3.19 treats "
    "`io_uring_enter` as a non-blocking system call, so while a thread sleeps in it valgrind holds its "
    "lock with signals blocked and neither server ever receives the SIGTERM.")
add("- under valgrind the server is far slower than the client, so every `io_uring_enter` finds "
    "full batches: these are large-batch figures.")
add("")
add(f"| server | Ir for {requests:,} requests | Ir per request | Ir while idle for {env['IDLE_S']} s |")
add("|---|---:|---:|---:|")
add(f"| limit-server | {limit_loaded:,} | **{limit_per:,.0f}** | {limit_idle:,} |")
add(f"| reflexd | {reflexd_loaded:,} | **{reflexd_per:,.0f}** | {reflexd_idle:,} |")
add(f"| reflexd / limit-server | | **{reflexd_per / limit_per:.1f}×** | |")
add("")
for name, total in (("reflexd", reflexd_loaded), ("limit-server", limit_loaded)):
    count = top if name == "reflexd" else 10
    add(f"## {name}: top {count} functions by inclusive cost (loaded window)")
    add("")
    add("From `callgrind_annotate --inclusive=yes`, without the thread start-up frames that "
        "contain everything. Inclusive costs overlap where one function calls another. Code "
        "inlined from another source file is listed under that file, so one function can appear "
        "more than once.")
    add("")
    add("| inclusive Ir | per request | function | source file |")
    add("|---:|---:|---|---|")
    for ir, function, file in top_functions(os.path.join(work, f"{name}-inclusive.txt"), count, total):
        add(f"| {ir:,} | {ir / requests:,.0f} | `{cell(function)}` | `{cell(file, 40)}` |")
    add("")
add(f"Callgrind dumps: `{work}/callgrind.*.out.*` (`callgrind_annotate` or kcachegrind).")
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
