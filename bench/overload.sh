#!/usr/bin/env bash
# Overload proof (issue 9, a benchmark, not a test): does an attack on reflexd hurt a
# latency-critical tenant, lock out newcomers, or grow the server's memory without bound?
#
# The server: reflexd as configs/reflexd-small-headroom.toml (one dataplane thread, blocking
# mode, emu:device-a-small with its profile, slo_headroom_us 100) with room for the attack's
# connections: connections_per_thread_max CONNECTIONS (12000). Pinned to SERVER_CPU; every
# client is pinned to CLIENT_CPU (2 vCPUs: the attackers compete with the LC client for that
# CPU, never with the server for its own).
#
# Per repetition, two runs of the scaled Figure 5 scenario 2 (SCENARIO: LC A 12K IOPS and LC B
# 7K reserved / 4.5K sent, both p95 <= 500 us; BE C and D saturating), each on a fresh server:
#   none   - the scenario alone;
#   attack - the scenario while `reflex flood` (from SOURCE, 127.0.0.2, at niceness 19: the
#            attack is bounded by the server's design, not by starving it of client CPU) holds
#            (a) IDLE connections that completed a HELLO (established, then parked),
#            (b) SLOWLORIS connections that sent 2 bytes of a header and wait, replaced as the
#                server closes them (eviction when the table is full, handshake timeout 10 s)
#                at most CONNECT_RATE per second, and
#            (c) NON_READERS connections that pipeline 128 READs of 1 MiB with a 4 KiB receive
#                buffer and never read.
# In both runs a fresh client (`reflex flood --fresh-interval FRESH_INTERVAL`) connects, sends
# HELLO and a 4 KiB READ, and closes, over and over during the scenario: connect + first answer
# latency, p99 and max (target: within 100 ms). The server's VmRSS is sampled every 0.5 s.
# The LC client, the fresh client and the server run at niceness NICE (-20 as root), or, with
# RT_PRIO set, SCHED_FIFO at that priority (as bench/limit.sh): other sessions' builds and
# tests on this shared machine then cannot delay them; the attacker always runs at niceness 19.
#
# Results: docs/results/overload.md (OUT); raw JSON, logs and RSS samples in $WORK/raw/.
# Usage: bench/overload.sh     REPS=1 bench/overload.sh
# Environment: REPS (3) SCENARIO (scenarios/fig5-small-scenario2.toml) IDLE (10000)
#   SLOWLORIS (2000) NON_READERS (1) CONNECTIONS (12000) CONNECT_RATE (1000) SOURCE (127.0.0.2)
#   FRESH_INTERVAL (20ms) SERVER_CPU (0) CLIENT_CPU (1) PORT (17280) ADMIN_PORT (17281)
#   ATTACK_CPU (CLIENT_CPU; SERVER_CPU puts the attacker beside the server instead: on loopback
#   a packet's receive path runs on the sender's CPU, so with the attacker on the clients' CPU
#   the kernel's work for the attack's SYNs, FINs and data lands on the LC client's CPU, where
#   a remote attacker's never would; beside the server it lands where a remote attacker's
#   lands, on the server's machine, and the attacker's own user-space work competes with the
#   server at niceness 19)
#   NICE (-20 as root) RT_PRIO ISOLATE (on: every other task that can leaves SERVER_CPU for the
#   run, bench/lib/isolate.py; off: it is shared as the scheduler likes)
#   QUIET_MAX_PERCENT (20) QUIET_WAIT_S (30) WORK (target/bench-overload)
#   CALIBRATION (off, reflexd's default: the profile alone; on: online self-calibration with
#   its best-effort floor, docs/QOS.md §11)
#   OUT (docs/results/overload.md)
#   BASE_CONFIG (configs/reflexd-small-headroom.toml; configs/reflexd-small-calibrated.toml is
#   the shipped configuration that learns its margin instead of a hand-set headroom)
#   REPORTS (on: the LC tenants' clients REPORT their p95 every 25 ms, docs/PROTOCOL.md §1.9,
#   which self-calibration learns the share outside the server from; off: they do not)
#   POLL (off: blocking mode, the dataplane sleeps in its ring when idle; on: `poll = true`, it
#   spins on its own CPU, as the paper's IX dataplane does, and no wake-up of a halted vCPU
#   lies between a request's arrival and its handling)
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
source bench/lib/common.sh

