#!/usr/bin/env python3
"""OctoFAS Figures 3 and 9 shapes over the key-value front end on the real server (issue 14):
a sparse flow (2 client threads) against a dense one (DENSE threads), both db_bench
`readrandom` through `reflex bench --kv` (4-byte keys, 16 KiB values, one request in flight
per thread, as the paper's db_bench), against a reflexd with two dataplane threads serving
the KV port of a table on the emulated device (emu:device-a-small, real time).

Per mode, on a fresh server each run (the modes' runs alternate, so the shared machine's
drifting load favours none): fill the table (fillrandom), run each flow alone (its mean
response time is RT_alone), then both at once; slowdown S = RT_shared / RT_alone per flow,
fairness F = min S / max S, per-flow and total operations per second.
Modes (QoS off, as scenarios/fig9-server.py):
  baseline  no fairness stage (ReFlex's behaviour)
  stage     the stage in fifo (be_device_depth_max DEPTH per thread), no migration: what the
            stage alone costs, for the two below
  inter     that stage with inter-core migration of every flow's reads, KV bucket and value
            reads included (docs/FAIRNESS.md)
  intra     the stage in backwarding (B = BACKWARDINGS, be_device_depth_max DEPTH), no
            migration: OctoFAS's intra-core scheduling alone (Figure 8 sweeps B)
  hybrid    the stage in backwarding (B = BACKWARDINGS, be_device_depth_max DEPTH) with that
            migration
  fair_share  the stage in fair_share (be_device_depth_max DEPTH), no migration: the mode that
            made the block flows fair (docs/FAIRNESS.md)
  MODE+spread  any of these with `[scaling] spread_tenants = true`: each flow's connections
            are spread over the two threads after their BIND instead of left where the
            kernel's SO_REUSEPORT hash put them (docs/FAIRNESS.md, "Spreading each flow")
The two flows are two best-effort tenants, `sparse` and `dense`, created through the admin
API on each fresh server; every connection of a flow BINDs to its tenant first
(`reflex bench --kv --kv-tenant`, docs/KV.md §1.3), so the stage and the migrator see two
flows.

Each figure is the median of RUNS runs. Each readrandom phase (alone and shared) lasts
WINDOW, so both flows of the shared phase are measured over the same window; every bench is
also bounded by a 60 s timeout.

Usage (from the repository root, after
`cargo build --release -p reflex-server -p reflex-cli`):
    scenarios/kv-fig9-server.py              # a markdown table to stdout, progress to stderr
Environment: RUNS (2), DENSE (8), WINDOW (1s; "" for OPS operations per thread instead),
OPS (1000), KEYS (2000), DEPTH (8: the stage's
be_device_depth_max per thread in every mode with a stage), SETTLE_S (2: the wait after the
fill, before the first measured run), BACKWARDINGS (2: B in intra and hybrid),
MODES ("baseline stage fair_share inter hybrid"),
REFLEXD, REFLEX (target/release/...)
"""
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REFLEXD = os.environ.get("REFLEXD", "target/release/reflexd")
REFLEX = os.environ.get("REFLEX", "target/release/reflex")
RUNS = int(os.environ.get("RUNS", "2"))
DENSE = int(os.environ.get("DENSE", "8"))
OPS = int(os.environ.get("OPS", "1000"))
KEYS = int(os.environ.get("KEYS", "2000"))
DEPTH = int(os.environ.get("DEPTH", "8"))
SETTLE_S = float(os.environ.get("SETTLE_S", "2"))
BACKWARDINGS = int(os.environ.get("BACKWARDINGS", "2"))
MODES = os.environ.get("MODES", "baseline stage fair_share inter hybrid").split()
# Each readrandom phase lasts WINDOW (reflex bench --kv-duration, no operation bound), so
# the two flows of the shared phase are measured over the same window; WINDOW="" runs OPS
# operations per thread instead, where the flow that finishes first leaves the other alone
# for the rest of its run (before 2026-11-30 16:00 UTC, every result that gives OPS).
WINDOW = os.environ.get("WINDOW", "1s")
READ_OPS = 10**9 if WINDOW else OPS
SPARSE = 2
BENCH_TIMEOUT_S = 60
PROFILE = os.path.abspath("profiles/device-a-small.toml")

