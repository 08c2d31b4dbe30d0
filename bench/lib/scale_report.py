"""Writes docs/results/scale.md from bench/scale.sh's runs (runs.jsonl, the bench JSON files).

Usage: python3 bench/lib/scale_report.py RUNS.jsonl... OUT.md (environment from bench/scale.sh).
Every figure is the median over the repetitions with its range; differences between modes are
taken within each repetition first (the modes of one repetition run minutes apart, the
repetitions further apart), then their median and range.
"""
import json
import os
import re
import statistics
import sys

# RUNS.jsonl... OUT.md: several runs files are merged (a part rerun on its own).
runs_paths, out = sys.argv[1:-1], sys.argv[-1]
env = os.environ
runs = [json.loads(line) for path in runs_paths for line in open(path) if line.strip()]


def row(path):
    return json.load(open(path))["rows"][0]


def med(values):
    return statistics.median(values)


def span(values, fmt):
    values = sorted(values)
    return f"{fmt(values[0])}–{fmt(values[-1])}"


def cell(values, fmt, bold=False):
    m = fmt(med(values))
    m = f"**{m}**" if bold else m
    return f"{m} ({span(values, fmt)})" if len(values) > 1 else m


def k(x):
    return f"{x / 1e3:.1f}K"


def us(x):
    return f"{x:.0f}"


def ns(x):
    return f"{x:.0f}"


def mib(x):
    return f"{x / 1024:.1f}"


lines = []
add = lines.append
add("# Scale per core (issue 10): 10,000 connections and 10,000 tenants on one dataplane thread")
add("")
add(f"- date: {env['RUN_DATE']}")
add(f"- machine: {env['MACHINE']}")
add(f"- commit: {env['COMMIT']}{env['DIRTY']}")
add(f"- command: `{env['COMMAND']}`")
add(f"- reflexd `--threads 1` pinned to CPU {env['SERVER_CPU']}; every client (`reflex bench`, "
    f"`reflex flood`) pinned to CPU {env['CLIENT_CPU']}; niceness {env['NICE']}; loopback TCP; "
    f"load average before {env['LOAD_BEFORE']}, after {env['LOAD_AFTER']}.")
add(f"- active load: {env['ACTIVE']} connections ({env['ACTIVE_THREADS']} bench threads × "
    f"{env['ACTIVE_PER_THREAD']}), closed loop at QD {env['QD']} each, 4 KiB random reads over a "
    f"`mem:256M` namespace with the QoS profile `profiles/mem-unlimited.toml` (rates no "
    f"core reaches: the scheduler charges every request but never holds one back); "
    f"{env['WARMUP']} warm-up, {env['DURATION']} measured.")
add("- server CPU per request: `reflex bench --server-pid` reads `/proc/PID/task/*/schedstat` "
    "(exact run time of all the server's threads) when the measurement starts and when it ends; "
    "÷ requests measured. \"others\": share of the server's CPU that other processes kept busy "
    "around the run (/proc/stat minus the server; the machine is shared with other builds).")
add(f"- scheduler autogroup: `{env.get('AUTOGROUP', 'none')}`. This kernel groups tasks by session "
    "(`kernel.sched_autogroup_enabled = 1`) and shares the CPU between sessions before niceness "
    "counts: the script gives its own session the niceness of its processes, or `nice -n -20` "
    "would not shield them from other sessions' builds.")
add("- cells: median over the repetitions (range in brackets).")
add("")