REPS=${REPS:-3}
CALIBRATION=${CALIBRATION:-off}
BASE_CONFIG=${BASE_CONFIG:-configs/reflexd-small-headroom.toml}
case "$CALIBRATION" in on | off) ;; *) die "CALIBRATION must be on or off, not $CALIBRATION" ;; esac
POLL=${POLL:-off}
case "$POLL" in on | off) ;; *) die "POLL must be on or off, not $POLL" ;; esac
REPORTS=${REPORTS:-on}
case "$REPORTS" in on | off) ;; *) die "REPORTS must be on or off, not $REPORTS" ;; esac
REPORT_FLAGS=()
[ "$REPORTS" = on ] || REPORT_FLAGS=(--report-interval 0s)
SCENARIO=${SCENARIO:-scenarios/fig5-small-scenario2.toml}
IDLE=${IDLE:-10000}
SLOWLORIS=${SLOWLORIS:-2000}
NON_READERS=${NON_READERS:-1}
CONNECTIONS=${CONNECTIONS:-12000}
CONNECT_RATE=${CONNECT_RATE:-1000}
SOURCE=${SOURCE:-127.0.0.2}
FRESH_INTERVAL=${FRESH_INTERVAL:-20ms}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
ATTACK_CPU=${ATTACK_CPU:-$CLIENT_CPU}
PORT=${PORT:-17280}
ADMIN_PORT=${ADMIN_PORT:-17281}
if [ "$(id -u)" = 0 ]; then NICE=${NICE:--20}; else NICE=${NICE:-0}; fi
RT_PRIO=${RT_PRIO:-}
isolate_option
# prio: the command prefix that gives the server and the measuring clients their priority.
prio() {
    if [ -n "$RT_PRIO" ]; then echo chrt -f "$RT_PRIO"; else echo nice -n "$NICE"; fi
}
QUIET_MAX_PERCENT=${QUIET_MAX_PERCENT:-20}
QUIET_WAIT_S=${QUIET_WAIT_S:-30}
WORK=${WORK:-target/bench-overload}
OUT=${OUT:-docs/results/overload.md}
STEP_SLACK_S=${STEP_SLACK_S:-60}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}

[ "$SERVER_CPU" != "$CLIENT_CPU" ] || die "SERVER_CPU and CLIENT_CPU must differ"
[ "$ATTACK_CPU" = "$SERVER_CPU" ] || [ "$ATTACK_CPU" = "$CLIENT_CPU" ] ||
    die "ATTACK_CPU must be SERVER_CPU ($SERVER_CPU) or CLIENT_CPU ($CLIENT_CPU), not $ATTACK_CPU"
require taskset python3 awk
raise_fd_limit $((IDLE + SLOWLORIS + 256)) "$((IDLE + SLOWLORIS)) connections"
build_release

RAW="$WORK/raw"
mkdir -p "$RAW"
rm -f "$RAW"/*
RUNS="$RAW/runs.jsonl"
: >"$RUNS"
CONFIG="$WORK/overload.toml"
{
    echo "# bench/overload.sh: $BASE_CONFIG with room for the attack."
    grep -v '^#' "$BASE_CONFIG" |
        sed "s/^port = .*/port = $PORT/; s/^threads = 1/threads = 1\nconnections_per_thread_max = $CONNECTIONS/; s#\"\.\./profiles/#\"$PWD/profiles/#" |
        if [ "$POLL" = on ]; then sed "s/^threads = 1/threads = 1\npoll = true/"; else cat; fi
    if [ "$CALIBRATION" = on ]; then
        printf '\n[qos_config.calibration]\nenabled = true\n'
    fi
    printf '\n[admin]\nlisten = "127.0.0.1:%s"\n' "$ADMIN_PORT"
} >"$CONFIG"
grep -q "connections_per_thread_max = $CONNECTIONS" "$CONFIG" || die "could not write $CONFIG"
[ "$POLL" = off ] || grep -q "^poll = true" "$CONFIG" || die "could not write poll = true to $CONFIG"
SECONDS_SCENARIO=$(awk -F'=' '/^warmup_ms/ {w=$2} /^duration_ms/ {d=$2} END {print int((w + d) / 1000) + 1}' "$SCENARIO")

