#!/usr/bin/env python3
"""OctoFAS intra-core scheduling (Figures 8 and 9) in the simulator (issue 14): the Figure 3
load (a sparse flow of 2 closed-loop requests against a dense flow of k = 2..14, both
best-effort, one dataplane thread, the small emulated device) under

  fifo        QoS off, no fairness stage (the baseline)
  qos         QoS on (BE token round robin), no stage
  stage-fifo  QoS off, the stage capping best-effort device depth, arrival order
  b=N         QoS off, the stage with OctoFAS backwarding, B fixed at N (Algorithm 3)
  b=monitor   QoS off, backwarding with B from the dataplane's monitor (eq. 5)
  b=monitor-cal  the same after a calibration phase: the sparse flow alone for the first second
              of a 2 s warm-up (the monitor learns its RT_alone), then the dense flow joins
  fewest      QoS off, the stage, fewest requests at the device first
  fair-share  QoS off, the stage, fewest first and each flow capped at its share of the depth

RT_alone of each flow comes from a run of the flow alone on the baseline (no stage, QoS off):
slowdowns are against having the device to oneself. S = RT / RT_alone with RT = depth / IOPS
(closed loop), F = min S / max S. Virtual time: exact and repeatable.

Usage (from the repository root, release binaries built):
    scenarios/fig9.py                  # every table to stdout
Environment: READ_PERCENTS ("100 0"), DURATION_MS (3000), DEPTH (be_device_depth_max, 6;
fair-share uses FAIR_SHARE_DEPTH, 8: with 2 flows that is the same device depth of 6),
MODES (all), DENSE ("2 4 6 8 10 14"), SWEEP_DEPTHS (depth sweep at k = 8; "" for none),
SIM (target/release/reflex-sim)
"""
import json
import os
import subprocess
import sys
import tempfile

SIM = os.environ.get("SIM", "target/release/reflex-sim")
DURATION_MS = int(os.environ.get("DURATION_MS", "3000"))
READ_PERCENTS = [int(x) for x in os.environ.get("READ_PERCENTS", "100 0").split()]
DEPTH = int(os.environ.get("DEPTH", "6"))
FAIR_SHARE_DEPTH = int(os.environ.get("FAIR_SHARE_DEPTH", "8"))
DENSE = [int(x) for x in os.environ.get("DENSE", "2 4 6 8 10 14").split()]
SWEEP_DEPTHS = [int(x) for x in os.environ.get("SWEEP_DEPTHS", "3 4 5 6 7 8 10 12").split()]

# name -> (qos, fairness table or None)
ALL_MODES = {
    "fifo": (False, None),
    "qos": (True, None),
    "stage-fifo": (False, {"mode": "fifo"}),
    "b=0": (False, {"mode": "backwarding", "backwardings": 0}),
    "b=2": (False, {"mode": "backwarding", "backwardings": 2}),
    "b=5": (False, {"mode": "backwarding", "backwardings": 5}),
    "b=10": (False, {"mode": "backwarding", "backwardings": 10}),
    "b=20": (False, {"mode": "backwarding", "backwardings": 20}),
    "b=monitor": (False, {"mode": "backwarding"}),
    "b=monitor-cal": (False, {"mode": "backwarding", "_calibration_phase": True}),
    "fewest": (False, {"mode": "fewest_in_flight"}),
    "fair-share": (False, {"mode": "fair_share"}),
}
MODES = os.environ.get("MODES", " ".join(ALL_MODES)).split()


def run(flows, qos, fairness, read_percent, depth=DEPTH):
    fairness = dict(fairness) if fairness is not None else None
    calibration_phase = fairness is not None and fairness.pop("_calibration_phase", False)
    text = f'''name = "fig9"
seed = 1
threads = 1
qos = {"true" if qos else "false"}
warmup_ms = {2000 if calibration_phase else 500}
duration_ms = {DURATION_MS}
[device]
emulated = "device-a-small"
profile = "{os.path.abspath("profiles/device-a-small.toml")}"
'''
    if fairness is not None:
        text += "[qos_config.fairness]\n"
        text += f"be_device_depth_max = {depth}\n"
        for key, value in fairness.items():
            text += f'{key} = {json.dumps(value)}\n'
    for name, flow_depth in flows:
        text += f'''
[[tenant]]
name = "{name}"
class = "be"
read_percent = {read_percent}
load = {{ closed_depth = {flow_depth} }}
'''
        if calibration_phase and name != "sparse":
            text += "start_ms = 1000\n"
    with tempfile.NamedTemporaryFile("w", suffix=".toml", dir="scenarios", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        out = subprocess.run([SIM, "--json", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    tenants = json.loads(out)["points"][0][1]["tenants"]
    return {t["name"]: t["iops"] for t in tenants}


def row(k, shared, alone_sparse, alone_dense):
    s1 = alone_sparse / shared["sparse"]
    s2 = alone_dense / shared["dense"]
    f = min(s1, s2) / max(s1, s2)
    total = shared["sparse"] + shared["dense"]
    return s1, s2, f, total


HEADER = ("| dense k | S sparse | S dense | F | sparse IOPS | dense IOPS | total IOPS | total / FIFO |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|")


def main():
    for read_percent in READ_PERCENTS:
        alone_sparse = run([("sparse", 2)], False, None, read_percent)["sparse"]
        alone_dense = {k: run([("dense", k)], False, None, read_percent)["dense"] for k in DENSE}
        fifo_total = {}
        for name in ["fifo"] + [m for m in MODES if m != "fifo"]:
            if name not in MODES and name != "fifo":
                continue
            qos, fairness = ALL_MODES[name]
            depth = FAIR_SHARE_DEPTH if name == "fair-share" else DEPTH
            stage = "" if fairness is None else f", be_device_depth_max {depth}"
            print(f"\n### {read_percent} % reads, {name}{stage}\n")
            print(HEADER)
            for k in DENSE:
                shared = run([("sparse", 2), ("dense", k)], qos, fairness, read_percent, depth)
                s1, s2, f, total = row(k, shared, alone_sparse, alone_dense[k])
                if name == "fifo":
                    fifo_total[k] = total
                print(f"| {k} | {s1:.2f} | {s2:.2f} | {f:.2f} | {shared['sparse']:.0f} | "
                      f"{shared['dense']:.0f} | {total:.0f} | {total / fifo_total[k]:.3f} |")
            sys.stdout.flush()
        if SWEEP_DEPTHS and 8 in alone_dense:
            for name in ("fewest", "fair-share", "b=20"):
                if name not in MODES:
                    continue
                qos, fairness = ALL_MODES[name]
                print(f"\n### {read_percent} % reads, k = 8, {name}: be_device_depth_max sweep\n")
                print("| depth | S sparse | S dense | F | total IOPS | total / FIFO |")
                print("|---:|---:|---:|---:|---:|---:|")
                for depth in SWEEP_DEPTHS:
                    shared = run([("sparse", 2), ("dense", 8)], qos, fairness, read_percent, depth)
                    s1, s2, f, total = row(8, shared, alone_sparse, alone_dense[8])
                    print(f"| {depth} | {s1:.2f} | {s2:.2f} | {f:.2f} | {total:.0f} | "
                          f"{total / fifo_total[8]:.3f} |")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
