#!/usr/bin/env python3
"""OctoFAS Figures 3 and 9 on the real server (issue 14): the load of scenarios/fig9.py (a
sparse best-effort flow, closed loop at depth 2, against a dense one at depth k) run by
`reflex bench --scenario` against a real reflexd serving the small emulated device
(emu:device-a-small, real time), with the fairness stage off, fair_share and backwarding.

Per read share (100 % and 0 % reads):
  1. each flow alone (stage off, QoS off, as the simulator's RT_alone): its mean response time
     is RT_alone, the median of RUNS runs;
  2. per mode and dense depth k: both flows at once, the scenario file carrying each flow's
     rt_alone_us, so `reflex bench` reports slowdowns S = RT / RT_alone and F = min S / max S.
Modes (QoS off, the FIFO scheduler in front, as in fig9.py):
  off          no stage (ReFlex's behaviour)
  fair_share   the stage, fair_share, be_device_depth_max 8 for reads, 4 for writes
  backwarding  the stage, backwarding with B = 2 fixed, be_device_depth_max 6
  inter        (with THREADS=2) the stage in arrival order at depth 4, dense flows' reads
               migrating to the other thread (OctoFAS Algorithm 2)
  hybrid       (with THREADS=2) backwarding with B = 20 at depth 4 and migration (Algorithm 4)
Then the LC check: Figure 5 scenario 1 and scenario 2 (with slo_headroom_us = 100, as
docs/BENCHMARKS.md measured it) at 1/10 scale, QoS on, the LC tenants' SLOs, stage off against
fair_share at depth 4, RUNS runs each (LC_WARMUP_S + LC_DURATION_S); besides the bench's p95,
the server's own read p95 per 1 s statistics window (GET /v1/stats, polled during the runs),
which the client threads' scheduling delays do not reach.

Each figure is the median of RUNS runs; every run is WARMUP_S + DURATION_S (≤ 10 s), and the
whole script stays under 10 minutes with the defaults. One reflexd per configuration, on a
free loopback port, started from this script and stopped by it; the configurations compared
run side by side and their runs alternate (off, on, off, on, ...), so that the machine's load
drifting over time (it is shared) does not favour one of them.

Usage (from the repository root, after
`cargo build --release -p reflex-server -p reflex-cli`):
    scenarios/fig9-server.py                 # markdown tables to stdout, progress to stderr
Environment: RUNS (3), DURATION_S (3), WARMUP_S (0.5), DENSE ("8 14"), READ_PERCENTS
("100 0"), MODES ("off fair_share backwarding"), THREADS (1; reflexd's dataplane threads),
LC_CHECK (1; 0 skips it), LC_WARMUP_S (2), LC_DURATION_S (5), REFLEXD, REFLEX (target/release/...),
JSON_OUT (a file for every run's figures as JSON), PIN ("" or e.g. "0:1": reflexd on CPU 0,
the bench on CPU 1, with taskset)
"""
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REFLEXD = os.environ.get("REFLEXD", "target/release/reflexd")
REFLEX = os.environ.get("REFLEX", "target/release/reflex")
RUNS = int(os.environ.get("RUNS", "3"))
DURATION_S = float(os.environ.get("DURATION_S", "3"))
WARMUP_S = float(os.environ.get("WARMUP_S", "0.5"))
DENSE = [int(x) for x in os.environ.get("DENSE", "8 14").split()]
READ_PERCENTS = [int(x) for x in os.environ.get("READ_PERCENTS", "100 0").split()]
MODES = os.environ.get("MODES", "off fair_share backwarding").split()
THREADS = int(os.environ.get("THREADS", "1"))
LC_CHECK = os.environ.get("LC_CHECK", "1") == "1"
LC_DURATION_S = float(os.environ.get("LC_DURATION_S", "5"))
LC_WARMUP_S = float(os.environ.get("LC_WARMUP_S", "2"))
JSON_OUT = os.environ.get("JSON_OUT")
# "SERVER_CPUS:CLIENT_CPUS" for taskset (as bench/overload.sh pins them), e.g. "0:1"; empty:
# no pinning.
PIN = os.environ.get("PIN", "")
SPARSE_DEPTH = 2
PROFILE = os.path.abspath("profiles/device-a-small.toml")

