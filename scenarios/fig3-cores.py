#!/usr/bin/env python3
"""OctoFAS Figure 3 (and the Figure 9 modes) on 8 simulated cores (issue 14): the simulator
with its CPU model (`[cpu]` in a scenario: 8 µs of a dataplane thread per answered request,
2 µs per device completion), so that the cores, not the device, are what the flows share. A
sparse flow of 2 closed-loop requests against a dense flow of k = 2..14, both best-effort,
100 % reads, each flow with one connection per thread (its requests go round them, as
OctoKV's clients keep one TCP connection per server core), a 20 µs fixed-latency device with
room for every request. RT_alone of each flow from its run alone; S = IOPS alone / IOPS
shared (closed loop), F = min S / max S. Virtual time: exact and repeatable.

Usage (from the repository root, release binaries built):
    scenarios/fig3-cores.py
Environment: DENSE ("2 4 6 8 10 14"), MODES_AT (dense k for the Figure 9 modes, "14"; ""
for none), THREADS (8), ANSWER_NS (8000), COMPLETION_NS (2000), DURATION_MS (1000),
SIM (target/release/reflex-sim)
"""
import json
import os
import subprocess
import tempfile

SIM = os.environ.get("SIM", "target/release/reflex-sim")
DENSE = [int(x) for x in os.environ.get("DENSE", "2 4 6 8 10 14").split()]
MODES_AT = [int(x) for x in os.environ.get("MODES_AT", "14").split()]
THREADS = int(os.environ.get("THREADS", "8"))
ANSWER_NS = int(os.environ.get("ANSWER_NS", "8000"))
COMPLETION_NS = int(os.environ.get("COMPLETION_NS", "2000"))
DURATION_MS = int(os.environ.get("DURATION_MS", "1000"))

MONITOR = "[qos_config.fairness.monitor]\nwindow_us = 10000\n"
MIGRATION = "[qos_config.fairness.migration]\nenabled = true\nrequires_imbalance = false\n"
# name -> [qos_config.fairness] text (None: no stage), as scenarios/fig9.py names them.
MODES = {
    "baseline (no stage)": None,
    "stage fifo, depth 4": 'mode = "fifo"\nbe_device_depth_max = 4\n' + MONITOR,
    "intra, B = 20, depth 4": 'mode = "backwarding"\nbackwardings = 20\nbe_device_depth_max = 4\n' + MONITOR,
    "fair_share, depth 4": 'mode = "fair_share"\nbe_device_depth_max = 4\n' + MONITOR,
    "inter, depth 4": 'mode = "fifo"\nbe_device_depth_max = 4\n' + MONITOR + MIGRATION,
    "hybrid, B = 20, depth 4": 'mode = "backwarding"\nbackwardings = 20\nbe_device_depth_max = 4\n' + MONITOR + MIGRATION,
}


def run(flows, fairness=None):
    threads = list(range(THREADS))
    text = f'''name = "fig3-cores"
seed = 1
threads = {THREADS}
qos = false
warmup_ms = 200
duration_ms = {DURATION_MS}
[device]
fixed = {{ servers = 64, read_us = 20, write_us = 20 }}
profile = "{os.path.abspath("profiles/device-a-small.toml")}"
[cpu]
per_answer_ns = {ANSWER_NS}
per_device_completion_ns = {COMPLETION_NS}
'''
    if fairness is not None:
        text += "[qos_config.fairness]\n" + fairness
    for name, depth in flows:
        text += f'''
[[tenant]]
name = "{name}"
class = "be"
read_percent = 100
threads = {threads}
load = {{ closed_depth = {depth} }}
'''
    with tempfile.NamedTemporaryFile("w", suffix=".toml", dir="scenarios", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        out = subprocess.run([SIM, "--json", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    tenants = json.loads(out)["points"][0][1]["tenants"]
    return {t["name"]: t["iops"] for t in tenants}


def main():
    alone_sparse = run([("sparse", 2)])["sparse"]
    alone_dense = {k: run([("dense", k)])["dense"] for k in sorted(set(DENSE + MODES_AT))}
    print(f"\n### Figure 3 on {THREADS} simulated cores (sparse alone: {alone_sparse:.0f} IOPS)\n")
    print("| dense k | dense alone IOPS | S sparse | S dense | F | sparse IOPS | dense IOPS | total IOPS |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in DENSE:
        shared = run([("sparse", 2), ("dense", k)])
        s1, s2 = alone_sparse / shared["sparse"], alone_dense[k] / shared["dense"]
        print(f"| {k} | {alone_dense[k]:.0f} | {s1:.2f} | {s2:.2f} | {min(s1, s2) / max(s1, s2):.2f} | "
              f"{shared['sparse']:.0f} | {shared['dense']:.0f} | {shared['sparse'] + shared['dense']:.0f} |",
              flush=True)
    for k in MODES_AT:
        print(f"\n### The Figure 9 modes at k = {k}\n")
        print("| mode | S sparse | S dense | F | total IOPS | total / baseline |")
        print("|---|---:|---:|---:|---:|---:|")
        base = None
        for name, fairness in MODES.items():
            shared = run([("sparse", 2), ("dense", k)], fairness)
            s1, s2 = alone_sparse / shared["sparse"], alone_dense[k] / shared["dense"]
            total = shared["sparse"] + shared["dense"]
            base = base or total
            print(f"| {name} | {s1:.2f} | {s2:.2f} | {min(s1, s2) / max(s1, s2):.2f} | {total:.0f} | "
                  f"{total / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
