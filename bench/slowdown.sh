#!/usr/bin/env bash
# A device that becomes 2x slower than its profile, on the real server (issue 11, a benchmark,
# not a test): Figure 5 scenario 1 at 1/10 scale (scenarios/fig5-small-scenario1-slowdown.toml:
# LC A 12K IOPS and LC B 7K, p95 <= 500 us, both following RENEGOTIATE notices; BE C and D
# saturating) against reflexd on `emu(slow=2x@12s):device-a-small`, whose device halves its
# speed 12 s after the server starts (about 10 s into the measurement, after the 2 s warm-up).
# Modes (MODES, default "cal nocal"), each on a fresh server per repetition, alternating:
#   cal       - configs/reflexd-small-slowdown.toml (online self-calibration on, 50 ms windows);
#   nocal     - configs/reflexd-small-slowdown-nocal.toml (the profile alone);
#   cal-nohyst - cal with `device_recovered_ratio = 2.0` (no hysteresis between cutting into LC
#               reservations and returning to the line, as before 2026-11-29 evening);
#   cal-floor - cal with `scale_floor = $SCALE_FLOOR` (0.1: the calibrator may cut the rate to a
#               tenth of the profile's instead of a fifth);
#   cal-plain - cal without burst room and with windows aimed at the SLO itself
#               (`target_ratio = 1.0`), as shipped before 2026-11-30.
# Per run: each tenant's IOPS and read p95 per 250 ms interval (the bench's timeline), and the
# server's device rate scale at the end and its last calibration window's server busy share
# (`reflex_device_rate_scale`, `reflex_device_server_busy_ratio` from /metrics).
# Reported: per mode, the median over the runs of the share of intervals from SETTLE_MS on in
# which A and B met 500 us, the first interval end after the slowdown from which each met it in
# every later interval, BE IOPS before and after, and the final scale.
#
# Usage: bench/slowdown.sh
# Environment: REPS (3) MODES ("cal nocal") SCALE_FLOOR (0.1, cal-floor) SERVER_CPU (1) CLIENT_CPU (0) SETTLE_MS (11500: from 1.5 s after the
#   slowdown) WORK (target/bench-slowdown) OUT (docs/results/slowdown.md) ISOLATE (on: every
#   other task that can leaves SERVER_CPU for the run, bench/lib/isolate.py; off: shared)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

REPS=${REPS:-3}
MODES=${MODES:-cal nocal}
SERVER_CPU=${SERVER_CPU:-1}
CLIENT_CPU=${CLIENT_CPU:-0}
SETTLE_MS=${SETTLE_MS:-11500}
export SCALE_FLOOR=${SCALE_FLOOR:-0.1}
WORK=${WORK:-target/bench-slowdown}
OUT=${OUT:-docs/results/slowdown.md}
SCENARIO=scenarios/fig5-small-scenario1-slowdown.toml
isolate_option
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}

