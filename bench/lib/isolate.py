#!/usr/bin/env python3
"""Keeps other tasks off the server's CPU for a benchmark, as an operator dedicates a core to a
dataplane thread (ReFlex runs one thread per dedicated core), and puts them back afterwards.

    isolate.py isolate CPU STATE   every thread allowed on CPU and on another CPU loses CPU
                                   from its affinity; the old masks go to STATE (JSON)
    isolate.py restore STATE       gives every thread recorded in STATE its old mask back

Why: on this VM the guest agent (PID 1, niceness -10) and other daemons run in bursts of up to
4 ms on whichever CPU is free, and a burst on the server's CPU stalls a dataplane thread that
is waiting on a device deadline. Tasks bound to one CPU (per-CPU kernel threads such as
ksoftirqd) cannot move and stay, as on an isolated core. Tasks started later inherit the mask
of their parent, so the benchmark's own clients, started from this shell, keep off the CPU too;
the server is started with `taskset -c CPU`, which sets its mask outright.
"""

import json
import os
import sys


def threads():
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                yield int(tid)
        except OSError:
            continue  # the process exited


def isolate(cpu, state_path):
    moved = {}
    for tid in threads():
        try:
            mask = os.sched_getaffinity(tid)
        except OSError:
            continue
        if cpu not in mask or len(mask) < 2:
            continue
        try:
            os.sched_setaffinity(tid, mask - {cpu})
        except OSError:
            continue  # bound to its CPUs (a kernel thread), or not ours to move
        moved[tid] = sorted(mask)
    with open(state_path, "w") as state:
        json.dump({"cpu": cpu, "moved": moved}, state)
    print(f"isolate: {len(moved)} threads moved off CPU {cpu}", file=sys.stderr)


def restore(state_path):
    try:
        with open(state_path) as state:
            saved = json.load(state)
    except FileNotFoundError:
        return
    restored = 0
    for tid, mask in saved["moved"].items():
        try:
            os.sched_setaffinity(int(tid), set(mask))
            restored += 1
        except OSError:
            continue  # exited since
    os.unlink(state_path)
    print(f"isolate: {restored} threads may use CPU {saved['cpu']} again", file=sys.stderr)


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "isolate":
        isolate(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "restore":
        restore(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
