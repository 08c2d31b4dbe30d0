"""Writes docs/results/overload.md from bench/overload.sh's runs.

Usage: python3 bench/lib/overload_report.py RUNS.jsonl OUT.md (environment from the script).
"""
import json
import os
import statistics
import sys

runs_path, out = sys.argv[1:3]
env = os.environ
raw = env["RAW"]
runs = [json.loads(line) for line in open(runs_path) if line.strip()]


def load(name, kind):
    path = os.path.join(raw, f"{name}-{kind}.json")
    return json.load(open(path)) if os.path.exists(path) else None


def rss_samples(name):
    path = os.path.join(raw, f"{name}-rss.txt")
    values = []
    for line in open(path):
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and int(parts[1]) > 0:
            values.append(int(parts[1]))
    return values


def cell(values, fmt, bold=False):
    values = sorted(values)
    m = fmt(statistics.median(values))
    m = f"**{m}**" if bold else m
    return f"{m} ({fmt(values[0])}–{fmt(values[-1])})" if len(values) > 1 else m


for run in runs:
    run["scenario"] = load(run["name"], "scenario")
    run["fresh"] = load(run["name"], "fresh")["fresh"]
    run["flood"] = load(run["name"], "flood")
    run["rss"] = rss_samples(run["name"])
    run["stats"] = load(run["name"], "stats")


def server_p95(run, name):
    """The server's p95 for tenant `name` (arrival off the socket to the reply's send), from
    /v1/stats two thirds into the scenario; tenants are matched by their handle."""
    tenant = next(t for t in run["scenario"]["tenants"] if t["name"] == name)
    handle = f"{tenant['handle']:016x}"
    for entry in (run["stats"] or {}).get("tenants", []):
        if entry["handle"] == handle:
            return entry["totals"]["read_latency_us"]["p95"]
    return None

modes = [m for m in ("none", "attack") if any(r["mode"] == m for r in runs)]
by_mode = {m: [r for r in runs if r["mode"] == m] for m in modes}
tenants = [t["name"] for t in runs[0]["scenario"]["tenants"]]
slo = {t["name"]: t["latency_us_p95"] for t in runs[0]["scenario"]["tenants"]}

connections = int(env["CONNECTIONS"])
slots = connections + 64
rss_start = statistics.median(int(r["rss_start_kb"]) for r in runs)
ceiling_kb = rss_start + slots * (64 + 2.1)

lines = []
add = lines.append
add("# Overload proof (issue 9): an attack beside a latency-critical tenant")
add("")
add(f"- date: {env['RUN_DATE']}")
add(f"- machine: {env['MACHINE']}")
add(f"- commit: {env['COMMIT']}{env['DIRTY']}")
add(f"- command: `{env['COMMAND']}`")
base = env.get("BASE_CONFIG", "configs/reflexd-small-headroom.toml")
margin = ("`slo_headroom_us = 100`" if base.endswith("reflexd-small-headroom.toml") else
          "no hand-set headroom" + (", online self-calibration on" if "calibrated" in base else ""))
mode = ("polling mode (`poll = true`: the dataplane spins on its CPU)"
        if env.get("POLL") == "on" else "blocking mode")
add(f"- server: reflexd as `{base}` (one dataplane thread, {mode}, `emu:device-a-small` with its profile, {margin}) with "
    f"`connections_per_thread_max = {connections}` (written to `{env['CONFIG']}`), other limits and "
    f"timeouts at their defaults (handshake 10 s, receive 30 s, send 60 s, park after 1 s). "
    + (f"Pinned to CPU {env['SERVER_CPU']} at {env['PRIORITY']}. Every other "
       "task that could run elsewhere was moved off that CPU for the run "
       "(`bench/lib/isolate.py`; per-CPU kernel threads such as ksoftirqd stay)."
       if env.get("ISOLATE") == "on" else
       f"The whole process pinned to CPU {env['SERVER_CPU']} at {env['PRIORITY']}, a CPU shared "
       "with every other task on the machine (`ISOLATE=off`)."))
beside_server = env.get("ATTACK_CPU", env["CLIENT_CPU"]) == env["SERVER_CPU"]
add(f"- clients pinned to CPU {env['CLIENT_CPU']}: `reflex bench --scenario "
    f"{env['SCENARIO']}` (LC A 12K IOPS, LC B 7K reserved / 4.5K sent, p95 ≤ 500 µs; BE C and D "
    f"saturating; 2 s warm-up + 10 s) and the fresh client (`reflex flood --fresh-interval "
    f"{env['FRESH_INTERVAL']}`: connect, HELLO, one 4 KiB READ, close, over and over during the "
    f"scenario) at {env['PRIORITY']}; "
    + (f"the attacker pinned to the server's CPU {env['SERVER_CPU']} at niceness 19 (`ATTACK_CPU`: "
       "the kernel's work for the attack's packets lands on the server's CPU, as a remote "
       "attacker's lands on the server's machine, and none of it on the LC client's)."
       if beside_server else
       f"the attacker on the clients' CPU at niceness 19 (2 vCPUs: the attack competes with the "
       "LC client for that CPU, never with the server for its own)."))
