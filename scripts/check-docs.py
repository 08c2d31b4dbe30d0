#!/usr/bin/env python3
"""Docs that are true: every command in README.md and docs/ (fenced sh/bash blocks and inline
code spans that start with a ReFlex program or script) is checked, and the short ones run.

- `reflexd ARGS` (also `cargo run ... --bin reflexd -- ARGS`): run as `reflexd ARGS --check-config`
  (flags, configuration files and profiles are valid), expecting exit 0.
- `reflex admin ...`: run verbatim, in document order, against a live reflexd (REFLEX_ADMIN
  points at it); `--watch` runs 3 s and must have printed a table.
- other `reflex SUBCOMMAND ...` and `reflex-sim ...`: run with `--help` appended, which checks
  that the subcommand and every flag before it exist (clap stops at the first unknown one).
- `bench/*.sh`, `scripts/*.sh`: exist and are executable (they are long; not run here).
- other programs (nbdinfo, fio, ...): installed.
- every argument naming a file of the repository (scenarios/, configs/, profiles/, ...) exists.
Commands with placeholders (`PATH`, `<file>`, `…`) are listed as skipped.
Usage: scripts/check-docs.py   (after `cargo build --release`)
"""
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
BIN = os.path.join(ROOT, "target", "release")
PROGRAMS = ("reflex", "reflexd", "reflex-sim", "cargo", "nbdinfo", "nbdcopy", "nbdsh", "fio",
            "qemu-io", "qemu-img", "promtool", "prometheus", "systemd-analyze", "curl")
REPO_DIRS = ("scenarios/", "configs/", "profiles/", "docs/", "bench/", "scripts/", "deploy/",
             "crates/")
PLACEHOLDER = re.compile(r"<[^>]*>|…|\.\.\.|\b(PATH|FILE|NAME|SIZE|ID|PORT|HOST|URI|SECS|N|NS|US|P|BACKEND|TENANT|ADDR|NQN|SOCK|SERIAL|CONF|OFFSET|SECONDS|URL)\b|\[|\|")


def commands():
    files = ["README.md"] + sorted(glob.glob("docs/**/*.md", recursive=True))
    for path in files:
        text = open(path, encoding="utf-8").read()
        for block in re.finditer(r"```(?:sh|bash|shell|console)\n(.*?)```", text, re.S):
            joined = block.group(1).replace("\\\n", " ")
            for line in joined.splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    yield path, line, "block"
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        # A paragraph that lists what is not built yet names commands that do not exist.
        paragraphs = re.split(r"\n\s*\n", prose)
        prose = "\n\n".join(p for p in paragraphs
                              if not re.match(r"\s*(not built yet|not yet built|left to do)", p, re.I))
        for span in re.findall(r"`([^`\n]+)`", prose):
            words = span.split()
            if not words:
                continue
            first = words[0]
            if first in ("reflex", "reflexd", "reflex-sim") and len(words) > 1 or (
                re.match(r"^(bench|scripts)/[\w.-]+\.(sh|py)$", first)
            ):
                yield path, span.strip(), "inline"


def program_of(words):
    index = 0
    while index < len(words) and re.match(r"^[A-Z_][A-Z0-9_]*=", words[index]):
        index += 1
    return words[index:] if index < len(words) else []


def start_reflexd(work):
    log = open(os.path.join(work, "reflexd.log"), "w+")
    process = subprocess.Popen(
        [os.path.join(BIN, "reflexd"), "--config", "configs/reflexd-small.toml", "--port", "0",
         "--no-nbd", "--no-original", "--no-nvme-tcp", "--admin-listen", "127.0.0.1:0",
         "--state-file", os.path.join(work, "state.json")],
        stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 30
    while time.time() < deadline:
        log.seek(0)
        found = re.search(r"admin API listening.*addr=(\S+)", log.read())
        if found:
            return process, "http://" + found.group(1)
        if process.poll() is not None:
            break
        time.sleep(0.1)
    log.seek(0)
    sys.exit("reflexd did not start:\n" + log.read())


def run(argv, env=None, timeout=60):
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, timeout=timeout)