MIGRATION = {"enabled": True, "flows": "all", "requires_imbalance": False}


def fairness_table(mode):
    """The [qos_config.fairness] keys of a mode (None: no stage)."""
    mode = mode.split("+")[0]
    if mode == "baseline":
        return None
    if mode in ("stage", "inter"):
        return {"mode": "fifo", "be_device_depth_max": DEPTH}
    if mode == "fair_share":
        return {"mode": "fair_share", "be_device_depth_max": DEPTH}
    if mode in ("intra", "hybrid"):
        return {"mode": "backwarding", "backwardings": BACKWARDINGS,
                "be_device_depth_max": DEPTH}
    raise SystemExit(f"unknown mode {mode}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A reflexd with two threads and the KV port on a free loopback port; stopped by its pid
    (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, mode):
        self.kv_port = free_port()
        self.admin_port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kv-fig9-server-")
        text = f'''listen = "127.0.0.1"
port = {free_port()}
original_ports = []
threads = 2
qos = false
[nbd]
enabled = false
[nvme_tcp]
enabled = false
[admin]
listen = "127.0.0.1:{self.admin_port}"
[kv]
enabled = true
port = {self.kv_port}
namespace = 1
[[namespace]]
id = 1
backend = "emu:device-a-small"
size_bytes = "1G"
profile = "{PROFILE}"
'''
        if mode.endswith("+spread"):
            text += "[scaling]\nspread_tenants = true\n"
        fairness = fairness_table(mode)
        if fairness is not None:
            text += "[qos_config.fairness]\n"
            for key, value in fairness.items():
                text += f"{key} = {json.dumps(value)}\n"
            if mode.split("+")[0] in ("inter", "hybrid"):
                text += "[qos_config.fairness.migration]\n"
                for key, value in MIGRATION.items():
                    text += f"{key} = {json.dumps(value)}\n"
        self.config = os.path.join(self.dir, "reflexd.toml")
        with open(self.config, "w") as f:
            f.write(text)
        self.log = open(os.path.join(self.dir, "reflexd.log"), "w")

    def __enter__(self):
        self.process = subprocess.Popen([REFLEXD, "--config", self.config], stdout=self.log,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"reflexd exited: {open(self.log.name).read()}")
            try:
                socket.create_connection(("127.0.0.1", self.kv_port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise SystemExit("reflexd did not start listening within 10 s")

    def __exit__(self, exc_type, *exc):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        if exc_type is None:
            shutil.rmtree(self.dir)  # Kept after a failure, for its log.


def create_tenant(server, name):
    """A best-effort tenant on namespace 1 through the admin API; its handle (hex)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.admin_port}/v1/namespaces/1/tenants",
        data=json.dumps({"name": name, "class": "be"}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)["tenant"]["handle"]


def wait_placement(server, connections):
    """Each flow's connections per dataplane thread once all of them are open (GET
    /v1/tenants), as "sparse 1+1 dense 4+4"; "?" if they did not all show within 5 s."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.admin_port}/v1/tenants",
                                    timeout=10) as answer:
            tenants = {t["name"]: t["connections_per_thread"] for t in json.load(answer)}
        if all(sum(tenants.get(name, [])) == count for name, count in connections.items()):
            return " ".join(f"{name} " + "+".join(str(n) for n in tenants[name])
                            for name in connections)
        time.sleep(0.01)
    return "?"


def bench_command(server, workload, threads, ops, tenant=None, window=None):
    """A `reflex bench --kv` command: `ops` per thread, or as many as fit in `window`."""
    command = [REFLEX, "bench", "--kv", f"127.0.0.1:{server.kv_port}", "--kv-workload",
               workload, "--threads", str(threads), "--qd", "1", "--kv-ops", str(ops),
               "--kv-keys", str(KEYS), "--key-size", "4", "--value-size", "16k", "--json"]
    if window:
        command += ["--kv-duration", window]
    if tenant is not None:
        command += ["--kv-tenant", tenant]
    return command


def rows_of(process):
    out, err = process.communicate(timeout=BENCH_TIMEOUT_S)
    if process.returncode != 0:
        raise SystemExit(f"reflex bench failed: {err}")
    return json.loads(out)[0]


def run_once(mode):
    """One run of a mode on a fresh server: RT_alone of each flow, then both at once."""
    with Server(mode) as server:
        fill = subprocess.Popen(bench_command(server, "fillrandom", 4, KEYS // 4),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        rows_of(fill)
        # The emulated device is still programming the fill's writes for a while after it
        # answered them; reads measured then are slower (a sparse flow's RT_alone measured
        # right after the fill came out above its shared RT, S < 1).
        time.sleep(SETTLE_S)
        tenants = {name: create_tenant(server, name) for name in ("sparse", "dense")}
        alone = {}
        for name, threads in (("sparse", SPARSE), ("dense", DENSE)):
            process = subprocess.Popen(bench_command(server, "readrandom", threads,
                                                     READ_OPS, tenants[name], WINDOW),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
            alone[name] = rows_of(process)["latency"]["avg_us"]
        processes = {
            name: subprocess.Popen(bench_command(server, "readrandom", threads, READ_OPS,
                                                 tenants[name], WINDOW),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, threads in (("sparse", SPARSE), ("dense", DENSE))
        }
        # Where the kernel put each flow's connections (SO_REUSEPORT), read while they are
        # open: the stage orders only the flows that meet on one thread.
        placement = wait_placement(server, {"sparse": SPARSE, "dense": DENSE})
        shared = {name: rows_of(process) for name, process in processes.items()}
    slowdown = {name: shared[name]["latency"]["avg_us"] / alone[name] for name in alone}
    return {
        "F": min(slowdown.values()) / max(slowdown.values()),
        "sparse_ops": shared["sparse"]["ops_per_sec"],
        "dense_ops": shared["dense"]["ops_per_sec"],
        "total_ops": shared["sparse"]["ops_per_sec"] + shared["dense"]["ops_per_sec"],
        "sparse_S": slowdown["sparse"],
        "dense_S": slowdown["dense"],
        "sparse_alone_us": alone["sparse"],
        "sparse_shared_us": shared["sparse"]["latency"]["avg_us"],
        "dense_alone_us": alone["dense"],
        "dense_shared_us": shared["dense"]["latency"]["avg_us"],
        "placement": placement,
    }


def main():
    results = {mode: [] for mode in MODES}
    for run in range(RUNS):
        for mode in MODES:
            figures = run_once(mode)
            print(f"run {run + 1} {mode}: " + ", ".join(
                f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                for key, value in figures.items()), file=sys.stderr)
            results[mode].append(figures)
    keys = ["F", "sparse_S", "dense_S", "sparse_ops", "dense_ops", "total_ops"]
    print(f"| mode | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for mode in MODES:
        cells = [statistics.median(run[key] for run in results[mode]) for key in keys]
        print(f"| {mode} | " + " | ".join(
            f"{value:.3f}" if key in ("F", "sparse_S", "dense_S") else f"{value:,.0f}"
            for key, value in zip(keys, cells)) + " |")
    shape = f"{WINDOW} of readrandom per phase" if WINDOW else \
        f"{OPS} readrandom operations per thread"
    print(f"\n{SPARSE} vs {DENSE} client threads, {shape}, {KEYS} keys, "
          f"medians of {RUNS} runs.")
    print("\nEvery run, with each flow's connections per dataplane thread:\n")
    for mode in MODES:
        for number, run in enumerate(results[mode], 1):
            print(f"- {mode}, run {number}: F {run['F']:.3f}, total {run['total_ops']:,.0f} "
                  f"ops/s, mean RT alone / shared µs: sparse {run['sparse_alone_us']:.0f} / "
                  f"{run['sparse_shared_us']:.0f}, dense {run['dense_alone_us']:.0f} / "
                  f"{run['dense_shared_us']:.0f}; {run['placement']}")


if __name__ == "__main__":
    main()
