#!/usr/bin/env bash
# Real runs of multi-tenant QoS scenarios (a benchmark, not a test): for each scenario file and
# each of QoS on / QoS off, REPS times: start reflexd with SERVER_CONFIG pinned to SERVER_CPU
# (with --no-qos for "off"), run `reflex bench --scenario FILE --json` pinned to CLIENT_CPU,
# stop reflexd. Raw JSON goes to $WORK/raw/; the per-tenant medians over the repetitions are
# printed as markdown tables (what docs/results/qos-real.md records). Every step is bounded in
# time (the scenario's warm-up + duration, plus STEP_SLACK seconds).
#
# Usage (from the repository root, release binaries built):
#   bench/qos-real.sh                                  # the scaled Figure 5 scenarios
#   SERVER_CONFIG=configs/reflexd-file.toml SCENARIOS="scenarios/file-scenario1.toml" \
#     bench/qos-real.sh
# Environment: REPS (3), SCENARIOS, SERVER_CONFIG (configs/reflexd-small.toml),
#   SERVER_CPU (1), CLIENT_CPU (0), PORT (17070), BIN (target/release), WORK
#   (target/qos-real), MODES ("on off"; also "silent": QoS on, but the LC tenants' clients
#   send no REPORT of their latency, as before PROTOCOL.md §1.9 existed; "spent": QoS on, but
#   SERVER_CONFIG's calibration with withhold_spare = false, so best-effort tenants spend all
#   that LC tenants leave unused, as before QOS.md §11's spare share existed; "poll": QoS on,
#   reflexd `--poll`, its dataplane thread spins instead of sleeping. There is no spinning
#   client mode: a scenario runs one bench thread per tenant, all on CLIENT_CPU, and four
#   threads spinning on one CPU send in bursts of a time slice each), STEP_SLACK (20),
#   ISOLATE (on: every other task that
#   can leaves SERVER_CPU for the run, as an operator dedicates a core to a dataplane thread,
#   bench/lib/isolate.py; off: the CPU is shared as the scheduler likes).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

REPS=${REPS:-3}
SCENARIOS=${SCENARIOS:-"scenarios/fig5-small-scenario1.toml scenarios/fig5-small-scenario2.toml"}
SERVER_CONFIG=${SERVER_CONFIG:-configs/reflexd-small.toml}
SERVER_CPU=${SERVER_CPU:-1}
CLIENT_CPU=${CLIENT_CPU:-0}
PORT=${PORT:-17070}
BIN=${BIN:-target/release}
WORK=${WORK:-target/qos-real}
MODES=${MODES:-"on off"}
STEP_SLACK=${STEP_SLACK:-20}
isolate_option
mkdir -p "$WORK/raw"

server_pid=""
stop_server() {
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
        kill -INT "$server_pid"
        timeout 20 tail --pid="$server_pid" -f /dev/null || kill -KILL "$server_pid"
    fi
    server_pid=""
}
trap 'stop_server; isolate_restore; rm -f "$(dirname "$SERVER_CONFIG")/.spent-$(basename "$SERVER_CONFIG")"' EXIT
isolate_cpu "$SERVER_CPU"

spent_config() { # SERVER_CONFIG with withhold_spare = false, beside it (its relative paths hold)
    local spent
    spent="$(dirname "$SERVER_CONFIG")/.spent-$(basename "$SERVER_CONFIG")"
    grep -q '^\[qos_config.calibration\]' "$SERVER_CONFIG" \
        || { echo "spent: $SERVER_CONFIG has no [qos_config.calibration] table" >&2; exit 1; }
    sed '/^\[qos_config.calibration\]/a withhold_spare = false' "$SERVER_CONFIG" >"$spent"
    echo "$spent"
}

seconds_of() { # scenario file -> warm-up + duration in whole seconds
    awk -F'=' '/^warmup_ms/ {w=$2} /^duration_ms/ {d=$2} END {print int((w + d) / 1000) + 1}' "$1"
}