# --- connections ---
conn = [r for r in runs if r.get("part") == "connections"]
if conn:
    idle = int(env["IDLE"])
    add(f"## 10,000 connections: {idle} idle beside {env['ACTIVE']} active")
    add("")
    add("| state | IOPS | p50 µs | p99 µs | server CPU per request ns | server cores | others on server CPU |")
    add("|---|---:|---:|---:|---:|---:|---:|")
    for label, key, others in (
        (f"{env['ACTIVE']} active only", "active_json", "others_active"),
        (f"{env['ACTIVE']} active + {idle} idle (all open)", "idle_json", "others_idle"),
    ):
        rows = [row(r[key]) for r in conn]
        add(f"| {label} | {cell([x['iops'] for x in rows], k, True)} | "
            f"{cell([x['read']['p50_us'] for x in rows], us)} | "
            f"{cell([x['read']['p99_us'] for x in rows], us)} | "
            f"{cell([x['server_cpu_per_op_ns'] for x in rows], ns, True)} | "
            f"{cell([x['server_cores'] for x in rows], lambda v: f'{v:.2f}')} | "
            f"{cell([r[others] * 100 for r in conn], lambda v: f'{v:.0f} %')} |")
    add("")
    floods = [json.load(open(r["flood_json"])) for r in conn if os.path.exists(r["flood_json"])]
    add("Memory of the server (VmRSS) and of the kernel:")
    add("")
    add("| | MiB or bytes |")
    add("|---|---:|")
    add(f"| RSS just after start (10,240 connection slots) | {cell([r['rss_empty_kb'] for r in conn], mib)} MiB |")
    add(f"| RSS after the active-only run (arena and data pages touched) | {cell([r['rss_before_kb'] for r in conn], mib)} MiB |")
    add(f"| RSS once {idle} idle connections completed their HELLO (not parked yet) | {cell([r['rss_unparked_kb'] for r in conn], mib)} MiB |")
    add(f"| RSS {env['PARK_WAIT_S']} s later (parked) | {cell([r['rss_idle_kb'] for r in conn], mib)} MiB |")
    add(f"| RSS during the load with all {idle + int(env['ACTIVE'])} open | {cell([r['rss_loaded_kb'] for r in conn], mib)} MiB |")
    per_idle = [(r["rss_idle_kb"] - r["rss_before_kb"]) * 1024 / idle for r in conn]
    add(f"| server RSS per idle connection, parked, as the allocator leaves it ((parked − before) / {idle}) | {cell(per_idle, lambda v: f'{v:.0f}')} B |")
    trimmed = [r for r in conn if r.get("rss_idle_trim_kb") and r.get("rss_before_trim_kb")]
    if trimmed:
        live = [(r["rss_idle_trim_kb"] - r["rss_before_trim_kb"]) * 1024 / idle for r in trimmed]
        unparked = [(r["rss_unparked_kb"] - r["rss_before_trim_kb"]) * 1024 / idle for r in trimmed]
        slots = 10240 + 64 - (1024 + 64)
        slot = [(r["rss_empty_trim_kb"] - r["rss_default_trim_kb"]) * 1024 / slots for r in trimmed]
        add(f"| live RSS after `malloc_trim(0)`: 1024 slots / 10,240 slots, just started | "
            f"{cell([r['rss_default_trim_kb'] for r in trimmed], mib)} / {cell([r['rss_empty_trim_kb'] for r in trimmed], mib)} MiB |")
        add(f"| **connection slot, allocated at start** ((10,240 − 1024 slots) RSS difference / {slots}) | **{cell(slot, lambda v: f'{v:.0f}')} B** |")
        add(f"| live RSS before the idle connections / with them parked (after `malloc_trim(0)`) | "
            f"{cell([r['rss_before_trim_kb'] for r in trimmed], mib)} / {cell([r['rss_idle_trim_kb'] for r in trimmed], mib)} MiB |")
        add(f"| **live server memory per parked idle connection** ((parked − before, both trimmed) / {idle}) | **{cell(live, lambda v: f'{v:.0f}')} B** |")
        add(f"| server RSS per idle connection before parking (not parked − before, trimmed) / {idle} | {cell(unparked, lambda v: f'{v:.0f}')} B |")
    slab = [(r["slab_idle_kb"] - r["slab_before_kb"]) * 1024 / (2 * idle) for r in conn]
    add(f"| kernel Slab per socket (both ends of each connection are on this machine: ÷ {2 * idle}) | {cell(slab, lambda v: f'{v:.0f}')} B |")
    tcp = [(r["tcp_pages_idle"] - r["tcp_pages_before"]) for r in conn]
    add(f"| TCP socket-buffer pages held (/proc/net/sockstat `mem`), change | {cell(tcp, lambda v: f'{v:.0f}')} |")
    if floods:
        add(f"| idle connections established / refused / closed by the server (per run) | "
            f"{', '.join(str(f['idle_established']) + '/' + str(f['idle_refused']) + '/' + str(f['idle_closed_by_server']) for f in floods)} |")
    add("")