def main():
    failures, checked, skipped = [], 0, []
    work = tempfile.mkdtemp(prefix="reflex-docs-")
    server, api = start_reflexd(work)
    env = dict(os.environ, REFLEX_ADMIN=api, RUST_BACKTRACE="0")
    seen = set()
    try:
        for path, line, kind in commands():
            if (line, kind) in seen and " admin " not in f" {line} ":
                continue
            seen.add((line, kind))
            if PLACEHOLDER.search(line):
                skipped.append(f"{path}: {line}")
                continue
            try:
                words = shlex.split(line)
            except ValueError:
                skipped.append(f"{path}: {line}")
                continue
            words = [w for w in words if w != "&"]
            argv = program_of(words)
            if not argv:
                continue
            program = argv[0]
            base = os.path.basename(program)
            problem = None
            for word in argv[1:]:
                candidate = word.split("=", 1)[-1].split(",", 1)[0]
                if (candidate.startswith(REPO_DIRS) and not glob.glob(candidate)
                        and not os.path.isdir(os.path.dirname(candidate) or ".")):
                    problem = f"{candidate} does not exist"
            if problem is None and kind == "inline" and base in ("reflex", "reflexd", "reflex-sim"):
                # A mention in prose: the subcommand exists and so does every flag it names.
                words_after = argv[1:]
                if base == "reflexd" and words_after and not words_after[0].startswith("-"):
                    skipped.append(f"{path}: {line}")
                    continue
                subcommands = []
                for word in words_after:
                    if word.startswith("-") or base != "reflex":
                        break
                    subcommands.append(word)
                result = run([os.path.join(BIN, base), *subcommands, "--help"], env)
                if result.returncode != 0:
                    problem = result.stdout
                else:
                    for word in words_after:
                        # `--a/--b` in prose names two flags.
                        for flag in word.split("=", 1)[0].split("/"):
                            if flag.startswith("-") and not re.search(
                                    re.escape(flag) + r"\b", result.stdout):
                                problem = f"{flag} is not a flag of {base} {' '.join(subcommands)}"
            elif problem is None:
                if program in ("cargo",) and "--bin" in argv and "reflexd" in argv:
                    extra = argv[argv.index("--") + 1:] if "--" in argv else []
                    result = run([os.path.join(BIN, "reflexd"), *extra, "--check-config"], env)
                    problem = None if result.returncode == 0 else result.stdout
                elif base == "reflexd":
                    check = [] if "--check-config" in argv else ["--check-config"]
                    result = run([os.path.join(BIN, "reflexd"), *argv[1:], *check], env)
                    problem = None if result.returncode == 0 else result.stdout
                elif base == "reflex" and len(argv) > 1 and argv[1] == "admin":
                    if "--watch" in argv:
                        try:
                            result = run([os.path.join(BIN, "reflex"), *argv[1:]], env, timeout=3)
                            problem = f"--watch ended: {result.stdout}"
                        except subprocess.TimeoutExpired as expired:
                            out = expired.stdout or b""
                            out = out.decode() if isinstance(out, bytes) else out
                            problem = None if "window" in out else f"no table: {out!r}"
                    else:
                        result = run([os.path.join(BIN, "reflex"), *argv[1:]], env)
                        problem = None if result.returncode == 0 else result.stdout
                elif base in ("reflex", "reflex-sim"):
                    result = run([os.path.join(BIN, base), *argv[1:], "--help"], env)
                    problem = None if result.returncode == 0 else result.stdout
                elif re.match(r"^(bench|scripts)/", program):
                    if not os.access(program, os.X_OK):
                        problem = f"{program} is missing or not executable"
                elif base in PROGRAMS or program.startswith("target/"):
                    exists = (os.access(program, os.X_OK) if "/" in program
                              else any(os.access(os.path.join(d, program), os.X_OK)
                                       for d in os.environ.get("PATH", "").split(":")))
                    if not exists:
                        problem = f"{program} is not installed"
                else:
                    skipped.append(f"{path}: {line}")
                    continue
            checked += 1
            if problem:
                failures.append(f"{path}: `{line}`: {problem.strip()[:400]}")
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"check-docs: {checked} commands checked, {len(skipped)} skipped (placeholders or "
          f"not a ReFlex command), {len(failures)} failed")
    if os.environ.get("VERBOSE"):
        for line in skipped:
            print("  skipped:", line)
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