assert WARMUP_S + DURATION_S <= 10, "each run is bounded to 10 s"
assert LC_WARMUP_S + LC_DURATION_S <= 10


def fairness_table(mode, read_percent):
    """The [qos_config.fairness] table of a mode (None: the stage off)."""
    if mode == "off":
        return None
    if mode == "fair_share":
        depth = 8 if read_percent > 0 else 4
        return {"mode": "fair_share", "be_device_depth_max": depth}
    if mode == "backwarding":
        return {"mode": "backwarding", "backwardings": 2, "be_device_depth_max": 6}
    # Inter-core migration (OctoFAS Algorithms 2 and 4; THREADS=2): dense flows' reads are
    # served by the other thread's device places, as the simulator's Figure 9 runs them.
    migration = {"enabled": True, "flows": "dense", "requires_imbalance": False}
    if mode == "inter":
        return {"mode": "fifo", "be_device_depth_max": 4, "migration": migration}
    if mode == "hybrid":
        return {"mode": "backwarding", "backwardings": 20, "be_device_depth_max": 4,
                "migration": migration}
    raise SystemExit(f"unknown mode {mode}")


def toml_value(value):
    """A TOML value: JSON's scalars are TOML's; a dict is an inline table."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def pinned(side):
    """The taskset prefix for the server (0) or the bench (1), if PIN asks for one."""
    if not PIN:
        return []
    return ["taskset", "-c", PIN.split(":")[side]]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A reflexd on a free loopback port; stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, qos, fairness, headroom_us=None):
        self.port = free_port()
        self.admin_port = free_port()
        self.dir = tempfile.mkdtemp(prefix="fig9-server-")
        text = f'''listen = "127.0.0.1"
port = {self.port}
original_ports = []
threads = {THREADS}
qos = {"true" if qos else "false"}
[nbd]
enabled = false
[nvme_tcp]
enabled = false
[admin]
listen = "127.0.0.1:{self.admin_port}"
stats_window = "1s"
state_file = "{os.path.join(self.dir, 'state.json')}"
[[namespace]]
id = 1
backend = "emu:device-a-small"
size_bytes = "1G"
profile = "{PROFILE}"
'''
        if headroom_us is not None or fairness is not None:
            text += "[qos_config]\n"
            if headroom_us is not None:
                text += f"slo_headroom_us = {headroom_us}\n"
            if fairness is not None:
                text += "[qos_config.fairness]\n"
                for key, value in fairness.items():
                    text += f"{key} = {toml_value(value)}\n"
        self.config = os.path.join(self.dir, "reflexd.toml")
        with open(self.config, "w") as f:
            f.write(text)
        self.log = open(os.path.join(self.dir, "reflexd.log"), "w")

    def __enter__(self):
        self.process = subprocess.Popen(
            pinned(0) + [REFLEXD, "--config", self.config], stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"reflexd exited: {open(self.log.name).read()}")
            try:
                socket.create_connection(("127.0.0.1", self.admin_port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise SystemExit("reflexd did not start listening within 10 s")

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


class StatsPoller:
    """Reads GET /v1/stats once per second while a run goes on: each tenant's read p95 per
    statistics window as the server measures it (arrival off the socket to the answer
    leaving), which the bench threads' own scheduling delays do not reach."""

    def __init__(self, server):
        self.url = f"http://127.0.0.1:{server.admin_port}/v1/stats"
        self.windows = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)

    def poll(self):
        seen = set()
        while not self.stop.wait(1.0):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as answer:
                    stats = json.load(answer)
            except OSError:
                continue
            if stats["windows"] in seen:
                continue
            seen.add(stats["windows"])
            for tenant in stats["tenants"]:
                window = tenant["window"]
                if window["reads"] >= 20:  # as the server judges SLO windows
                    self.windows.setdefault(tenant["handle"], []).append(
                        window["read_latency_us"]["p95"])

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