require taskset python3 curl
build_release
BIN="$CARGO_TARGET_DIR/release"
mkdir -p "$WORK/raw"
rm -f "$WORK"/raw/*
trap 'stop_tracked; isolate_restore' EXIT
isolate_cpu "$SERVER_CPU"
wait_quiet 20 30 || note "the machine stayed busy; measuring anyway"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
SECONDS_SCENARIO=$(awk -F'=' '/^warmup_ms/ {w=$2} /^duration_ms/ {d=$2} END {print int((w + d) / 1000) + 1}' "$SCENARIO")

# derive NAME SED_SCRIPT PATTERN...: $WORK/reflexd-small-slowdown-NAME.toml, the shipped
# calibrated config edited by SED_SCRIPT, its profile path made absolute; every grep -E
# PATTERN must match it (one with a leading '!' must not), or the edit missed and the run would
# measure the shipped config under another name.
derive() {
    local name=$1 script=$2 out="$WORK/reflexd-small-slowdown-$1.toml" pattern
    shift 2
    sed "$script" configs/reflexd-small-slowdown.toml >"$out"
    for pattern in "$@"; do
        if [ "${pattern:0:1}" = "!" ]; then
            ! grep -Eq "${pattern:1}" "$out" || die "could not derive the cal-$name config"
        else
            grep -Eq "$pattern" "$out" || die "could not derive the cal-$name config"
        fi
    done
    sed -i 's#"\.\./profiles/#"'"$PWD"'/profiles/#' "$out"
}
# cal-nohyst: the hysteresis band closed.
derive nohyst 's/^window_us = 50000$/window_us = 50000\ndevice_recovered_ratio = 2.0/' \
    '^device_recovered_ratio = 2.0$'
# cal-floor: a lower scale floor.
derive floor 's/^window_us = 50000$/window_us = 50000\nscale_floor = '"$SCALE_FLOOR"'/' \
    "^scale_floor = $SCALE_FLOOR\$"
# cal-plain: no burst room, windows aimed at the SLO itself.
derive plain '/^\[qos_config\]$/d; /^deficit_limit_us = 100000$/d; s/^target_ratio = 0.9$/target_ratio = 1.0/' \
    '^target_ratio = 1.0$' '!^deficit_limit_us'

for rep in $(seq 1 "$REPS"); do
    for mode in $MODES; do
        case "$mode" in
            cal) config=configs/reflexd-small-slowdown.toml ;;
            nocal) config=configs/reflexd-small-slowdown-nocal.toml ;;
            cal-nohyst) config="$WORK/reflexd-small-slowdown-nohyst.toml" ;;
            cal-floor) config="$WORK/reflexd-small-slowdown-floor.toml" ;;
            cal-plain) config="$WORK/reflexd-small-slowdown-plain.toml" ;;
            *) die "unknown mode $mode (cal, nocal, cal-nohyst, cal-floor, cal-plain)" ;;
        esac
        port=$(free_port)
        admin=$(free_port)
        log="$WORK/raw/$mode-$rep.log"
        taskset -c "$SERVER_CPU" "$BIN/reflexd" --config "$config" --port "$port" \
            --nvme-tcp-port 0 --admin-listen "127.0.0.1:$admin" 2>"$log" &
        server=$!
        track "$server"
        wait_port "$port" "$server" || die "reflexd did not start: $log"
        note "$mode, run $rep (load $(cut -d' ' -f1 /proc/loadavg))"
        timeout $((SECONDS_SCENARIO + 20)) taskset -c "$CLIENT_CPU" "$BIN/reflex" bench \
            --server "127.0.0.1:$port" --scenario "$SCENARIO" --cpus "$CLIENT_CPU" --json -q \
            >"$WORK/raw/$mode-$rep.json"
        curl -s "http://127.0.0.1:$admin/metrics" >"$WORK/raw/$mode-$rep.metrics"
        awk '/^reflex_device_rate_scale/ {print $NF}' "$WORK/raw/$mode-$rep.metrics" \
            >"$WORK/raw/$mode-$rep.scale"
        stop_pid "$server"
    done
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

python3 - "$WORK/raw" "$REPS" "$SETTLE_MS" "$OUT" "$LOAD_BEFORE" "$LOAD_AFTER" "$(git rev-parse --short HEAD)" "$MODES" <<'EOF'
import json, os, statistics, sys, datetime
raw, reps, settle, out, before, after, commit, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7], sys.argv[8].split()
SLO = 500.0
SLOW_MS = 10_000  # the device slows 12 s after the server starts: about 10 s into the measurement
def tenant(run, name):
    return next(t for t in run["tenants"] if t["name"] == name)
def share(run, name):
    points = [p for p in tenant(run, name)["timeline"] if p["end_ms"] >= settle]
    return sum(1 for p in points if 0 < p["read_p95_us"] <= SLO) / len(points)
def held_from(run, name):
    # The first interval end after the slowdown from which every later interval met the SLO.
    points = [p for p in tenant(run, name)["timeline"] if p["end_ms"] > SLOW_MS]
    first = None
    for p in points:
        if 0 < p["read_p95_us"] <= SLO:
            first = p["end_ms"] if first is None else first
        else:
            first = None
    return first
def be_iops(run, lo, hi):
    total = 0.0
    for name in ("C", "D"):
        points = [p["iops"] for p in tenant(run, name)["timeline"] if lo < p["end_ms"] <= hi]
        total += statistics.mean(points) if points else 0.0
    return total
def p95_after(run, name):
    points = [p["read_p95_us"] for p in tenant(run, name)["timeline"] if p["end_ms"] >= settle]
    return statistics.median(points)
lines = [f"# A device 2x slower than its profile from t = 10 s, on the real server (bench/slowdown.sh)", "",
         f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}; load average before {before}, after {after}",
         f"- `{reps}` repetitions per mode, alternating, each on a fresh reflexd; scenario `scenarios/fig5-small-scenario1-slowdown.toml` (A 12K IOPS, B 7K, p95 ≤ 500 µs, both follow notices; C and D saturating), 250 ms intervals",
         f"- cal: `configs/reflexd-small-slowdown.toml`; nocal: `configs/reflexd-small-slowdown-nocal.toml`; cal-nohyst: cal with `device_recovered_ratio = 2.0`; cal-floor: cal with `scale_floor = {os.environ['SCALE_FLOOR']}`; cal-plain: cal without `deficit_limit_us` and with `target_ratio = 1.0`; intervals counted from {settle} ms",
         f"- server CPU: " + ("every other task that could run elsewhere moved off it for the run (`ISOLATE=on`, `bench/lib/isolate.py`)" if os.environ.get("ISOLATE") == "on" else "shared with every other task (`ISOLATE=off`)"), "",
         "| mode | run | A intervals met | B intervals met | A held from (ms) | B held from (ms) | A / B median interval p95 after (µs) | BE IOPS 5–10 s | BE IOPS 12–20 s | A / B IOPS after | final scale |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
summary = {}
for mode in modes:
    rows = []
    for rep in range(1, reps + 1):
        with open(f"{raw}/{mode}-{rep}.json") as f:
            run = json.load(f)
        scale = open(f"{raw}/{mode}-{rep}.scale").read().strip() or "?"
        busy = [l.split()[-1] for l in open(f"{raw}/{mode}-{rep}.metrics") if l.startswith("reflex_device_server_busy_ratio")]
        scale = f"{scale} (busy {float(busy[0]):.2f})" if busy else scale
        a_iops = statistics.mean(p["iops"] for p in tenant(run, "A")["timeline"] if p["end_ms"] >= settle)
        b_iops = statistics.mean(p["iops"] for p in tenant(run, "B")["timeline"] if p["end_ms"] >= settle)
        row = (share(run, "A"), share(run, "B"), held_from(run, "A"), held_from(run, "B"),
               p95_after(run, "A"), p95_after(run, "B"), be_iops(run, 5000, 10000), be_iops(run, 12000, 20000), a_iops, b_iops, scale)
        rows.append(row)
        fmt = lambda v: "never" if v is None else f"{v}"
        lines.append(f"| {mode} | {rep} | {row[0]:.2f} | {row[1]:.2f} | {fmt(row[2])} | {fmt(row[3])} | {row[4]:.0f} / {row[5]:.0f} "
                     f"| {row[6]:.0f} | {row[7]:.0f} | {row[8]:.0f} / {row[9]:.0f} | {scale} |")
    summary[mode] = rows
lines += ["", "Medians over the runs:", "", "| mode | A intervals met | B intervals met | A / B median interval p95 after (µs) | BE IOPS before → after |", "|---|---:|---:|---:|---:|"]
for mode, rows in summary.items():
    med = lambda i: statistics.median(r[i] for r in rows)
    lines.append(f"| {mode} | {med(0):.2f} | {med(1):.2f} | {med(4):.0f} / {med(5):.0f} | {med(6):.0f} → {med(7):.0f} |")
text = "\n".join(lines) + "\n"
open(out, "w").write(text)
print(text)
EOF
