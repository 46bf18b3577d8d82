"""Two installs of the pack against each other in one run: the same 2-process throughput worker, alternating.

Each install is a Python interpreter whose environment holds a version of ``lightning_mgpu`` (a virtualenv with the
release you compare against, ``pip install git+...@<commit>`` or a checkout installed into it). Every round runs
``benchmarks/ddp_throughput.py --worker CONFIG`` once under each interpreter, in the order A B on even rounds and
B A on odd ones, with nothing on ``PYTHONPATH``, so each imports its own ``lightning_mgpu``; the ratio B / A of
samples per second is taken round by round, and its median and range printed.

    python benchmarks/compare_installs.py --a /tmp/wave1/bin/python --b .venv/bin/python --rounds 10
    python benchmarks/compare_installs.py --a .venv/bin/python --b .venv/bin/python --config-b mgpu_no_hang_watch
"""

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from _common import LAUNCHER_ENV_VARS, describe_machine

HERE = Path(__file__).resolve().parent
RESULT_PREFIX = "BENCHMARK_RESULT "


def throughput(python: str, config: str, args: argparse.Namespace) -> float:
    """One fresh 2-process fit under ``python``: samples per second after the warm-up."""
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_ENV_VARS, "PYTHONPATH")}
    env["OMP_NUM_THREADS"] = "1"
    command = [python, str(HERE / "ddp_throughput.py"), "--worker", config, "--steps", str(args.steps)]
    command += ["--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=HERE, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])["samples_per_s"]
    raise RuntimeError(f"{python} {config} produced no result:\n{done.stderr[-3000:]}")


def version(python: str) -> str:
    code = "import lightning_mgpu, os; print(os.path.dirname(lightning_mgpu.__file__))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=HERE).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="the interpreter of install A (the baseline)")
    parser.add_argument("--b", required=True, help="the interpreter of install B")
    parser.add_argument("--config", default="mgpu", help="a ddp_throughput.py configuration both installs run")
    parser.add_argument("--config-b", default=None, help="B's configuration, if it differs from --config")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    config_b = args.config_b or args.config
    print(f"machine: {describe_machine()}")
    print(f"A: {args.a} ({version(args.a)}), {args.config}\nB: {args.b} ({version(args.b)}), {config_b}")
    ratios = []
    for index in range(args.rounds):
        runs = [("A", args.a, args.config), ("B", args.b, config_b)]
        measured = {
            label: throughput(python, config, args) for label, python, config in runs[:: 1 if index % 2 == 0 else -1]
        }
        ratios.append(measured["B"] / measured["A"])
        order = "A B" if index % 2 == 0 else "B A"
        figures = f"A {measured['A']:,.0f}  B {measured['B']:,.0f} samples/s  B/A {ratios[-1]:.3f}"
        print(f"round {index + 1} ({order}): {figures}")
    below = sum(ratio < 1 for ratio in ratios)
    print(
        f"B/A median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); "
        f"{below} of {len(ratios)} rounds below 1"
    )


if __name__ == "__main__":
    main()