# --- tenants ---
ten = [r for r in runs if r.get("part") == "tenants"]
if ten:
    tenants = int(env["TENANTS"])
    add(f"## 10,000 tenants: the scheduler's share of the core")
    add("")
    labels = {
        "off": "profile, `--no-qos` (FIFO; tenants and accounting stay)",
        "one": "QoS on, 1 tenant (the namespace's default)",
        "reg": f"QoS on, {tenants} BE tenants registered, the load on the default tenant",
        "bound": f"QoS on, {tenants} BE tenants registered, connection k bound to tenant k ({env['ACTIVE']} active tenants)",
    }
    by = {}
    for r in ten:
        by.setdefault(r["mode"], {})[r["rep"]] = row(r["json"]) | {"others": r["others"]}
    reps = sorted(by["off"])
    add("| server | IOPS | p50 µs | p99 µs | server CPU per request ns | extra ns vs `--no-qos` (same repetition) | extra, % of the request's CPU | extra, % of a core at 100K IOPS | others |")
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in ("off", "one", "reg", "bound"):
        if mode not in by:
            continue
        rows = [by[mode][rep] for rep in reps if rep in by[mode]]
        extra = [by[mode][rep]["server_cpu_per_op_ns"] - by["off"][rep]["server_cpu_per_op_ns"]
                 for rep in reps if rep in by[mode]]
        rel = [by[mode][rep]["server_cpu_per_op_ns"] / by["off"][rep]["server_cpu_per_op_ns"] * 100 - 100
               for rep in reps if rep in by[mode]]
        core = [e * 100_000 / 1e9 * 100 for e in extra]
        sign = lambda v: f"{v:+.0f}"
        pct = lambda v: f"{v:+.1f} %"
        add(f"| {labels[mode]} | {cell([x['iops'] for x in rows], k)} | "
            f"{cell([x['read']['p50_us'] for x in rows], us)} | "
            f"{cell([x['read']['p99_us'] for x in rows], us)} | "
            f"{cell([x['server_cpu_per_op_ns'] for x in rows], ns, True)} | "
            + ("— | — | — | " if mode == "off" else
               f"{cell(extra, sign)} | {cell(rel, pct)} | {cell(core, pct, True)} | ")
            + f"{cell([x['others'] * 100 for x in rows], lambda v: f'{v:.0f} %')} |")
    add("")
    add("\"% of a core at 100K IOPS\" is the extra CPU per request × 100,000 requests per second, "
        "the yardstick of `docs/results/qos.md` (target ≤ 1 % at 10,000 tenants).")
    add("")

# --- threads ---
thr = [r for r in runs if r.get("part") == "threads"]
if thr:
    add("## `--threads 1` and `--threads 2`")
    add("")
    add(f"4 connections × QD 32 of 4 KiB random reads (`mem:256M` with the unlimited profile); the "
        f"server may run on both CPUs (`taskset -c {env['SERVER_CPU']},{env['CLIENT_CPU']}`), the "
        f"client on CPU {env['CLIENT_CPU']}: with 2 vCPUs, a second dataplane thread competes with "
        f"the client for the client's CPU, so this records correctness and cost, not scaling.")
    add("")
    add("| threads | IOPS | p99 µs | server CPU per request ns | server cores |")
    add("|---:|---:|---:|---:|---:|")
    for threads in (1, 2):
        rows = [row(r["json"]) for r in thr if r["threads"] == threads]
        add(f"| {threads} | {cell([x['iops'] for x in rows], k, True)} | "
            f"{cell([x['read']['p99_us'] for x in rows], us)} | "
            f"{cell([x['server_cpu_per_op_ns'] for x in rows], ns)} | "
            f"{cell([x['server_cores'] for x in rows], lambda v: f'{v:.2f}')} |")
    add("")
    log = os.path.join(env["RAW"], "threads-reservation.log")
    if os.path.exists(log):
        text = open(log).read()
        plan = re.findall(r"QoS plan .*", text)
        spent = re.findall(r"scheduler tokens thread=(\d+) .*? spent=([0-9.]+)", text)
        add("Correctness on 2 threads (log of a 2-thread reflexd with one LC tenant of 12K IOPS "
            "on `emu:device-a-small`, 8 connections for 2 s):")
        add("")
        for line in plan:
            add(f"- `{line.strip()}` (once: the reservation is counted once for the device, "
                "not per thread)")
        for thread, tokens in spent:
            add(f"- thread {thread} spent {float(tokens):.0f} tokens (connections spread over "
                "both threads' listeners)")
        add("")

notes_path = os.path.join(env["RAW"], "notes.txt")
if os.path.exists(notes_path):
    busy = [line.split()[1] for line in open(notes_path) if line.startswith("busy_start")]
    if busy:
        add(f"Started without a quiet second first (the machine stayed busy): {', '.join(busy)}.")
        add("")
add(f"Raw JSON and logs of every run: `{env['RAW']}/`.")
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
