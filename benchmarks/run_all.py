"""Run every benchmark of the pack and write their ratios against stock Lightning as a markdown table and a plot.

    python benchmarks/run_all.py                    # every benchmark at its own defaults: an hour or more on 2 cores
    python benchmarks/run_all.py --quick            # short settings (QUICK below), about 8 minutes on 2 cores
    python benchmarks/run_all.py --only ddp_throughput callback_overhead --rounds 5

Each benchmark runs as ``python benchmarks/<name>.py [its arguments] --json-out FILE`` in a fresh process, its
output streamed here. The rows it writes are ratios against a baseline measured in that same run (the scripts
alternate configurations over rounds): nothing here compares numbers across runs. Writes ``latest.md`` (machine,
date, command, the table, each benchmark's command and time) and ``latest.png`` into ``benchmarks/results/`` or
``--out``. A benchmark that cannot run here is listed as skipped with the reason; one that fails is listed as
failed, with the last lines of its output printed, the others still run, and the exit status is 1.
"""

import argparse
import collections
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from _common import Row, describe_machine, read_rows
from _report import markdown_table, plot

HERE = Path(__file__).resolve().parent
# name: arguments of --quick. Starting a worker (about 5 s of imports a process) costs more than the steps, so
# quick keeps enough steps to time and 2 rounds where that fits: about 8 minutes in all on 2 cores
QUICK = {
    "ddp_throughput": ["--rounds", "2", "--steps", "80"],
    "step_profile": ["--rounds", "2", "--steps", "60"],
    "powersgd_accuracy": ["--epochs", "2"],
    "callback_overhead": ["--rounds", "2", "--steps", "60"],
    "memory_monitor_overhead": ["--rounds", "2", "--steps", "100"],
    "performance_monitor_overhead": ["--rounds", "2", "--steps", "100"],
    "oom_backoff": ["--rounds", "2", "--steps", "60"],
    # 300 steps is the least that lets "auto" tune (10 x its 30 tuning steps); the large model would add 7 minutes
    "bucket_tuning": ["--models", "small", "--rounds", "1", "--steps", "300"],
}
NO_ROUNDS = {"powersgd_accuracy"}  # trains each configuration once
NEEDS = {"powersgd_accuracy": {"sklearn": "scikit-learn, the bench extra: pip install -e '.[bench]'"}}
TAIL_LINES = 30


def arguments(name: str, args: argparse.Namespace) -> list[str]:
    """The benchmark's command-line arguments: --quick's, then --rounds where the script takes it."""
    extra = list(QUICK[name]) if args.quick else []
    if args.rounds is not None:
        if name in NO_ROUNDS:
            print(f"note: {name} takes no --rounds (it trains each configuration once)")
        else:
            extra += ["--rounds", str(args.rounds)]
    return extra


def run(command: list[str]) -> tuple[int, list[str]]:
    """Run ``command`` from the repository root, stream its output here; return its exit status and last lines."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        command, cwd=HERE.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        for line in process.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip("\n"))
    return process.returncode, list(tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short settings for every benchmark, about 8 minutes")
    parser.add_argument("--only", nargs="+", choices=list(QUICK), metavar="NAME", help=f"among {', '.join(QUICK)}")
    parser.add_argument("--rounds", type=int, help="rounds for every benchmark that takes --rounds")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where latest.md and latest.png go")
    args = parser.parse_args()
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    names = args.only or list(QUICK)
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now().astimezone()

    rows: list[Row] = []
    not_run: dict[str, str] = {}
    runs: list[str] = []  # lines of the markdown's list of commands
    failures: list[tuple[str, list[str]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            missing = [why for module, why in NEEDS.get(name, {}).items() if importlib.util.find_spec(module) is None]
            if missing:
                not_run[name] = f"skipped: needs {', '.join(missing)}"
                print(f"\n=== {name}: {not_run[name]}", flush=True)
                runs.append(f"- `{name}`: {not_run[name]}")
                continue
            json_out = Path(tmp) / f"{name}.json"
            command = [sys.executable, str(HERE / f"{name}.py"), *arguments(name, args), "--json-out", str(json_out)]
            shown = shlex.join(["python", f"benchmarks/{name}.py", *command[2:-2]])
            print(f"\n=== {name}: {shown}", flush=True)
            start = time.perf_counter()
            status, tail = run(command)
            seconds = time.perf_counter() - start
            if status != 0:
                not_run[name] = f"failed: exit status {status}; {tail[-1] if tail else 'no output'}"
                failures.append((name, tail))
            elif not json_out.exists():  # a script that decides it cannot run here says why and exits 0
                not_run[name] = f"skipped: {tail[-1] if tail else 'no output'}"
            else:
                rows += read_rows(json_out)
            outcome = not_run.get(name, "ok").split(":")[0]
            runs.append(f"- `{name}`: `{shown}`, {seconds / 60:.1f} min, {outcome}")
            print(f"=== {name}: {outcome} in {seconds / 60:.1f} min", flush=True)

    machine = describe_machine()
    command = shlex.join(["python", *sys.argv])
    minutes = (datetime.now().astimezone() - started).total_seconds() / 60
    report = [
        "# Benchmark ratios against stock Lightning",
        "",
        f"- **Machine:** {machine}",
        f"- **Date:** {started:%Y-%m-%d %H:%M %Z}, {minutes:.1f} minutes",
        f"- **Command:** `{command}`",
        "",
        "Each ratio is against its baseline measured in the same run (alternating rounds), never across runs.",
        "Figures move by about 20% from run to run on shared machines"
        + (", and `--quick` runs few rounds: read its ratios as a smoke test." if args.quick else "."),
        "",
        markdown_table(rows, not_run),
        "![Ratios as speed relative to the baseline](latest.png)",
        "",
        "## Runs",
        "",
        *runs,
        "",
    ]
    (args.out / "latest.md").write_text("\n".join(report))
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwrote {args.out / 'latest.md'}; no plot: matplotlib is missing (pip install -e '.[bench]')")
    else:
        plot(rows, args.out / "latest.png", f"{machine}\n{started:%Y-%m-%d}: {command}")
        print(f"\nwrote {args.out / 'latest.md'} and {args.out / 'latest.png'}")

    for name, tail in failures:
        print(f"\nFAILED {name}; last lines of its output:\n" + "\n".join(f"    {line}" for line in tail))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
