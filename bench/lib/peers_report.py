#!/usr/bin/python3
"""Summarises a bench/peers.sh run: medians over repetitions -> markdown table and SVG plot.

Usage: peers_report.py OUT_DIR RESULTS_MD PLOT_SVG

Reads OUT_DIR/machine.txt (key=value), labels.tsv, runs.tsv (case, server, queue depth,
repetition, fio JSON path, server CPU ticks, wall time in ns, server-CPU busy ticks),
sat.tsv (the same columns for `reflex bench --json` runs of the saturating-client section,
plus the connection count) and pingpong-rep*.json (`reflex pingpong --json`). Either
section may be absent (`SECTIONS=`). Standard library only, so it runs on a bare Debian
python3.
"""

import glob
import math
import json
import os
import statistics
import sys
from collections import defaultdict

PERCENTILES = ["50.000000", "90.000000", "99.000000", "99.900000"]
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Above this median share of the server CPU taken by other processes, the report says the run
# measured contention.
CONTENTION_WARN = 0.10


def load(out):
    machine = {}
    with open(os.path.join(out, "machine.txt")) as f:
        for line in f:
            if "=" in line:
                key, value = line.rstrip("\n").split("=", 1)
                machine[key] = value
    labels = {}
    with open(os.path.join(out, "labels.tsv")) as f:
        for line in f:
            _, case, name, label, unavailable = (line.rstrip("\n").split("\t") + [""])[:5]
            labels[(case, name)] = (label, unavailable)
    runs = defaultdict(list)
    with open(os.path.join(out, "runs.tsv")) as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            case, name, qd, rep, path, ticks, wall_ns = fields[:7]
            busy_ticks = int(fields[7]) if len(fields) > 7 else None
            with open(path) as j:
                text = j.read()
            # fio may print engine chatter before the JSON document.
            job = json.loads(text[text.index("{"):])["jobs"][0]
            read = job["read"]
            pct = read["lat_ns"].get("percentile", {})
            # Server CPU seconds over the whole job (no ramp, so every request counts) against
            # the requests completed and the job's run time.
            # A server pinned to one CPU cannot use more than the run time in the job's window;
            # anything above is time around the job (fio starting, a polling server spinning
            # while idle), so it is clamped away.
            runtime_s = read["runtime"] / 1000
            cpu_s = min(int(ticks) / CLK_TCK, runtime_s) if int(ticks) > 0 else 0.0
            requests = read["total_ios"]
            runs[(case, name, int(qd))].append(
                {
                    "iops": read["iops"],
                    "p": [pct.get(p, float("nan")) / 1000 for p in PERCENTILES],
                    "mean_us": read["lat_ns"]["mean"] / 1000,
                    "cores": cpu_s / runtime_s if runtime_s > 0 else float("nan"),
                    "per_core": requests / cpu_s if cpu_s > 0 else float("nan"),
                    "wall_s": int(wall_ns) / 1e9,
                    # Share of the server CPU other processes used during the job (the fio
                    # job's wall time includes its start, when the server is idle).
                    "foreign": (
                        max(0, busy_ticks - int(ticks)) / CLK_TCK / (int(wall_ns) / 1e9)
                        if busy_ticks is not None and int(wall_ns) > 0
                        else float("nan")
                    ),
                    "error": job.get("error", 0),
                }
            )
    pingpong = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(out, "pingpong-rep*.json"))):
        try:
            with open(path) as f:
                rows = json.load(f)
        except (OSError, ValueError):
            continue
        for row in rows:
            pingpong[row["size_bytes"]].append(row["round_trip"])
    return machine, labels, runs, pingpong