add(f"- the attack (`reflex flood --source {env['SOURCE']}`): (a) {env['IDLE']} idle connections "
    f"that each completed a HELLO (established, then parked); (b) {env['SLOWLORIS']} slowloris "
    f"connections (2 bytes of a header, then nothing), each replaced when the server closes it, "
    f"at most {env['CONNECT_RATE']} replacements per second; (c) {env['NON_READERS']} "
    f"non-reading connection(s): 128 pipelined 1 MiB READs, a 4 KiB receive buffer, never "
    f"read. {int(env['IDLE']) + int(env['SLOWLORIS']) + int(env['NON_READERS'])} connections "
    f"against a table of {connections}: the table is full, so every newcomer (the fresh client, a "
    f"slowloris replacement) evicts the oldest connection that never completed a request.")
add(f"- each mode runs on a fresh server; {len(by_mode[modes[0]])} repetitions; cells: median "
    f"(range). Load average before {env['LOAD_BEFORE']}, after {env['LOAD_AFTER']}.")
add("")
add(f"- scheduler autogroup: `{env.get('AUTOGROUP', 'none')}`. This kernel groups tasks by session "
    "(`kernel.sched_autogroup_enabled = 1`) and shares the CPU between sessions before niceness "
    "counts: the script gives its own session the niceness of its processes, or `nice -n -20` "
    "would not shield them from other sessions' builds.")
add("")
add("## The LC tenants' SLO")
add("")
add("| run | " + " | ".join(f"{t} p95 µs" for t in tenants if slo[t]) + " | SLO met (runs) | "
    + " | ".join(f"{t} IOPS" for t in tenants) + " | server cores |")
add("|---|" + "---:|" * len([t for t in tenants if slo[t]]) + "---|" + "---:|" * len(tenants) + "---:|")
for mode in modes:
    rows = by_mode[mode]
    cells = []
    for index, name in enumerate(tenants):
        if slo[name]:
            cells.append(cell([r["scenario"]["tenants"][index]["read"]["p95_us"] for r in rows],
                              lambda v: f"{v:.0f}", True))
    met = []
    for index, name in enumerate(tenants):
        if slo[name]:
            yes = sum(1 for r in rows if r["scenario"]["tenants"][index]["slo_met"])
            met.append(f"{name} {yes}/{len(rows)}")
    iops = [cell([r["scenario"]["tenants"][index]["iops"] for r in rows],
                 lambda v: f"{v / 1e3:.1f}K") for index in range(len(tenants))]
    cores = cell([int(r["server_cpu_ns"]) / int(r["wall_ns"]) for r in rows], lambda v: f"{v:.2f}")
    label = "scenario alone" if mode == "none" else "scenario + attack"
    add(f"| {label} | {' | '.join(cells)} | {', '.join(met)} | {' | '.join(iops)} | {cores} |")
add("")
add("The same tenants' p95 as the server saw it (arrival off the socket to the reply's send, "
    "over the run until two thirds into the scenario, from `GET /v1/stats`); the client's p95 "
    "less the server's is what the network, the kernel and the client add:")
add("")
add("| run | " + " | ".join(f"{t} server p95 µs" for t in tenants if slo[t]) + " |")
add("|---|" + "---:|" * len([t for t in tenants if slo[t]]))
for mode in modes:
    rows = by_mode[mode]
    cells = []
    for name in tenants:
        if slo[name]:
            values = [v for v in (server_p95(r, name) for r in rows) if v is not None]
            cells.append(cell(values, lambda v: f"{v:.0f}") if values else "—")
    label = "scenario alone" if mode == "none" else "scenario + attack"
    add(f"| {label} | {' | '.join(cells)} |")
add("")
if len(modes) == 2:
    # A repetition's two runs follow each other: a miss in both is the machine's state at
    # that time, a miss under attack only is the attack's.
    add("Per repetition, client p95 / server p95 in µs, the scenario alone and then attacked:")
    add("")
    lc = [t for t in tenants if slo[t]]
    add("| repetition | " + " | ".join(f"{t} alone | {t} attacked" for t in lc) + " |")
    add("|---:|" + "---:|" * (2 * len(lc)))
    for rep in sorted({r["rep"] for r in runs}):
        pair = {r["mode"]: r for r in runs if r["rep"] == rep}
        cells = []
        for name in lc:
            index = tenants.index(name)
            for mode in modes:
                r = pair.get(mode)
                if r is None:
                    cells.append("—")
                    continue
                client = r["scenario"]["tenants"][index]["read"]["p95_us"]
                server = server_p95(r, name)
                cells.append(f"{client:.0f} / {server:.0f}" if server is not None else f"{client:.0f} / —")
        add(f"| {rep} | {' | '.join(cells)} |")
    add("")
