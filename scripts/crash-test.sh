#!/usr/bin/env bash
# The long crash-consistency run of issue 9: `reflex crash-test` SIGKILLs reflexd CYCLES times
# while native, original-protocol and NBD writers (FLUSH, FUA, unflushed writes) are in flight,
# restarts it on the same ports, and checks every block of the namespace against the model of
# what may survive (docs/RELIABILITY.md). Writes the results to docs/results/crash.md and the
# raw JSON summary next to the work directory. Exits non-zero on any lost block.
#
# Usage: scripts/crash-test.sh                 (defaults below)
#        CYCLES=20 SEED=7 scripts/crash-test.sh
# Environment:
#   CYCLES (100)  BLOCKS_PER_CYCLE (2000: blocks acknowledged before the kill window opens)
#   KILL_WINDOW (100ms)  DEVICE_SIZE (64M)  THREADS (2: reflexd's)  CONNECTIONS (1 per protocol)
#   QUEUE_DEPTH (8)  SEED (from the clock; recorded)  TIME_LIMIT_MIN (30: minutes; the run
#   fails if its cycles do not fit)  WORK (target/crash-test: on a disk, not tmpfs)
#   OUT (docs/results/crash.md)
set -euo pipefail
cd "$(dirname "$0")/.."

CYCLES=${CYCLES:-100}
BLOCKS_PER_CYCLE=${BLOCKS_PER_CYCLE:-2000}
KILL_WINDOW=${KILL_WINDOW:-100ms}
DEVICE_SIZE=${DEVICE_SIZE:-64M}
THREADS=${THREADS:-2}
CONNECTIONS=${CONNECTIONS:-1}
QUEUE_DEPTH=${QUEUE_DEPTH:-8}
SEED=${SEED:-$(( $(date +%s%N) % 1000000007 ))}
TIME_LIMIT_MIN=${TIME_LIMIT_MIN:-30}
WORK=${WORK:-target/crash-test}
OUT=${OUT:-docs/results/crash.md}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
# Debian's python3 (pyenv's may be first on PATH): only the standard library is used.
PYTHON=$(PATH=/usr/bin:$PATH command -v python3)

log() { echo "==> $*" >&2; }

log "building release binaries"
cargo build --release -q -p reflex-server --bin reflexd -p reflex-cli --bin reflex
REFLEXD="$CARGO_TARGET_DIR/release/reflexd"
REFLEX="$CARGO_TARGET_DIR/release/reflex"

mkdir -p "$WORK"
JSON="$WORK/summary.json"
log "reflex crash-test: $CYCLES cycles, seed $SEED (work directory $WORK)"
status=0
# --time-limit bounds the cycles; `timeout` bounds everything else (a hung start or verify
# is bounded inside the harness too) with a margin over it.
timeout --signal=TERM --kill-after=30s "$(( TIME_LIMIT_MIN * 60 + 300 ))" \
    "$REFLEX" crash-test \
    --reflexd "$REFLEXD" \
    --dir "$WORK" \
    --cycles "$CYCLES" \
    --blocks-per-cycle "$BLOCKS_PER_CYCLE" \
    --kill-window "$KILL_WINDOW" \
    --device-size "$DEVICE_SIZE" \
    --threads "$THREADS" \
    --connections "$CONNECTIONS" \
    --queue-depth "$QUEUE_DEPTH" \
    --seed "$SEED" \
    --time-limit "${TIME_LIMIT_MIN}m" \
    --json >"$JSON" || status=$?

if [ ! -s "$JSON" ]; then
    log "no summary (exit status $status); reflexd's log: $WORK/reflexd.log"
    exit 1
fi

FS=$(df --output=fstype "$WORK" | tail -1)
# How reflexd opened the file, from its namespace log line.
MODE=$(grep -m1 -oE 'O_DIRECT refused|\(O_DIRECT' "$WORK/reflexd.log" | tr -d '(' || true)
"$PYTHON" - "$JSON" "$OUT" "$status" "$FS" "${MODE:-unknown}" <<'EOF'
import json, os, platform, sys

summary_path, out_path, status, fstype, mode = sys.argv[1:6]
status = int(status)
s = json.load(open(summary_path))
lines = []
add = lines.append
add("# Crash consistency: `reflex crash-test` (issue 9)")
add("")
add("Written by `scripts/crash-test.sh`; what the harness does and what it proves is in")
add("[../RELIABILITY.md](../RELIABILITY.md).")
add("")
add(f"- Machine: {os.cpu_count()} CPUs, Linux {platform.release()}, backing file on {fstype} ({mode}).")
add(f"- Command: `reflex crash-test --cycles {s['cycles_requested']} --blocks-per-cycle {s['blocks_per_cycle']} "
    f"--kill-window {s['kill_window_ms']}ms --device-size {s['device_size_bytes'] >> 20}M --threads {s['threads']} "
    f"--connections {s['connections_per_protocol']} --queue-depth {s['queue_depth']} --seed {s['seed']}`")
add(f"- Exit status: {status} ({'pass' if status == 0 else 'FAIL'}); duration {s['duration_secs']:.1f} s.")
add("")
add("| measure | value |")
add("|---|---|")
rows = [
    ("seed", s["seed"]),
    ("cycles (SIGKILLs) completed / requested", f"{s['cycles_completed']} / {s['cycles_requested']}"),
    ("kills with requests in flight", s["kills_with_requests_in_flight"]),
    ("requests in flight at a kill (min..max)", f"{s['in_flight_at_kill_min']}..{s['in_flight_at_kill_max']}"),
    ("kill time after the writers started (min..max)", f"{s['kill_after_ms_min']}..{s['kill_after_ms_max']} ms"),
    ("blocks written (4 KiB)", s["blocks_written"]),
    ("writes sent / acknowledged / durable", f"{s['writes']} / {s['writes_acknowledged']} / {s['writes_durable']}"),
    ("**durable blocks verified**", f"**{s['blocks_verified']}**"),
    ("unflushed blocks checked (old or any later write)", s["blocks_unflushed_checked"]),
    ("unchanged blocks re-checked", s["blocks_unchanged_checked"]),
    ("**lost blocks**", f"**{s['lost_blocks']}**"),
    ("requests answered with an error", s["request_errors"]),
    ("writers that ran dry before a kill", s["writers_finished_before_kill"]),
    ("restarts that waited for a port the killed reflexd still held", s["starts_that_waited_for_a_port"]),
    ("clean SIGTERM shutdown at the end", "yes" if s["clean_shutdown"] else "no"),
    ("duration", f"{s['duration_secs']:.1f} s"),
]
for name, value in rows:
    add(f"| {name} | {value} |")
add("")
add("| protocol | writes | blocks | FUA writes | FLUSHes completed / sent | durable writes |")
add("|---|---|---|---|---|---|")
for name, p in s["protocols"].items():
    add(f"| {name} | {p['writes']} | {p['blocks_written']} | {p['fua_writes']} | "
        f"{p['flushes_completed']} / {p['flushes']} | {p['writes_durable']} |")
add("")
if s["failures"]:
    add("Failures (first ones):")
    add("")
    for f in s["failures"]:
        add(f"- after cycle {f['cycle']}: block {f['block']} (offset {f['offset_bytes']}): "
            f"{f['kind']} in a {f['category']} block: expected {f['expected']}, found {f['found']}")
    add("")
open(out_path, "w").write("\n".join(lines).rstrip("\n") + "\n")
EOF
log "wrote $OUT"
cat "$OUT" >&2
exit "$status"
