#!/usr/bin/env bash
# Runs fuzz targets one after the other (never two at once), each for a number of executions
# and/or a time limit, and prints what libFuzzer reports at the end (executions, coverage).
#
# Usage: scripts/fuzz.sh [-r RUNS] [-t SECONDS] [-s SANITIZER] [-a] [-c] [TARGET...]
#   -r RUNS       executions per target (default 1000000; 0: no limit, then give -t)
#   -t SECONDS    time limit per target (default 0: none)
#   -s SANITIZER  address or none (default: none for dataplane*, address for the codecs)
#   -a            debug assertions and overflow checks on (cargo fuzz -a)
#   -c            comparison tracing on for the dataplane* targets too (off by default)
#   TARGET...     default: every target in fuzz/Cargo.toml
# FUZZ_ARGS="..." adds libFuzzer flags, e.g. FUZZ_ARGS="-fork=1 -ignore_crashes=1" to go on
# past a known crash (each crash still lands in fuzz/artifacts/TARGET/).
# Each target's working corpus is fuzz/work/TARGET (kept between runs; the seeds in
# fuzz/corpus/TARGET, or fuzz/corpus/dataplane for dataplane_protocol, are read, never written), crashes go to fuzz/artifacts/TARGET/, the whole
# libFuzzer log to fuzz/work/TARGET.log. A crash stops the script with a non-zero status.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

runs=1000000
seconds=0
sanitizer=""
assertions=()
compares=""
while getopts "r:t:s:ac" option; do
    case "$option" in
        r) runs="$OPTARG" ;;
        t) seconds="$OPTARG" ;;
        s) sanitizer="$OPTARG" ;;
        a) assertions=(-a) ;;
        c) compares=on ;;
        *) sed -n '2,21p' "$0" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
if [ "$runs" = 0 ] && [ "$seconds" = 0 ]; then
    echo "give -r RUNS or -t SECONDS" >&2
    exit 2
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo +nightly fuzz list)
fi

for target in "${targets[@]}"; do
    san="$sanitizer"
    if [ -z "$san" ]; then
        # The dataplane targets allocate each thread's buffer arena every run; under
        # AddressSanitizer's allocator that costs a fresh mapping per run (about 15 times
        # slower), so they run without it by default.
        case "$target" in dataplane*) san=none ;; *) san=address ;; esac
    fi
    # The dataplane targets run scripts of decoded choices, not parsers looking for magic
    # values; comparison tracing (libFuzzer's CMP hooks) costs them a third of each run
    # (measured on dataplane_protocol's corpus: 22.8 s against 14.7 s), so it is off unless
    # -c. Coverage counts (cov / ft) of the two builds are not comparable.
    trace=()
    case "$target" in dataplane*) [ -n "$compares" ] || trace=(--no-trace-compares) ;; esac
    mkdir -p "work/$target" "artifacts/$target"
    seeds=()
    if [ -d "corpus/$target" ]; then
        seeds=("corpus/$target")
    elif [ -d "corpus/${target%%_*}" ]; then
        # dataplane_protocol decodes the same scripts as dataplane.
        seeds=("corpus/${target%%_*}")
    fi
    commit=$(git rev-parse --short HEAD)
    dirty=$(git status --porcelain -- . ../crates | head -c1)
    echo "==> $target: runs=$runs max_total_time=${seconds}s sanitizer=$san ${assertions[*]:-} ${trace[*]:-} commit=$commit${dirty:+ (with local changes)}"
    start=$(date +%s)
    status=0
    # The default build (ASan, no -a) shares cargo fuzz's own target directory with
    # scripts/test.sh; the others get one each, so switching does not rebuild everything.
    target_dir=()
    if [ "$san" != address ] || [ ${#assertions[@]} -gt 0 ]; then
        target_dir=(--target-dir "target/fuzz-$san${assertions[*]:+-a}${trace[*]:+-ntc}")
    fi
    runs_flag=$runs
    [ "$runs" = 0 ] && runs_flag=-1   # libFuzzer: -1 is unlimited, 0 runs nothing
    cargo +nightly fuzz run -O "${assertions[@]}" "${trace[@]}" -s "$san" "${target_dir[@]}" \
        "$target" "work/$target" "${seeds[@]}" -- \
        -runs="$runs_flag" -max_total_time="$seconds" -print_final_stats=1 \
        -artifact_prefix="artifacts/$target/" ${FUZZ_ARGS:-} >"work/$target.log" 2>&1 || status=$?
    elapsed=$(( $(date +%s) - start ))
    grep -E '^#[0-9]+ +DONE|^stat::number_of_executed_units|^stat::average_exec_per_sec' "work/$target.log" ||
        grep -E '^#[0-9]+: cov' "work/$target.log" | tail -1 || true
    echo "    ${elapsed}s elapsed; log: fuzz/work/$target.log"
    if [ "$status" -ne 0 ]; then
        grep -E "panicked at|Test unit written" "work/$target.log" | head -5 || true
        echo "==> $target FAILED (status $status)" >&2
        exit "$status"
    fi
done