SERVER_PID=""
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
    PIDS=()
    [ -z "$SERVER_PID" ] || stop_pid "$SERVER_PID"
    SERVER_PID=""
    autogroup_restore
    isolate_restore
}
trap cleanup EXIT
# Niceness counts only inside a scheduler autogroup (a session): give ours NICE too.
[ "$NICE" -ge 0 ] || autogroup_nice "$NICE"
# The server's CPU is its own: every other task that may run elsewhere moves off it.
isolate_cpu "$SERVER_CPU"
AUTOGROUP=$(cat /proc/self/autogroup 2>/dev/null || echo none)

start_server() {
    local name=$1
    if [ "$QUIET_WAIT_S" -gt 0 ] && ! wait_quiet "$QUIET_MAX_PERCENT" "$QUIET_WAIT_S"; then
        note "the machine stayed busy for ${QUIET_WAIT_S}s; starting $name anyway"
        echo "busy_start $name" >>"$RAW/notes.txt"
    fi
    # The whole process on SERVER_CPU: with two CPUs, the other one is the clients', and
    # reflexd's admin and control threads there (--dataplane-cpus) cost the clients more
    # (A / B p95 under attack 573 / 573 µs against 526 / 524 µs, REPS=3 each, 2026-11-28).
    # shellcheck disable=SC2046
    $(prio) taskset -c "$SERVER_CPU" "$REFLEXD" --config "$CONFIG" >"$RAW/$name.log" 2>&1 &
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

rss_kb() { awk '/^VmRSS:/ { print $2 }' /proc/"$1"/status 2>/dev/null || echo 0; }

# one_run REP MODE: a fresh server, the attack (MODE attack), the scenario and the fresh client.
one_run() {
    local rep=$1 mode=$2 name="$2-$1" flood_pid="" fresh_pid sampler cpu_before cpu_after
    local ready="$RAW/ready-$name" stop="$RAW/stop-$name" start end
    note "repetition $rep: $mode"
    start_server "$name"
    local rss_start
    rss_start=$(rss_kb "$SERVER_PID")
    # VmRSS every 0.5 s until the server exits.
    (while kill -0 "$SERVER_PID" 2>/dev/null; do
        echo "$(now_ns) $(rss_kb "$SERVER_PID")"
        sleep 0.5
    done) >"$RAW/$name-rss.txt" &
    sampler=$!
    if [ "$mode" = attack ]; then
        timeout $((SECONDS_SCENARIO + STEP_SLACK_S + 120)) nice -n 19 taskset -c "$ATTACK_CPU" \
            "$REFLEX" flood -s "127.0.0.1:$PORT" --source "$SOURCE" --idle "$IDLE" \
            --slowloris "$SLOWLORIS" --reconnect --non-reader "$NON_READERS" \
            --connect-rate 5000 --reconnect-rate "$CONNECT_RATE" --duration 900s --ready-file "$ready" --stop-file "$stop" \
            --json -q >"$RAW/$name-flood.json" 2>"$RAW/$name-flood.err" &
        flood_pid=$!
        PIDS+=("$flood_pid")
        wait_file "$ready" "$flood_pid" 120 || die "the attack did not set up"
    fi
    local rss_attacked
    rss_attacked=$(rss_kb "$SERVER_PID")
    # shellcheck disable=SC2046
    timeout $((SECONDS_SCENARIO + STEP_SLACK_S)) $(prio) taskset -c "$CLIENT_CPU" \
        "$REFLEX" flood -s "127.0.0.1:$PORT" --fresh-interval "$FRESH_INTERVAL" \
        --duration "${SECONDS_SCENARIO}s" --json -q >"$RAW/$name-fresh.json" \
        2>"$RAW/$name-fresh.err" &
    fresh_pid=$!
    PIDS+=("$fresh_pid")
    cpu_before=$(cpu_ns "$SERVER_PID")
    start=$(now_ns)
    # The server's own view of the scenario's tenants (arrival off the socket to the reply's
    # send) two thirds into it (the tenants leave with it): the client's p95 less the
    # server's is the network's and the client's share.
    (sleep $((SECONDS_SCENARIO * 2 / 3)) && curl -s --max-time 5 \
        "http://127.0.0.1:$ADMIN_PORT/v1/stats" >"$RAW/$name-stats.json") &
    PIDS+=("$!")
    # shellcheck disable=SC2046
    timeout $((SECONDS_SCENARIO + STEP_SLACK_S)) $(prio) taskset -c "$CLIENT_CPU" \
        "$REFLEX" bench -s "127.0.0.1:$PORT" --scenario "$SCENARIO" --cpus "$CLIENT_CPU" \
        --json -q "${REPORT_FLAGS[@]}" >"$RAW/$name-scenario.json" 2>"$RAW/$name-scenario.err" ||
        { cat "$RAW/$name-scenario.err" >&2; die "the scenario failed ($name)"; }
    end=$(now_ns)
    cpu_after=$(cpu_ns "$SERVER_PID")
    wait "$fresh_pid" || { cat "$RAW/$name-fresh.err" >&2; die "the fresh client failed ($name)"; }
    if [ -n "$flood_pid" ]; then
        touch "$stop"
        wait "$flood_pid" || { cat "$RAW/$name-flood.err" >&2; die "the attack failed ($name)"; }
    fi
    PIDS=()
    stop_pid "$SERVER_PID"
    SERVER_PID=""
    wait "$sampler" 2>/dev/null || true
    local closes
    closes=$(grep -c "closing connection" "$RAW/$name.log" || true)
    python3 -c '
import json, sys
keys = ["rep", "mode", "rss_start_kb", "rss_attacked_kb", "server_cpu_ns", "wall_ns", "timeout_closes", "name"]
print(json.dumps(dict(zip(keys, sys.argv[1:]))))' "$rep" "$mode" "$rss_start" "$rss_attacked" \
        "$((cpu_after - cpu_before))" "$((end - start))" "$closes" "$name" >>"$RUNS"
}

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
for rep in $(seq 1 "$REPS"); do
    one_run "$rep" none
    one_run "$rep" attack
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

note "writing $OUT"
set_revision
CPU_MODEL=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
RUN_DATE=$(date -u +"%Y-%m-%d %H:%M UTC")
MACHINE="$(nproc --all) vCPU ${CPU_MODEL}, $(free -g | awk '/Mem:/ {print $2}') GiB RAM, kernel $(uname -r)"
COMMAND="REPS=$REPS BASE_CONFIG=$BASE_CONFIG CALIBRATION=$CALIBRATION POLL=$POLL REPORTS=$REPORTS ISOLATE=$ISOLATE${RT_PRIO:+ RT_PRIO=$RT_PRIO}$([ "$ATTACK_CPU" = "$CLIENT_CPU" ] || echo " ATTACK_CPU=$ATTACK_CPU") QUIET_WAIT_S=$QUIET_WAIT_S bench/overload.sh"
PRIORITY=$(if [ -n "$RT_PRIO" ]; then echo "SCHED_FIFO priority $RT_PRIO"; else echo "niceness $NICE"; fi)
export BASE_CONFIG POLL ISOLATE AUTOGROUP RUN_DATE MACHINE COMMIT DIRTY COMMAND LOAD_BEFORE LOAD_AFTER SERVER_CPU CLIENT_CPU ATTACK_CPU PRIORITY \
    IDLE SLOWLORIS NON_READERS CONNECTIONS CONNECT_RATE SOURCE FRESH_INTERVAL SCENARIO RAW CONFIG
mkdir -p "$(dirname "$OUT")"
python3 bench/lib/overload_report.py "$RUNS" "$OUT"