class FairnessPeek:
    """Reads GET /v1/fairness once, halfway through a run: on which dataplane thread's stage
    each tenant's requests are (with several threads, connections are spread by the kernel's
    SO_REUSEPORT hash, and a stage orders only the flows of its own thread)."""

    def __init__(self, server):
        self.url = f"http://127.0.0.1:{server.admin_port}/v1/fairness"
        self.view = None
        self.thread = threading.Thread(target=self.peek, daemon=True)

    def peek(self):
        time.sleep(WARMUP_S + DURATION_S / 2)
        try:
            with urllib.request.urlopen(self.url, timeout=2) as answer:
                self.view = json.load(answer)
        except OSError:
            pass

    def threads_of(self, handle):
        """The threads whose stage holds or judged the tenant `handle`."""
        found = set()
        for namespace in (self.view or {}).get("namespaces", []):
            for thread in namespace["threads"]:
                for flow in thread["flows"]:
                    if flow["handle"] == f"{handle:016x}":
                        found.add(thread["thread"])
        return found

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.thread.join()


def scenario_text(flows, read_percent):
    """flows: (name, depth, rt_alone_us or None)."""
    text = f'''name = "fig9-server"
seed = 1
threads = 1
qos = false
warmup_ms = {int(WARMUP_S * 1000)}
duration_ms = {int(DURATION_S * 1000)}
[device]
emulated = "device-a-small"
profile = "{PROFILE}"
'''
    for name, depth, alone in flows:
        text += f'''
[[tenant]]
name = "{name}"
class = "be"
read_percent = {read_percent}
load = {{ closed_depth = {depth} }}
'''
        if alone is not None:
            text += f"rt_alone_us = {alone}\n"
    return text


def bench(server, text, extra=()):
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        out = subprocess.run(
            pinned(1) + [REFLEX, "bench", "--server", f"127.0.0.1:{server.port}",
                         "--scenario", path, "--json", "--quiet", *extra],
            capture_output=True, text=True, timeout=60,
        )
    finally:
        os.unlink(path)
    if out.returncode != 0:
        raise SystemExit(f"reflex bench failed: {out.stderr}\nreflexd: "
                         f"{open(server.log.name).read()[-2000:]}")
    return json.loads(out.stdout)


def median(values):
    return statistics.median(values) if values else float("nan")


def progress(message):
    print(message, file=sys.stderr, flush=True)


def summary(runs):
    """Medians over the runs of a mode and k."""
    return {
        "fairness": median([r["fairness"] for r in runs]),
        "fairness_runs": [round(r["fairness"], 3) for r in runs],
        "slowdown_sparse": median([r["tenants"][0]["slowdown"] for r in runs]),
        "slowdown_dense": median([r["tenants"][1]["slowdown"] for r in runs]),
        "iops_sparse": median([r["tenants"][0]["iops"] for r in runs]),
        "iops_dense": median([r["tenants"][1]["iops"] for r in runs]),
        "iops_total": median([r["iops_total"] for r in runs]),
        "errors": sum(t["errors"] for r in runs for t in r["tenants"]),
        # Per run, with the stage on: both flows on one thread's stage (None: not seen).
        "same_thread_runs": [r.get("same_thread") for r in runs],
    }


