#!/usr/bin/env bash
# Two devices in one reflexd on the real server (issue 11; a benchmark, not a test): does a
# best-effort flood on one device move the p95 of the other device's LC tenant?
# reflexd serves configs/reflexd-two-devices.toml (namespace 1: emu:device-a-small, namespace
# 2: emu:device-a, each with its own profile). Each repetition runs, one after the other on a
# fresh server, scenarios/two-devices.toml (LC A + BE flood C on namespace 1, LC B + BE D on
# namespace 2) and the same file without C ("quiet"), through bench/qos-real.sh; the tables
# give per-tenant medians, and the last line B's p95 with the flood over B's p95 without it,
# per repetition and as the median of those ratios (1.0: no interference).
#
# Usage (from the repository root): bench/two-devices.sh
# Environment: REPS (3), SERVER_CPU (1), CLIENT_CPU (0), PORT (17071), WORK
#   (target/two-devices); passed on to bench/qos-real.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

export REPS=${REPS:-3}
export PORT=${PORT:-17071}
export WORK=${WORK:-target/two-devices}
export SERVER_CONFIG=configs/reflexd-two-devices.toml
export MODES=on
mkdir -p "$WORK"
require python3 taskset
note "building release binaries"
cargo build --release -q -p reflex-server -p reflex-cli

# The quiet variant: the same file without tenant C.
quiet="$WORK/two-devices-quiet.toml"
python3 - scenarios/two-devices.toml "$quiet" <<'PY'
import sys
text = open(sys.argv[1]).read()
blocks = text.split("[[tenant]]")
kept = [b for b in blocks[1:] if 'name = "C"' not in b]
assert len(kept) == len(blocks) - 2, "tenant C not found exactly once"
open(sys.argv[2], "w").write(blocks[0] + "".join("[[tenant]]" + b for b in kept))
PY
export SCENARIOS="scenarios/two-devices.toml $quiet"
bench/qos-real.sh

python3 - "$WORK/raw" "$REPS" <<'PY'
import json, statistics, sys
raw, reps = sys.argv[1], int(sys.argv[2])
def p95(name, tenant, rep):
    with open(f"{raw}/{name}-on-{rep}.json") as f:
        return next(t for t in json.load(f)["tenants"] if t["name"] == tenant)["read"]["p95_us"]
ratios = [p95("two-devices", "B", rep) / p95("two-devices-quiet", "B", rep) for rep in range(1, reps + 1)]
print(f"\nB's read p95 with the flood on namespace 1 / without, per repetition: "
      f"{', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}")
PY