def load_sat(out):
    """The saturating-client runs: `reflex bench --json` reports, keyed by (case, server)."""
    runs = defaultdict(list)
    path = os.path.join(out, "sat.tsv")
    if not os.path.exists(path):
        return runs
    with open(path) as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 9:
                continue
            case, name, qd, _rep, json_path, ticks, wall_ns, busy_ticks, connections = fields[:9]
            try:
                with open(json_path) as j:
                    row = json.load(j)["rows"][0]
            except (OSError, ValueError, KeyError, IndexError):
                continue
            # No warm-up: every request the server served is in `ops`, issued within the
            # measured time (answers drained after it count too, like the server's CPU time).
            measured_s = row["measured_sec"]
            cpu_s = min(int(ticks) / CLK_TCK, measured_s) if int(ticks) > 0 else 0.0
            wall_s = int(wall_ns) / 1e9
            runs[(case, name)].append(
                {
                    "iops": row["iops"],
                    "p50_us": row["read"]["p50_us"],
                    "p99_us": row["read"]["p99_us"],
                    "cores": cpu_s / measured_s if measured_s > 0 else float("nan"),
                    "per_core": row["ops"] / cpu_s if cpu_s > 0 else float("nan"),
                    "foreign": (
                        max(0, int(busy_ticks) - int(ticks)) / CLK_TCK / wall_s
                        if wall_s > 0
                        else float("nan")
                    ),
                    "errors": row["errors"],
                    "connections": int(connections),
                    "qd": int(qd),
                }
            )
    return runs


def summarise_sat(runs):
    summary = {}
    for key, reps in runs.items():
        iops = [r["iops"] for r in reps]
        summary[key] = {
            "reps": len(reps),
            "iops": median(iops),
            "iops_min": min(iops),
            "iops_max": max(iops),
            "p50_us": median([r["p50_us"] for r in reps]),
            "p99_us": median([r["p99_us"] for r in reps]),
            "cores": median([r["cores"] for r in reps]),
            "iops_per_core": median([r["per_core"] for r in reps]),
            "foreign": median([r["foreign"] for r in reps]),
            "errors": sum(r["errors"] for r in reps),
            "connections": reps[0]["connections"],
            "qd": reps[0]["qd"],
        }
    return summary


def median(values):
    values = [v for v in values if v == v]
    return statistics.median(values) if values else None


def summarise(runs):
    summary = {}
    for key, reps in runs.items():
        iops = [r["iops"] for r in reps]
        s = {
            "reps": len(reps),
            "iops": median(iops),
            "iops_min": min(iops),
            "iops_max": max(iops),
            "p": [median([r["p"][i] for r in reps]) for i in range(len(PERCENTILES))],
            "cores": median([r["cores"] for r in reps]),
            "errors": sum(1 for r in reps if r["error"]),
            "foreign": median([r["foreign"] for r in reps]),
        }
        s["iops_per_core"] = median([r["per_core"] for r in reps])
        summary[key] = s
    return summary


def fmt(value, digits=1):
    if value is None:
        return "—"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def percent(fraction):
    return "—" if fraction is None else f"{100 * fraction:.0f} %"