def fig9():
    results = {}
    for read_percent in READ_PERCENTS:
        # 1. Alone: each flow with the device to itself, stage off, QoS off.
        alone = {}
        alone_iops = {}
        with Server(qos=False, fairness=None) as server:
            for name, depth in [("sparse", SPARSE_DEPTH)] + [(f"dense{k}", k) for k in DENSE]:
                rts, iops = [], []
                for _ in range(RUNS):
                    report = bench(server, scenario_text([(name, depth, None)], read_percent))
                    rts.append(report["tenants"][0]["rt_us"])
                    iops.append(report["tenants"][0]["iops"])
                alone[name] = median(rts)
                alone_iops[name] = median(iops)
                progress(f"{read_percent} % reads, {name} alone: RT {alone[name]:.1f} µs, "
                         f"{alone_iops[name]:.0f} IOPS (runs {[round(r, 1) for r in rts]})")
        results[read_percent] = {"alone_rt_us": alone, "alone_iops": alone_iops, "modes": {}}
        # 2. Both flows, per k: one server per mode, all started at once, and the modes'
        # runs interleaved (mode 1, mode 2, ..., then again), so that the machine's load
        # drifting over time does not favour one mode.
        with contextlib.ExitStack() as stack:
            servers = {mode: stack.enter_context(
                Server(qos=False, fairness=fairness_table(mode, read_percent)))
                for mode in MODES}
            for k in DENSE:
                flows = [("sparse", SPARSE_DEPTH, alone["sparse"]),
                         ("dense", k, alone[f"dense{k}"])]
                runs = {mode: [] for mode in MODES}
                for _ in range(RUNS):
                    for mode in MODES:
                        with FairnessPeek(servers[mode]) as peek:
                            report = bench(servers[mode], scenario_text(flows, read_percent))
                        # With the stage on: whether both flows were on one thread's stage.
                        placed = [peek.threads_of(t["handle"]) for t in report["tenants"]]
                        report["same_thread"] = (
                            None if not all(placed) else len(set().union(*placed)) == 1)
                        runs[mode].append(report)
                for mode in MODES:
                    row = summary(runs[mode])
                    results[read_percent]["modes"].setdefault(mode, {})[k] = row
                    progress(f"{read_percent} % reads, {mode}, k = {k}: F {row['fairness']:.2f} "
                             f"(runs {row['fairness_runs']}), total {row['iops_total']:.0f} IOPS, "
                             f"one thread {row['same_thread_runs']}")
    return results


def lc_check():
    """Figure 5 scenarios 1 and 2 (1/10 scale, QoS on): LC p95 with the stage off and on."""
    rows = []
    for scenario, headroom in [("scenarios/fig5-small-scenario1.toml", None),
                               ("scenarios/fig5-small-scenario2.toml", 100)]:
        with open(scenario) as f:
            text = f.read().replace(
                'profile = "../profiles/device-a-small.toml"', f'profile = "{PROFILE}"')
        modes = [("off", None),
                 ("fair_share 4", {"mode": "fair_share", "be_device_depth_max": 4})]
        reports = {mode: [] for mode, _ in modes}
        server_p95 = {mode: {} for mode, _ in modes}
        # Both servers at once and their runs interleaved, as in fig9().
        with contextlib.ExitStack() as stack:
            servers = {mode: stack.enter_context(
                Server(qos=True, fairness=fairness, headroom_us=headroom))
                for mode, fairness in modes}
            for _ in range(RUNS):
                for mode, _ in modes:
                    with StatsPoller(servers[mode]) as poller:
                        report = bench(servers[mode], text, [
                            "--scenario-duration", f"{LC_DURATION_S}s",
                            "--scenario-warmup", f"{LC_WARMUP_S}s"])
                    reports[mode].append(report)
                    # Scenario tenants register without a name: match them by handle.
                    for tenant in report["tenants"]:
                        server_p95[mode].setdefault(tenant["name"], []).extend(
                            poller.windows.get(f"{tenant['handle']:016x}", []))
        for mode, _ in modes:
            row = {"scenario": os.path.basename(scenario), "headroom_us": headroom,
                   "mode": mode, "tenants": {}}
            for index, tenant in enumerate(reports[mode][0]["tenants"]):
                runs = [report["tenants"][index] for report in reports[mode]]
                windows = server_p95[mode].get(tenant["name"], [])
                row["tenants"][tenant["name"]] = {
                    "iops": median([t["iops"] for t in runs]),
                    "read_p95_us": median([t["read"]["p95_us"] for t in runs]),
                    "read_p95_us_runs": [round(t["read"]["p95_us"]) for t in runs],
                    "slo_met": sum(1 for t in runs if t["slo_met"]),
                    # The server's read p95 per 1 s window (warm-up included): median, worst.
                    "server_window_p95_us": median(windows),
                    "server_window_p95_us_max": max(windows, default=0),
                    "server_windows": len(windows),
                }
            rows.append(row)
            progress(f"LC check {row['scenario']} {mode}: " + ", ".join(
                f"{n} p95 {t['read_p95_us_runs']} µs (server {t['server_window_p95_us']:.0f}) "
                f"{t['iops']:.0f} IOPS met {t['slo_met']}"
                for n, t in row["tenants"].items()))
    return rows


