#!/usr/bin/env bash
# Runs the socket tests while the test process is stopped and resumed every few milliseconds.
#
# Why: a blocking socket call on a socket with a timeout (SO_RCVTIMEO, which most of our test
# clients set) fails with EINTR when its process is stopped and resumed, even with no signal
# handler (signal(7), "Interruption of system calls and library functions by stop signals").
# std's read_exact/write_all/read_to_end go on after EINTR; a hand-written read, peek or an
# OpenSSL handshake does not. A busy CI machine stops and resumes processes, and one such
# EINTR failed a landing CI (tls.rs's OpenSSL handshake, 2026-11-30). This finds the next one
# in minutes instead of one CI run in many.
#
# Usage: scripts/stop-resume.sh   (builds the release test binaries first)
#   PASSES=3       how many times each binary runs
#   GAP=0.003      seconds the process runs between two stops (each stop lasts 1 ms)
#   ONLY="nbd tls" only the test targets with these names
#   LIMIT=400      seconds after which a binary is killed (and counted as failed)
#   GROUP=1        stop the whole process group: the test process and every reflexd, nbdinfo,
#                  qemu-img... it starts (as a cgroup freezer or a paused container would)
# Exit status: 0 when every run passed; 1 otherwise, with each failed run's output kept in
# target/stop-resume/ and its first panic printed.
set -euo pipefail
cd "$(dirname "$0")/.."
PASSES=${PASSES:-3}
GAP=${GAP:-0.003}
ONLY=${ONLY:-}
LIMIT=${LIMIT:-400}
GROUP=${GROUP:-}
out=target/stop-resume
mkdir -p "$out"
rm -f "$out"/*.out

echo "==> building the release test binaries"
# Each test binary with the directory of its package (where cargo test runs it).
cargo test --release --workspace --no-run --message-format=json -q 2>/dev/null | python3 -c '
import json, os, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable") \
            and message["profile"]["test"]:
        package = os.path.dirname(message["manifest_path"])
        print(message["target"]["name"], message["executable"], package)
' > "$out/binaries.txt"

# The crates whose tests talk over sockets; the others run in memory.
socket_package() {
    case "$1" in */crates/server | */crates/client | */crates/cli | */bench/limit) return 0 ;; esac
    return 1
}

# Runs one binary in its package directory under stops and resumes; prints one line.
run_stopped() {
    local name=$1 executable=$2 package=$3 pass=$4
    local log="$out/$name.$(basename "$package").$pass.out"
    local start=$SECONDS
    # In a process group of its own (setsid), so that GROUP=1 stops its children too.
    (cd "$package" && exec setsid "$executable" -q) >"$log" 2>&1 &
    local test_pid=$!
    local target=$test_pid
    if [ -n "$GROUP" ]; then
        target=-$test_pid
        sleep 0.05
        local group
        group=$(ps -o pgid= -p "$test_pid" | tr -d ' ' || true)
        if [ -n "$group" ] && [ "$group" != "$test_pid" ]; then
            echo "stop-resume: $name is not the leader of its process group ($group)" >&2
            exit 2
        fi
    fi
    (
        while kill -0 "$test_pid" 2>/dev/null; do
            kill -STOP -- "$target" 2>/dev/null || break
            sleep 0.001
            kill -CONT -- "$target" 2>/dev/null || break
            sleep "$GAP"
            if ((SECONDS - start > LIMIT)); then
                echo "killed after ${LIMIT} s" >>"$log"
                kill -KILL "$test_pid" 2>/dev/null
            fi
        done
    ) &
    local stopper=$!
    local status=0
    wait "$test_pid" || status=$?
    kill -CONT -- "$target" 2>/dev/null || true
    wait "$stopper" || true
    local result
    result=$(grep -h "test result" "$log" | tail -1 || true)
    printf '%-20s %-8s pass %d  exit %3d  %4d s  %s\n' "$name" "$(basename "$package")" \
        "$pass" "$status" $((SECONDS - start)) "$result"
    if ((status != 0)); then
        grep -m1 -A1 "panicked" "$log" | sed 's/^/    /' || true
        return 1
    fi
    rm -f "$log"
}

failed=0
runs=0
for pass in $(seq "$PASSES"); do
    echo "==> pass $pass of $PASSES (stopped for 1 ms every ${GAP} s)"
    while read -r name executable package; do
        socket_package "$package" || continue
        [ "$name" = tidy ] && continue
        if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
        runs=$((runs + 1))
        run_stopped "$name" "$executable" "$package" "$pass" || failed=$((failed + 1))
    done <"$out/binaries.txt"
done
echo "==> $failed of $runs runs failed"
((failed == 0))