for rep in $(seq 1 "$REPS"); do
    for scenario in $SCENARIOS; do
        name=$(basename "$scenario" .toml)
        for mode in $MODES; do
            flags=()
            bench_flags=()
            [[ "$mode" == off ]] && flags+=(--no-qos)
            [[ "$mode" == silent ]] && bench_flags+=(--report-interval 0s)
            [[ "$mode" == poll ]] && flags+=(--poll)
            config="$SERVER_CONFIG"
            [[ "$mode" == spent ]] && config=$(spent_config)
            log="$WORK/raw/$name-$mode-$rep.log"
            taskset -c "$SERVER_CPU" "$BIN/reflexd" --config "$config" --port "$PORT" \
                "${flags[@]}" 2>"$log" &
            server_pid=$!
            for _ in $(seq 1 100); do
                grep -q "reflexd serving" "$log" && break
                sleep 0.1
            done
            grep -q "reflexd serving" "$log" || { echo "reflexd did not start: $log" >&2; exit 1; }
            echo "== $name QoS $mode, run $rep (load $(cut -d' ' -f1 /proc/loadavg))" >&2
            timeout $(( $(seconds_of "$scenario") + STEP_SLACK )) \
                taskset -c "$CLIENT_CPU" "$BIN/reflex" bench --server "127.0.0.1:$PORT" \
                --scenario "$scenario" --cpus "$CLIENT_CPU" --json -q "${bench_flags[@]}" \
                >"$WORK/raw/$name-$mode-$rep.json"
            stop_server
        done
    done
done

python3 - "$WORK/raw" $REPS $MODES -- $SCENARIOS <<'EOF'
import json, statistics, sys, os
raw, reps = sys.argv[1], int(sys.argv[2])
split = sys.argv.index("--")
modes, scenarios = sys.argv[3:split], sys.argv[split + 1:]
def human(x):
    return f"{x / 1e3:.1f}K" if x >= 1e3 else f"{x:.0f}"
for scenario in scenarios:
    name = os.path.basename(scenario)[:-5]
    for mode in modes:
        runs = []
        for rep in range(1, reps + 1):
            with open(f"{raw}/{name}-{mode}-{rep}.json") as f:
                runs.append(json.load(f))
        print(f"\n{name}, QoS {mode}, median of {reps} runs ({runs[0]['duration_sec']:.0f} s each)\n")
        print("| tenant | class | SLO | sent IOPS | IOPS | read p95 µs | read p99 µs | SLO met (runs) | notices |")
        print("|---|---|---|---:|---:|---:|---:|---|---:|")
        for i, t in enumerate(runs[0]["tenants"]):
            med = lambda f: statistics.median(f(r["tenants"][i]) for r in runs)
            slo = f"{human(t['iops_reserved'])} @ {t['latency_us_p95']} µs" if t["latency_us_p95"] else "-"
            sent = human(med(lambda x: x["sent_iops"])) if t["sent_iops"] is not None else f"qd {t['queue_depth']}"
            met = "-"
            if t["slo_met"] is not None:
                yes = sum(1 for r in runs if r["tenants"][i]["slo_met"])
                met = f"{'yes' if yes * 2 > reps else '**no**'} ({yes}/{reps})"
            print(f"| {t['name']} | {t['class'].upper()} | {slo} | {sent} | {human(med(lambda x: x['iops']))} "
                  f"| {med(lambda x: x['read']['p95_us']):.0f} | {med(lambda x: x['read']['p99_us']):.0f} "
                  f"| {met} | {med(lambda x: x['notices']):.0f} |")
        spread = [max(r["tenants"][i]["read"]["p95_us"] for r in runs) / max(1, min(r["tenants"][i]["read"]["p95_us"] for r in runs))
                  for i in range(len(runs[0]["tenants"]))]
        print(f"\n(p95 max/min over the runs per tenant: {', '.join(f'{s:.1f}x' for s in spread)})")
EOF
