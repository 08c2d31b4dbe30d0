#!/usr/bin/env bash
# OctoFAS Figures 3 and 9 shapes over the key-value port on the real server (issue 14, a
# benchmark, not a test): builds the release binaries and runs scenarios/kv-fig9-server.py
# (a sparse and a dense db_bench readrandom flow against reflexd with two dataplane threads,
# KV connections on both, the table's steps on thread 0; modes baseline, stage, inter,
# hybrid), each readrandom phase lasting WINDOW. The markdown table goes to OUT, progress and
# every run's figures to stderr.
#
# Usage: bench/kv-fig9.sh
# Environment: OUT (docs/results/kv-fig9.md), and the script's own: RUNS (2), DENSE (8),
#   WINDOW (1s; "" for OPS operations per thread instead), OPS (1000), KEYS (2000), DEPTH (8), BACKWARDINGS (2), MODES ("baseline stage fair_share
#   inter hybrid"; also intra, and any mode with +spread, e.g. "fair_share+spread")
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

OUT=${OUT:-docs/results/kv-fig9.md}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}

require python3
build_release
note "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
REFLEXD="$CARGO_TARGET_DIR/release/reflexd" REFLEX="$CARGO_TARGET_DIR/release/reflex" \
    python3 scenarios/kv-fig9-server.py > "$OUT"
note "load after: $(cut -d' ' -f1-3 /proc/loadavg); table in $OUT"
