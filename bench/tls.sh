#!/usr/bin/env bash
# What TLS costs (issue 13): NBD with TLS on and off, side by side, against reflexd and nbdkit
# (its memory plugin, `--tls=on`), both serving 4 KiB random reads from memory to fio's nbd
# engine (libnbd, GnuTLS): `nbd://` for plaintext, `nbds://` for TLS 1.3.
#   qd1   QD1 latency (p50, p99) from fio
#   qd32  QD32 IOPS, and the server's CPU time over the run (utime + stime of /proc/PID/stat,
#         cpu_ticks in bench/lib/common.sh: nbdkit runs a thread per connection, and only the
#         process's own counters keep the time of threads that have exited) -> IOPS per
#         server core
# Both servers use one thread (reflexd --threads 1; nbdkit --threads 1), pinned to SERVER_CPU,
# fio to CLIENT_CPU. Certificates are made with openssl for the run. Medians of REPS runs.
# This kernel has no CONFIG_TLS, so kernel TLS offload is not available: every byte is
# encrypted and decrypted in user space (rustls in reflexd, GnuTLS in nbdkit).
#
#   bench/tls.sh                 # REPS=5, RUNTIME_S=5
#   REPS=1 RUNTIME_S=2 bench/tls.sh
# Writes docs/results/tls.md; raw fio JSON stays under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib/common.sh

REPS=${REPS:-5}
RUNTIME_S=${RUNTIME_S:-5}
SIZE=${SIZE:-256M}
SERVER_CPU=${SERVER_CPU:-1}
CLIENT_CPU=${CLIENT_CPU:-0}
OUT=${OUT:-target/tls/$(date +%Y%m%d-%H%M%S)}
RESULTS_MD=${RESULTS_MD:-docs/results/tls.md}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
REFLEXD=${REFLEXD:-$CARGO_TARGET_DIR/release/reflexd}

require fio nbdkit openssl taskset python3
[ -x "$REFLEXD" ] || cargo build --release -q -p reflex-server --bin reflexd
mkdir -p "$OUT"
trap stop_tracked EXIT

# Certificates: a CA, the server's (localhost), a client's.
PKI=$(realpath "$OUT")/pki
mkdir -p "$PKI/client"
(
    cd "$PKI"
    ossl() { openssl "$@" 2>/dev/null; }
    ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca-key.pem \
        -out ca-cert.pem -days 2 -subj "/CN=bench CA"
    ossl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout server-key.pem \
        -out server.csr -subj "/CN=localhost"
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >server.ext
    ossl x509 -req -in server.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial \
        -days 2 -out server-cert.pem -extfile server.ext
    ossl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout client/client-key.pem \
        -out client.csr -subj "/CN=bench"
    printf 'extendedKeyUsage=clientAuth\n' >client.ext
    ossl x509 -req -in client.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial \
        -days 2 -out client/client-cert.pem -extfile client.ext
    cp ca-cert.pem client/
)
# fio's nbd engine refuses URIs that name local files (tls-certificates=): libnbd's default
# certificate folder, $HOME/.pki/libnbd, holds the client's instead.
CLIENT_HOME=$(realpath "$OUT")/home
mkdir -p "$CLIENT_HOME/.pki"
ln -sfn "$PKI/client" "$CLIENT_HOME/.pki/libnbd"

# start_server NAME PORT: starts it pinned to SERVER_CPU; its PID in SERVER_PID.
start_server() {
    local name=$1 port=$2 pid
    case "$name" in
        reflexd)
            cat >"$OUT/reflexd.toml" <<EOF
port = 0
threads = 1
[nbd]
port = $port
[[namespace]]
id = 1
backend = "mem"
size_bytes = "$SIZE"
[tls]
certificate = "$PKI/server-cert.pem"
key = "$PKI/server-key.pem"
nbd = "optional"
EOF
            taskset -c "$SERVER_CPU" "$REFLEXD" -c "$OUT/reflexd.toml" --no-original \
                --no-nvme-tcp --no-admin >"$OUT/reflexd.log" 2>&1 &
            ;;
        nbdkit)
            taskset -c "$SERVER_CPU" nbdkit --foreground --threads 1 \
                --port "$port" --ip-addr 127.0.0.1 --tls=on --tls-certificates "$PKI" \
                memory "$SIZE" >"$OUT/nbdkit.log" 2>&1 &
            ;;
    esac
    pid=$!
    track "$pid"
    wait_port "$port" "$pid" || die "$name did not start (see $OUT/$name.log)"
    SERVER_PID=$pid
}

