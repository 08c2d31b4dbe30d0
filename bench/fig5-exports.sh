#!/usr/bin/env bash
# Figure 5 scenario 2 with a standard client (a benchmark, not a test): reflexd serves the small
# emulated device with the scenario's four tenants (configs/reflexd-fig5-exports.toml), one NBD
# export per tenant, and fio (nbd engine, one job per export) is the four tenants at once:
#   A  LC, p95 <= 500 us, 12K IOPS reserved, reads only, sends 12K IOPS (Poisson)
#   B  LC, p95 <= 500 us,  7K IOPS reserved at 80 % reads, sends only 4.5K (Poisson)
#   C  BE, 95 % reads, closed loop, 32 deep
#   D  BE, 25 % reads, closed loop, 32 deep
# fio's per-job figures and the server's own (admin API /v1/stats: read p95 and SLO attainment
# per tenant) are printed side by side as a markdown table (what docs/BENCHMARKS.md records).
# Every step is bounded in time. The TCP ports are PORT_BASE..PORT_BASE+2 (native, NBD, admin).
# Usage: bench/fig5-exports.sh    Environment: DURATION (10), RAMP (2), REPS (1), PORT_BASE
# (17170), SERVER_CPU (1), CLIENT_CPU (0), BIN (target/release), WORK (target/fig5-exports),
# QOS (on|off: off serves the same tenants first in, first out, for comparison).
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
RAMP=${RAMP:-2}
REPS=${REPS:-1}
PORT_BASE=${PORT_BASE:-17170}
SERVER_CPU=${SERVER_CPU:-1}
CLIENT_CPU=${CLIENT_CPU:-0}
BIN=${BIN:-target/release}
WORK=${WORK:-target/fig5-exports}
QOS=${QOS:-on}
mkdir -p "$WORK"
native_port=$PORT_BASE
nbd_port=$((PORT_BASE + 1))
admin_port=$((PORT_BASE + 2))

server_pid=""
stop_server() {
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
        kill -INT "$server_pid"
        timeout 20 tail --pid="$server_pid" -f /dev/null || kill -KILL "$server_pid"
    fi
    server_pid=""
}
trap stop_server EXIT

for rep in $(seq 1 "$REPS"); do
    flags=()
    [[ "$QOS" == off ]] && flags+=(--no-qos)
    log="$WORK/reflexd-$QOS-$rep.log"
    rm -f "$WORK/state.json"
    taskset -c "$SERVER_CPU" "$BIN/reflexd" --config configs/reflexd-fig5-exports.toml \
        --port "$native_port" --nbd-port "$nbd_port" --admin-listen "127.0.0.1:$admin_port" \
        --no-original --state-file "$WORK/state.json" "${flags[@]}" 2>"$log" &
    server_pid=$!
    for _ in $(seq 1 100); do
        grep -q "reflexd serving" "$log" && break
        sleep 0.1
    done
    grep -q "reflexd serving" "$log" || { echo "reflexd did not start: $log" >&2; exit 1; }
    job() { # name rw-options...
        local name=$1
        shift
        echo --name="$name" --ioengine=nbd --uri="nbd://127.0.0.1:$nbd_port/fig5-$name" \
            --bs=4k --size=1G --direct=1 --time_based --runtime="$DURATION" \
            --ramp_time="$RAMP" --percentile_list=50:95:99 "$@"
    }
    # shellcheck disable=SC2046
    timeout $((DURATION + RAMP + 60)) taskset -c "$CLIENT_CPU" fio \
        --output="$WORK/fio-$QOS-$rep.json" --output-format=json \
        $(job A --rw=randread --iodepth=32 --rate_iops=12000 --rate_process=poisson) \
        $(job B --rw=randrw --rwmixread=80 --iodepth=32 --rate_iops=3600,900 --rate_process=poisson) \
        $(job C --rw=randrw --rwmixread=95 --iodepth=32) \
        $(job D --rw=randrw --rwmixread=25 --iodepth=32)
    curl -sf "http://127.0.0.1:$admin_port/v1/stats" > "$WORK/stats-$QOS-$rep.json"
    curl -sf "http://127.0.0.1:$admin_port/metrics" > "$WORK/metrics-$QOS-$rep.txt"
    stop_server
    python3 - "$WORK/fio-$QOS-$rep.json" "$WORK/stats-$QOS-$rep.json" "$QOS" "$rep" <<'PY'
import json, sys
fio = json.load(open(sys.argv[1]))
stats = json.load(open(sys.argv[2]))
qos, rep = sys.argv[3], sys.argv[4]
server = {t["name"]: t for t in stats["tenants"]}
print(f"\n### QoS {qos}, run {rep}\n")
print("| tenant | class | SLO p95 | fio IOPS (read + write) | fio read p95 | fio read p99 | server read p95 | server SLO attainment |")
print("|---|---|---|---|---|---|---|---|")
for job in fio["jobs"]:
    name = job["jobname"]
    read, write = job["read"], job["write"]
    iops = read["iops"] + write["iops"]
    percentiles = read["clat_ns"].get("percentile", {})
    p95 = percentiles.get("95.000000", 0) / 1000
    p99 = percentiles.get("99.000000", 0) / 1000
    tenant = server.get(name, {})
    slo = tenant.get("slo_latency_us_p95")
    attainment = tenant.get("slo", {}).get("attainment")
    server_p95 = tenant.get("totals", {}).get("read_latency_us", {}).get("p95")
    print(f"| {name} | {tenant.get('class', '?')} | {slo or '-'} | {iops:.0f} ({read['iops']:.0f} + {write['iops']:.0f}) "
          f"| {p95:.0f} µs | {p99:.0f} µs | {server_p95} µs | "
          f"{'-' if attainment is None else f'{attainment * 100:.0f} %'} |")
PY
done
