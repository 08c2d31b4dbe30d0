#!/usr/bin/env python3
"""OctoFAS Figure 3 in the simulator (issue 14): a sparse flow (2 closed-loop requests in
flight, as 2 client threads at queue depth 1) against a dense flow of k = 2..14, both
best-effort tenants on the small emulated device, with ReFlex's QoS scheduler on and off
(FIFO). Per flow: RT = depth / IOPS (Little's law, closed loop), RT_alone from a run of the
flow alone (a calibration phase), slowdown S = RT / RT_alone, fairness F = min S / max S
(OctoFAS eqs. 1-2). Virtual time: exact and repeatable.

Usage (from the repository root, release binaries built):
    scenarios/fig3.py                 # writes the tables to stdout
Environment: READ_PERCENTS ("0 100"), DURATION_MS (3000), SIM (target/release/reflex-sim)
"""
import os
import sys

import fig9  # its runner (same directory; it reads SIM and DURATION_MS)

READ_PERCENTS = [int(x) for x in os.environ.get("READ_PERCENTS", "0 100").split()]
DENSE = [2, 4, 6, 8, 10, 14]


def run(flows, qos, read_percent):
    """Per-flow IOPS of one simulator run (the Figure 9 script's runner, without the stage)."""
    return fig9.run(flows, qos, None, read_percent)


def main():
    for read_percent in READ_PERCENTS:
        for qos in (True, False):
            print(f"\n### {read_percent} % reads, QoS {'on (BE token round robin)' if qos else 'off (FIFO)'}\n")
            print("| dense k | S sparse | S dense | F | sparse throughput (of alone) | total IOPS |")
            print("|---:|---:|---:|---:|---:|---:|")
            alone_sparse = run([("sparse", 2)], qos, read_percent)["sparse"]
            for k in DENSE:
                alone_dense = run([("dense", k)], qos, read_percent)["dense"]
                shared = run([("sparse", 2), ("dense", k)], qos, read_percent)
                s1 = (2 / shared["sparse"]) / (2 / alone_sparse)
                s2 = (k / shared["dense"]) / (k / alone_dense)
                f = min(s1, s2) / max(s1, s2)
                total = shared["sparse"] + shared["dense"]
                print(f"| {k} | {s1:.2f} | {s2:.2f} | {f:.2f} | {shared['sparse'] / alone_sparse:.2f} | {total:.0f} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