def placement(row):
    """yes/no per run: both flows on one thread's stage (- when the stage is off)."""
    marks = {True: "yes", False: "no", None: "-"}
    return ", ".join(marks[same] for same in row["same_thread_runs"])


def print_tables(results, lc_rows):
    print(f"# Figure 9 on reflexd (emu:device-a-small, {THREADS} dataplane thread(s), QoS off; "
          f"medians of {RUNS} runs of {WARMUP_S} s + {DURATION_S} s; "
          f"pinning {PIN or 'none'})")
    for read_percent, result in results.items():
        print(f"\n## {read_percent} % reads\n")
        alone = result["alone_rt_us"]
        print("alone: " + ", ".join(
            f"{name} RT {rt:.1f} µs ({result['alone_iops'][name]:.0f} IOPS)"
            for name, rt in alone.items()))
        print("\n| mode | dense k | S sparse | S dense | F (runs) | sparse IOPS | dense IOPS "
              "| total IOPS | total / off | flows on one thread (runs) |")
        print("|---|---:|---:|---:|---|---:|---:|---:|---:|---|")
        for mode, by_k in result["modes"].items():
            for k, row in by_k.items():
                off = result["modes"].get("off", {}).get(k)
                ratio = f"{row['iops_total'] / off['iops_total']:.3f}" if off else "-"
                runs = ", ".join(f"{f:.2f}" for f in row["fairness_runs"])
                print(f"| {mode} | {k} | {row['slowdown_sparse']:.2f} | "
                      f"{row['slowdown_dense']:.2f} | **{row['fairness']:.2f}** ({runs}) | "
                      f"{row['iops_sparse']:.0f} | {row['iops_dense']:.0f} | "
                      f"{row['iops_total']:.0f} | {ratio} | {placement(row)} |")
    if lc_rows:
        print(f"\n## LC tenants with the stage (QoS on; medians of {RUNS} runs of "
              f"{LC_WARMUP_S} s + {LC_DURATION_S} s)\n")
        print(f"| scenario | stage | A p95 µs (SLO 500) | B p95 µs (SLO 500) | A / B met "
              f"(of {RUNS}) | server's A / B p95 µs, median (worst) of 1 s windows "
              f"| A / B IOPS | C / D IOPS |")
        print("|---|---|---:|---:|---|---|---:|---:|")
        for row in lc_rows:
            t = row["tenants"]
            name = row["scenario"] + (f", headroom {row['headroom_us']} µs"
                                      if row["headroom_us"] else "")
            print(f"| {name} | {row['mode']} | {t['A']['read_p95_us']:.0f} | "
                  f"{t['B']['read_p95_us']:.0f} | {t['A']['slo_met']} / {t['B']['slo_met']} | "
                  f"{t['A']['server_window_p95_us']:.0f} ({t['A']['server_window_p95_us_max']}) / "
                  f"{t['B']['server_window_p95_us']:.0f} ({t['B']['server_window_p95_us_max']}) | "
                  f"{t['A']['iops']:.0f} / {t['B']['iops']:.0f} | "
                  f"{t['C']['iops']:.0f} / {t['D']['iops']:.0f} |")


def main():
    started = time.monotonic()
    results = fig9()
    lc_rows = lc_check() if LC_CHECK else []
    print_tables(results, lc_rows)
    if JSON_OUT:
        with open(JSON_OUT, "w") as f:
            json.dump({"fig9": results, "lc": lc_rows}, f, indent=1)
    progress(f"fig9-server: {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