# uri NAME PORT TLS
uri() {
    local export=""
    [ "$1" = reflexd ] && export=ns1
    if [ "$3" = on ]; then
        echo "nbds://localhost:$2/$export"
    else
        echo "nbd://localhost:$2/$export"
    fi
}

# run_fio OUTPUT URI IODEPTH
run_fio() {
    HOME=$CLIENT_HOME timeout $((RUNTIME_S + 60)) taskset -c "$CLIENT_CPU" fio --name=randread \
        --ioengine=nbd --uri="$2" --rw=randread --bs=4k --iodepth="$3" \
        --time_based --runtime="${RUNTIME_S}s" --ramp_time=1s --size="$SIZE" \
        --output-format=json --output="$1" >/dev/null
}

for server in reflexd nbdkit; do
    port=$(free_port)
    start_server "$server" "$port"
    pid=$SERVER_PID
    # Fill once so reads return data (and nbdkit's memory plugin has allocated it).
    timeout 300 taskset -c "$CLIENT_CPU" fio --name=fill --ioengine=nbd \
        --uri="$(uri "$server" "$port" off)" --rw=write --bs=1M --iodepth=8 --size="$SIZE" \
        --output=/dev/null >/dev/null
    for ((rep = 1; rep <= REPS; rep++)); do
        for tls in off on; do
            note "$server tls=$tls rep $rep/$REPS"
            run_fio "$OUT/$server-$tls-qd1-$rep.json" "$(uri "$server" "$port" "$tls")" 1
            before=$(cpu_ticks "$pid")
            run_fio "$OUT/$server-$tls-qd32-$rep.json" "$(uri "$server" "$port" "$tls")" 32
            after=$(cpu_ticks "$pid")
            echo "$((after - before))" >"$OUT/$server-$tls-qd32-$rep.cpu_ticks"
        done
    done
    stop_pid "$pid"
done

python3 - "$OUT" "$REPS" "$RUNTIME_S" "$RESULTS_MD" "$(getconf CLK_TCK)" <<'PY'
import json, statistics, sys
out, reps, runtime, results = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ticks_per_s = int(sys.argv[5])
def fio(path):
    read = json.load(open(path))["jobs"][0]["read"]
    pct = read["clat_ns"]["percentile"]
    return read["iops"], pct["50.000000"] / 1000, pct["99.000000"] / 1000
rows = {}
for server in ("reflexd", "nbdkit"):
    for tls in ("off", "on"):
        p50, p99, iops, per_core = [], [], [], []
        for rep in range(1, reps + 1):
            base = f"{out}/{server}-{tls}"
            _, a, b = fio(f"{base}-qd1-{rep}.json")
            p50.append(a); p99.append(b)
            i, _, _ = fio(f"{base}-qd32-{rep}.json")
            cpu_s = int(open(f"{base}-qd32-{rep}.cpu_ticks").read()) / ticks_per_s
            iops.append(i)
            # fio's IOPS exclude the 1 s ramp; the CPU time covers it: scale to the same span.
            per_core.append(i * (runtime + 1) / cpu_s if cpu_s > 0 else 0)
        rows[(server, tls)] = [statistics.median(v) for v in (p50, p99, iops, per_core)]
lines = [
    "# TLS cost: NBD with TLS off and on, reflexd and nbdkit",
    "",
    f"`bench/tls.sh`: fio's nbd engine (libnbd, GnuTLS) reading 4 KiB at random from memory, "
    f"one connection, {runtime} s per run, medians of {reps} runs; `nbd://` against "
    "`nbds://` (TLS 1.3, a P-256 server certificate, the client presents one) on the same "
    "server. IOPS per server core: fio's QD32 IOPS over the server's CPU time in that run "
    "(utime + stime, clock ticks). The kernel has no TLS offload (no CONFIG_TLS): both servers encrypt in "
    "user space.",
    "",
    "| server | TLS | QD1 p50 µs | QD1 p99 µs | QD32 IOPS | IOPS per server core |",
    "|---|---|---:|---:|---:|---:|",
]
for (server, tls), (p50, p99, iops, per_core) in rows.items():
    lines.append(f"| {server} | {tls} | {p50:.1f} | {p99:.1f} | {iops:,.0f} | {per_core:,.0f} |")
lines.append("")
for server in ("reflexd", "nbdkit"):
    off, on = rows[(server, "off")], rows[(server, "on")]
    lines.append(
        f"- {server}: TLS adds {on[0] - off[0]:+.1f} µs at QD1 (p50); IOPS per server core "
        f"with TLS = {on[3] / off[3]:.2f}× without."
    )
open(results, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