add("## A fresh client: connect, HELLO, first 4 KiB READ answered")
add("")
add("| run | attempts | failures | connect p99 µs | HELLO answered p99 µs | READ answered p50 µs | **READ answered p99 µs** | **max µs** |")
add("|---|---:|---:|---:|---:|---:|---:|---:|")
for mode in modes:
    rows = by_mode[mode]
    fresh = [r["fresh"] for r in rows]
    label = "scenario alone" if mode == "none" else "scenario + attack"
    add(f"| {label} | {cell([f['attempts'] for f in fresh], lambda v: f'{v:.0f}')} | "
        f"{cell([f['failures'] for f in fresh], lambda v: f'{v:.0f}')} | "
        f"{cell([f['connect_us']['p99'] for f in fresh], lambda v: f'{v:.0f}')} | "
        f"{cell([f['hello_us']['p99'] for f in fresh], lambda v: f'{v:.0f}')} | "
        f"{cell([f['first_read_us']['p50'] for f in fresh], lambda v: f'{v:.0f}')} | "
        f"{cell([f['first_read_us']['p99'] for f in fresh], lambda v: f'{v:.0f}', True)} | "
        f"{cell([f['first_read_us']['max'] for f in fresh], lambda v: f'{v:.0f}', True)} |")
    failures = [f["first_failure"] for f in fresh if f.get("first_failure")]
    if failures:
        add(f"| (first failures: {'; '.join(failures)}) | | | | | | | |")
worst = max(r["fresh"]["first_read_us"]["max"] for r in runs)
add("")
add(f"Worst single fresh client over every run: {worst / 1e3:.1f} ms (target: 100 ms).")
add("")
add("## The server's memory (VmRSS)")
add("")
add("| run | at start MiB | attack set up MiB | max during the run MiB |")
add("|---|---:|---:|---:|")
for mode in modes:
    rows = by_mode[mode]
    label = "scenario alone" if mode == "none" else "scenario + attack"
    add(f"| {label} | {cell([int(r['rss_start_kb']) for r in rows], lambda v: f'{v / 1024:.0f}')} | "
        f"{cell([int(r['rss_attacked_kb']) for r in rows], lambda v: f'{v / 1024:.0f}')} | "
        f"{cell([max(r['rss']) for r in rows], lambda v: f'{v / 1024:.0f}', True)} |")
add("")
add(f"**Ceiling: {ceiling_kb / 1024:.0f} MiB** = RSS at start ({rss_start / 1024:.0f} MiB: binary, "
    f"the registered 32 MiB buffer arena, the {slots} connection slots allocated at start, the "
    f"emulated device) + {slots} connections × (a 64 KiB receive buffer + a 2.1 KiB send "
    f"staging of the io_uring driver). Everything else a connection can hold is bounded "
    f"inside that: request data lives in the fixed arena (one connection at most 25 % of it), "
    f"a parked connection gives its receive buffer back, and the table never holds more than "
    f"{slots} connections. The freed receive buffers stay in the allocator (glibc does not "
    f"return them to the system), so RSS follows the most connections unparked at once, not "
    f"the current number.")
add("")
if "attack" in by_mode:
    add("## What the attack did (per run)")
    add("")
    add("| repetition | idle established / refused / closed by the server | slowloris connects / closed by the server / open at the end | non-readers | timeouts logged by the server |")
    add("|---:|---|---|---:|---:|")
    for r in by_mode["attack"]:
        f = r["flood"]
        add(f"| {r['rep']} | {f['idle_established']} / {f['idle_refused']} / {f['idle_closed_by_server']} | "
            f"{f['slowloris_connects']} / {f['slowloris_closed_by_server']} / {f['slowloris_open_at_end']} | "
            f"{f['non_readers']} | {r['timeout_closes']} |")
    add("")
notes_path = os.path.join(raw, "notes.txt")
if os.path.exists(notes_path):
    busy = [line.split()[1] for line in open(notes_path) if line.startswith("busy_start")]
    if busy:
        add(f"Started without a quiet second first (the machine stayed busy): {', '.join(busy)}.")
        add("")
add(f"Raw JSON, server logs and RSS samples: `{raw}/`.")
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