def sat_report(machine, labels, sat):
    """The saturating-client section: `reflex bench` over NBD against every server."""
    lines = []
    add = lines.append
    hot = [(n, l) for (c, n), l in labels.items() if c == "sat-hot"]
    disk = [(n, l) for (c, n), l in labels.items() if c == "sat-disk"]
    if not hot and not disk:
        return lines
    shape = machine.get("saturating", "?")
    add(f"## Saturating client: `reflex bench` over NBD ({shape})")
    add("")
    add(
        "**Method.** The bench engine of `reflex bench` speaks NBD (`--server "
        "nbd://HOST:PORT/EXPORT`, simple replies, no structured replies): one bench thread "
        "pinned to the client CPU drives several connections from one io_uring, keeps the "
        "queue depth full on each (closed loop) and sends every request of a loop iteration "
        "in one `send`, so the server's per-request cost, not the client's, sets the pace. "
        "4 KiB random reads, no warm-up (every request the server served is counted), server "
        "CPU time from `/proc/PID/stat` around the run as above, IOPS per server core = "
        "requests / server CPU seconds. The disk rows compare the same engine over NBD with "
        "`reflex bench --local` (io_uring, O_DIRECT) on the same file at the same total queue "
        "depth, run on the server's CPU. Medians over the repetitions."
    )
    add("")
    nbdkit = (sat.get(("hot", "nbdkit-memory")) or {}).get("iops_per_core")
    add(
        "| server (hot data) | IOPS (min–max) | p50 µs | p99 µs | server CPU (cores) | "
        "IOPS per server core | × nbdkit memory | others on the server CPU |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (label, unavailable) in hot:
        s = sat.get(("hot", name))
        if not s:
            add(f"| {label} | {unavailable or 'no result'} |  |  |  |  |  |  |")
            continue
        ratio = s["iops_per_core"] / nbdkit if s["iops_per_core"] and nbdkit else None
        add(
            f"| {label} | {fmt(s['iops'])} ({fmt(s['iops_min'])}–{fmt(s['iops_max'])}) | "
            f"{fmt(s['p50_us'])} | {fmt(s['p99_us'])} | {fmt(s['cores'], 2)} | "
            f"{fmt(s['iops_per_core'])} | {fmt(ratio, 2)} | {percent(s['foreign'])} |"
        )
    add("")
    local = sat.get(("disk", "local"))
    add(
        "| path (disk) | IOPS (min–max) | remote/local | p50 µs | p99 µs | server CPU (cores) | "
        "IOPS per server core |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|")
    for name, (label, unavailable) in disk:
        s = sat.get(("disk", name))
        if not s:
            add(f"| {label} | {unavailable or 'no result'} |  |  |  |  |  |")
            continue
        ratio = (
            f"{100 * s['iops'] / local['iops']:.0f} %"
            if name != "local" and local and local["iops"]
            else "—"
        )
        per_core = "—" if name == "local" else fmt(s["iops_per_core"])
        cores = "—" if name == "local" else fmt(s["cores"], 2)
        add(
            f"| {label} | {fmt(s['iops'])} ({fmt(s['iops_min'])}–{fmt(s['iops_max'])}) | "
            f"{ratio} | {fmt(s['p50_us'])} | {fmt(s['p99_us'])} | {cores} | {per_core} |"
        )
    add("")
    errors = sum(s["errors"] for s in sat.values())
    if errors:
        add(f"**{errors} requests failed in the saturating runs**; their numbers are suspect.")
        add("")
    return lines


def report(machine, labels, summary, pingpong, plot_name, sat=None):
    sat = sat or {}
    hot = [(n, l) for (c, n), l in labels.items() if c == "hot"]
    disk = [(n, l) for (c, n), l in labels.items() if c == "disk"]
    lines = []
    add = lines.append
    add("# NBD servers side by side (`bench/peers.sh`)")
    add("")
    add(
        f"Measured {machine.get('date', '?')} on commit `{machine.get('commit', '?')}`; "
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores (a VM), "
        f"{machine.get('memory', '?')}, kernel {machine.get('kernel', '?')}, "
        f"disk {machine.get('disk', '?')}. Load average (1/5/15 min) at start "
        f"{machine.get('load_start', '?')}, at end {machine.get('load_end', '?')}."
    )
    add("")
    add(
        f"Versions: {machine.get('fio', '?')}, {machine.get('nbdkit', '?')}, "
        f"{machine.get('qemu-nbd', '?')}, nbd-server {machine.get('nbd-server', '?')}, "
        f"{machine.get('libnbd', '?')}. Parameters: {machine.get('reps', '?')}."
    )
    add("")
    add(
        "**Method.** One client for every server: fio's `nbd` engine (libnbd), one connection, "
        "4 KiB random reads (`--norandommap --randrepeat=0`) for a fixed time, no warm-up "
        "phase; latency is fio's total latency (`lat_ns`, submission to completion). The "
        "server is pinned to one CPU and fio to the other with `taskset`, so \"server CPU\" is "
        "at most 1 core. Server CPU time is utime+stime from `/proc/PID/stat` of the server "
        "and its children (nbd-server forks per connection), read before and after the fio "
        "job; IOPS per server core = requests completed / server CPU seconds, and \"server "
        "CPU\" = CPU seconds / the job's run time (at most 1: CPU time above the run time "
        "was spent around the job, e.g. by `reflexd --poll` spinning while fio starts). "
        "`reflexd --poll` dedicates its core by design and runs only during its own jobs. Each cell is the median over "
        "the repetitions (QD32 IOPS also shows min–max). Hot data: the export is filled "
        "with random bytes first; nbdkit memory and reflexd `mem:` hold it in memory, the "
        "others serve a file on tmpfs. Disk: a file on the root ext4 disk filled with data, "
        "read with O_DIRECT by fio's io_uring engine locally, by qemu-nbd (`--cache=none "
        "--aio=io_uring`) and by reflexd; nbdkit 1.32's file plugin has no O_DIRECT and uses "
        "`cache=none` (reads through the page cache, then evicts); nbd-server has neither, "
        "so its disk numbers are page-cache numbers and get no ratio. The latency floor is "
        "`reflex pingpong` (TCP round trips of a message echoed back, same CPUs). \"Others on "
        "the server CPU\" is the share of the server's CPU that other processes used during "
        "the job (from `/proc/stat`): this machine is shared, and a large share means that "
        "row measured contention more than the server."
    )
    add("")

    contention = median([s["foreign"] for (_, name, _), s in summary.items() if name != "local"])
    if contention is not None and contention > CONTENTION_WARN:
        add(
            f"**Contended run.** Other processes used a median {100 * contention:.0f} % of the "
            "server CPU during the jobs (column \"others on the server CPU\"), so these numbers "
            "mostly measure the competition for two shared cores; they are not the servers' "
            "capacity. Rerun on a quiet machine (`QUIET_WAIT_S=600 bench/peers.sh` waits for "
            "one before each job) before drawing conclusions."
        )
        add("")
    nbdkit_per_core = (summary.get(("hot", "nbdkit-memory", 32)) or {}).get("iops_per_core")
    add("## Hot data (in memory), 4 KiB random read")
    add("")
    add(
        "| server | QD1 p50 µs | QD1 p90 µs | QD1 p99 µs | QD1 p99.9 µs | QD1 IOPS | "
        "QD32 IOPS (min–max) | server CPU at QD32 (cores) | IOPS per server core | "
        "× nbdkit memory | others on the server CPU (QD1/QD32) |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (label, unavailable) in hot:
        qd1 = summary.get(("hot", name, 1))
        qd32 = summary.get(("hot", name, 32))
        if not qd1 or not qd32:
            add(f"| {label} | {unavailable or 'no result'} |  |  |  |  |  |  |  |  |  |")
            continue
        ratio = (
            qd32["iops_per_core"] / nbdkit_per_core
            if qd32["iops_per_core"] and nbdkit_per_core
            else None
        )
        add(
            f"| {label} | {fmt(qd1['p'][0])} | {fmt(qd1['p'][1])} | {fmt(qd1['p'][2])} | "
            f"{fmt(qd1['p'][3])} | {fmt(qd1['iops'])} | {fmt(qd32['iops'])} "
            f"({fmt(qd32['iops_min'])}–{fmt(qd32['iops_max'])}) | {fmt(qd32['cores'], 2)} | "
            f"{fmt(qd32['iops_per_core'])} | {fmt(ratio, 2)} | "
            f"{percent(qd1['foreign'])} / {percent(qd32['foreign'])} |"
        )
    add("")

    local = {qd: summary.get(("disk", "local", qd)) for qd in (1, 32)}
    add(f"## Disk: {machine.get('disk', 'the root disk')}, 4 KiB random read")
    add("")
    add(
        "| path | QD1 p50 µs | QD1 p99 µs | QD1 IOPS | QD32 IOPS (min–max) | "
        "QD32 remote/local | QD1 p50 − local µs | others on the server CPU (QD1/QD32) |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (label, unavailable) in disk:
        qd1 = summary.get(("disk", name, 1))
        qd32 = summary.get(("disk", name, 32))
        if not qd1 or not qd32:
            add(f"| {label} | {unavailable or 'no result'} |  |  |  |  |  |  |")
            continue
        comparable = name not in ("local", "nbd-server")
        ratio = (
            f"{100 * qd32['iops'] / local[32]['iops']:.0f} %"
            if comparable and local[32]
            else "—"
        )
        delta = (
            fmt(qd1["p"][0] - local[1]["p"][0])
            if comparable and local[1]
            else "—"
        )
        add(
            f"| {label} | {fmt(qd1['p'][0])} | {fmt(qd1['p'][2])} | {fmt(qd1['iops'])} | "
            f"{fmt(qd32['iops'])} ({fmt(qd32['iops_min'])}–{fmt(qd32['iops_max'])}) | "
            f"{ratio} | {delta} | {percent(qd1['foreign'])} / {percent(qd32['foreign'])} |"
        )
    add("")

    lines += sat_report(machine, labels, sat)

    add("## Latency floor: TCP ping-pong on loopback (`reflex pingpong`)")
    add("")
    floor = {}
    if pingpong:
        add("| message | p50 µs | p99 µs | mean µs |")
        add("|---:|---:|---:|---:|")
        for size in sorted(pingpong):
            rows = pingpong[size]
            p50 = median([r["p50_us"] for r in rows])
            floor[size] = p50
            add(
                f"| {size} B | {fmt(p50)} | {fmt(median([r['p99_us'] for r in rows]))} | "
                f"{fmt(median([r['avg_us'] for r in rows]))} |"
            )
    else:
        add("Not measured (`reflex pingpong` was not available).")
    add("")

    add("## Targets (issue 5) and where reflexd stands")
    add("")
    floor_4k = floor.get(4096)
    variants = [("reflexd-mem", "reflexd-file"), ("reflexd-mem-poll", "reflexd-file-poll")]

    def per_core_target(hot_name, _disk_name):
        s = summary.get(("hot", hot_name, 32))
        if not (s and s["iops_per_core"] and nbdkit_per_core):
            return "not measured", None
        x = s["iops_per_core"] / nbdkit_per_core
        return f"{x:.2f}×", x >= 4

    def disk_ratio_target(_hot_name, disk_name):
        s = summary.get(("disk", disk_name, 32))
        if not (s and local[32]):
            return "not measured", None
        x = s["iops"] / local[32]["iops"]
        return f"{100 * x:.0f} %", x >= 0.95

    def disk_latency_target(_hot_name, disk_name):
        s = summary.get(("disk", disk_name, 1))
        if not (s and local[1] and floor_4k is not None):
            return "not measured", None
        d = s["p"][0] - local[1]["p"][0]
        return f"+{d:.1f} µs (allowed +{floor_4k + 5:.1f})", d <= floor_4k + 5

    def hot_latency_target(hot_name, _disk_name):
        s = summary.get(("hot", hot_name, 1))
        if not (s and floor_4k is not None):
            return "not measured", None
        return f"{s['p'][0]:.1f} µs (allowed {floor_4k + 5:.1f})", s["p"][0] <= floor_4k + 5

    sat_nbdkit = (sat.get(("hot", "nbdkit-memory")) or {}).get("iops_per_core")
    sat_local = sat.get(("disk", "local"))

    def sat_per_core_target(hot_name, _disk_name):
        s = sat.get(("hot", hot_name))
        if not (s and s["iops_per_core"] and sat_nbdkit):
            return "not measured", None
        x = s["iops_per_core"] / sat_nbdkit
        return f"{x:.2f}×", x >= 4

    def sat_disk_ratio_target(_hot_name, disk_name):
        s = sat.get(("disk", disk_name))
        if not (s and sat_local and sat_local["iops"]):
            return "not measured", None
        x = s["iops"] / sat_local["iops"]
        return f"{100 * x:.0f} %", x >= 0.95

    targets = [
        ("≥ 4× nbdkit memory's IOPS per server core (hot, QD32, fio)", per_core_target),
        (
            "≥ 4× nbdkit memory's IOPS per server core (hot, saturating client)",
            sat_per_core_target,
        ),
        ("remote ≥ 95 % of local IOPS at QD32 (disk, fio)", disk_ratio_target),
        ("remote ≥ 95 % of local IOPS at QD32 (disk, saturating client)", sat_disk_ratio_target),
        ("QD1 p50 − local p50 ≤ ping-pong p50 (4 KiB) + 5 µs (disk)", disk_latency_target),
        ("QD1 p50 ≤ ping-pong p50 (4 KiB) + 5 µs (hot; local memory ≈ 0)", hot_latency_target),
    ]
    add("| target | reflexd (blocking) | met | reflexd --poll | met |")
    add("|---|---:|---|---:|---|")
    for target, check in targets:
        cells = []
        for hot_name, disk_name in variants:
            value, met = check(hot_name, disk_name)
            cells += [value, "—" if met is None else ("yes" if met else "no")]
        add(f"| {target} | " + " | ".join(cells) + " |")
    add("")
    errors = sum(s["errors"] for s in summary.values())
    if errors:
        add(f"**{errors} fio runs reported an error**; their numbers are suspect.")
        add("")
    add(f"![NBD servers side by side]({plot_name})")
    add("")
    return "\n".join(lines)


# --- SVG -------------------------------------------------------------------------------------

COLORS = ["#4878a8", "#e08c3c", "#5aa05a", "#c85050", "#8c6cb4", "#8c8c8c"]


def esc(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def nice_ceiling(value):
    """The smallest of 1, 2, 2.5, 5 × 10^k that is ≥ value (an axis top with round ticks)."""
    if value <= 0:
        return 1.0
    scale = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 4, 5, 10):
        if step * scale >= value:
            return step * scale
    return 10 * scale


def panel(x0, y0, w, h, title, categories, series, unit, reference=None):
    """A grouped bar chart: categories on x, one bar per series; None draws 'n/a'."""
    out = []
    values = [v for _, vs in series for v in vs if v is not None]
    if reference:
        values.append(reference[1])
    top = nice_ceiling(max(values) * 1.05) if values else 1.0
    left, bottom = x0 + 60, y0 + h - 70
    plot_h = h - 110
    plot_w = w - 75
    out.append(f'<text x="{x0 + w / 2}" y="{y0 + 18}" text-anchor="middle" font-weight="bold">{esc(title)}</text>')
    for i in range(5):
        v = top * i / 4
        y = bottom - plot_h * i / 4
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        label = f"{v:,.0f}" if top >= 40 else f"{v:g}"
        out.append(f'<text x="{left - 5}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{label}</text>')
    out.append(
        f'<text x="{x0 + 12}" y="{bottom - plot_h / 2}" font-size="11" text-anchor="middle" '
        f'transform="rotate(-90 {x0 + 12} {bottom - plot_h / 2})">{esc(unit)}</text>'
    )
    group_w = plot_w / max(len(categories), 1)
    bar_w = group_w * 0.8 / max(len(series), 1)
    for c, category in enumerate(categories):
        gx = left + c * group_w + group_w * 0.1
        for s, (name, vs) in enumerate(series):
            v = vs[c]
            bx = gx + s * bar_w
            if v is None:
                out.append(
                    f'<text x="{bx + bar_w / 2:.1f}" y="{bottom - 4}" font-size="9" '
                    f'text-anchor="middle" fill="#888">n/a</text>'
                )
                continue
            bh = plot_h * v / top
            out.append(
                f'<rect x="{bx:.1f}" y="{bottom - bh:.1f}" width="{bar_w * 0.92:.1f}" '
                f'height="{bh:.1f}" fill="{COLORS[s % len(COLORS)]}"/>'
            )
        cx = left + c * group_w + group_w / 2
        words = category.split(" ")
        for k, word in enumerate(words[:4]):
            out.append(
                f'<text x="{cx:.1f}" y="{bottom + 14 + 11 * k}" font-size="10" '
                f'text-anchor="middle">{esc(word)}</text>'
            )
    if reference:
        name, v = reference
        y = bottom - plot_h * v / top
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" '
            f'stroke="#c00" stroke-dasharray="5,3"/>'
        )
        out.append(f'<text x="{left + plot_w}" y="{y - 4:.1f}" font-size="10" text-anchor="end" fill="#c00">{esc(name)}</text>')
    out.append(f'<line x1="{left}" y1="{bottom}" x2="{left + plot_w}" y2="{bottom}" stroke="#000"/>')
    for s, (name, _) in enumerate(series):
        lx = left + s * 110
        ly = y0 + 34
        out.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{COLORS[s % len(COLORS)]}"/>')
        out.append(f'<text x="{lx + 14}" y="{ly}" font-size="10">{esc(name)}</text>')
    return out


def plot(labels, summary, pingpong, machine, sat=None):
    sat = sat or {}
    sat_hot = [(n, l[0]) for (c, n), l in labels.items() if c == "sat-hot"]
    hot = [(n, l[0]) for (c, n), l in labels.items() if c == "hot"]
    disk = [(n, l[0]) for (c, n), l in labels.items() if c == "disk"]

    def get(case, name, qd, field, index=None):
        s = summary.get((case, name, qd))
        if not s:
            return None
        v = s[field]
        return v[index] if index is not None else v

    floor = median([r["p50_us"] for r in pingpong.get(4096, [])]) if pingpong else None
    w, h = 2000, 430
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
    ]
    parts += panel(
        0, 0, 500, h, "Hot data: QD1 4 KiB read latency",
        [label for _, label in hot],
        [
            ("p50", [get("hot", n, 1, "p", 0) for n, _ in hot]),
            ("p90", [get("hot", n, 1, "p", 1) for n, _ in hot]),
        ],
        "µs",
        ("ping-pong 4 KiB p50", floor) if floor else None,
    )
    parts += panel(
        500, 0, 500, h, "Hot data: QD32 IOPS per server core",
        [label for _, label in hot],
        [("IOPS / core", [get("hot", n, 32, "iops_per_core") for n, _ in hot])],
        "IOPS per core",
    )
    parts += panel(
        1000, 0, 500, h, "Disk: 4 KiB random read IOPS",
        [label for _, label in disk],
        [
            ("QD1", [get("disk", n, 1, "iops") for n, _ in disk]),
            ("QD32", [get("disk", n, 32, "iops") for n, _ in disk]),
        ],
        "IOPS",
    )
    parts += panel(
        1500, 0, 500, h, "Saturating client: hot IOPS per server core",
        [label for _, label in sat_hot],
        [("IOPS / core", [(sat.get(("hot", n)) or {}).get("iops_per_core") for n, _ in sat_hot])],
        "IOPS per core",
    )
    parts.append(
        f'<text x="{w - 10}" y="{h - 8}" font-size="10" text-anchor="end" fill="#666">'
        f'{esc(machine.get("date", ""))} commit {esc(machine.get("commit", ""))}, '
        f'medians of {esc(machine.get("reps", "").split(" ")[0])}</text>'
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main():
    out, results_md, plot_svg = sys.argv[1:4]
    machine, labels, runs, pingpong = load(out)
    summary = summarise(runs)
    sat = summarise_sat(load_sat(out))
    rel = os.path.relpath(plot_svg, os.path.dirname(results_md))
    with open(results_md, "w") as f:
        f.write(report(machine, labels, summary, pingpong, rel, sat))
    with open(plot_svg, "w") as f:
        f.write(plot(labels, summary, pingpong, machine, sat))


if __name__ == "__main__":
    main()
