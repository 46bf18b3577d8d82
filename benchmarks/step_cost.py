"""Per-step cost of the strategy and of each callback, counted where a clock cannot see it: calls and instructions.

On these 2-core machines a wall-clock ratio moves by 10% from round to round; what a steady training step executes
does not. Each configuration trains a fixed fit on 2 gloo processes (an MLP 32-64-64-10 on synthetic data, batch 8 a
process, SGD, one thread a process), and rank 0 traces the optimizer steps 20 to 40 with ``sys.settrace``: every
Python function call, and every bytecode instruction executed (``f_trace_opcodes``), in the training thread (a
monitor's sampler thread is not traced). The counts are the same from run to run, whatever else the machine does,
with one exception: a callback that torch runs when a gloo all-reduce completes (PerformanceMonitor's timing,
OOMBackoff's failure flag) runs in the training thread when the collective has already finished and in gloo's
thread otherwise, so up to about 1.5 calls and 25 instructions a step of theirs are counted on some runs only.

Configurations: ``stock_ddp`` (Lightning's ``strategy="ddp"``), ``mgpu``, ``mgpu`` with each of the pack's callbacks
alone, and ``mgpu_all`` with all of them. ``benchmarks/step_cost_budgets.json`` holds a budget for each
(``tests/test_step_cost.py`` fails on a change that goes over, printing the functions that grew against
``benchmarks/step_cost_baseline.json``); the table this prints is the one the docs quote.

    python benchmarks/step_cost.py                        # the counts, against the budgets
    python benchmarks/step_cost.py --wall-rounds 3        # and each configuration's wall-clock ratio to mgpu
    python benchmarks/step_cost.py --callgrind 3          # and machine instructions per step (valgrind), 3 runs
    python benchmarks/step_cost.py --write-baseline       # record the profile (and versions) the test compares with
    python benchmarks/step_cost.py --write-baseline --wall-rounds 3 --markdown docs/performance.md
                                           # the table into the docs' page, from the run that records the baseline

``--callgrind`` runs rank 0 of ``stock_ddp`` and ``mgpu`` under ``valgrind --tool=callgrind`` (Debian's
``valgrind``), instrumenting only the traced window's steps (``callgrind_control`` turns it on and off, so the window
includes a little of that command's own start-up), counts the training thread's machine instructions, and repeats
each run to show how stable the figure is. About a minute a run here: not part of CI.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _common import (
    LAUNCHER_ENV_VARS,
    add_json_out,
    batch_clock,
    classifier_module,
    describe_machine,
    mlp,
    ratio_row,
    run_worker,
    synthetic_dataset,
    write_rows,
)

HERE = Path(__file__).resolve().parent
BUDGETS = HERE / "step_cost_budgets.json"
BASELINE = HERE / "step_cost_baseline.json"
CALLBACKS = ("nan_skip", "gradient_clipping", "gpu_memory_monitor", "oom_backoff", "performance_monitor", "ema")
CONFIGS = ("stock_ddp", "mgpu", *(f"mgpu_{name}" for name in CALLBACKS), "mgpu_all")
WINDOW = (20, 40)  # optimizer steps traced: from the start of the first to the start of the second
WALL_RESULT = "STEP_COST_WALL "


def make_callbacks(config: str) -> tuple[str, list]:
    """The strategy name and the pack's callbacks of a configuration."""
    import lightning_mgpu as pack

    made = {
        "nan_skip": lambda: pack.NaNSkip(),
        "gradient_clipping": lambda: pack.GradientClipping(mode="norm", max_norm=1.0),
        "gpu_memory_monitor": lambda: pack.GPUMemoryMonitor(plot=False, warn_headroom_mb=None),
        "oom_backoff": lambda: pack.OOMBackoff(),
        "performance_monitor": lambda: pack.PerformanceMonitor(),
        "ema": lambda: pack.EMA(),
    }
    if config == "stock_ddp":
        return "ddp", []
    name = config.removeprefix("mgpu").removeprefix("_")
    if not name:
        return "mgpu", []
    return "mgpu", [build() for build in made.values()] if name == "all" else [made[name]()]


class Tracer:
    """Counts calls and bytecode instructions per code object while installed with ``sys.settrace``."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.instructions: Counter = Counter()

    def __call__(self, frame, event, arg):
        if event == "call":
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            self.calls[frame.f_code] += 1
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event == "opcode":
            self.instructions[frame.f_code] += 1
        return self._local


def function_name(code) -> str:
    """``path qualified.name`` of a code object: the path from site-packages, the standard library or the repository,
    and no line number, so that an edit elsewhere in the file does not rename it."""
    path = code.co_filename
    stdlib = os.path.dirname(os.__file__)
    for marker, prefix in (("site-packages/", ""), (f"{HERE.parent}/", ""), (f"{stdlib}/", "stdlib/")):
        if marker in path:
            path = prefix + path.split(marker, 1)[1]
            break
    return f"{path} {getattr(code, 'co_qualname', code.co_name)}"


def versions() -> dict[str, str]:
    """What the counts depend on besides the repository: Python's minor version, torch's and Lightning's."""
    import lightning
    import torch

    return {
        "python": ".".join(map(str, sys.version_info[:2])),
        "torch": torch.__version__.split("+")[0],
        "lightning": lightning.__version__,
    }


def small_fit(config: str, first, width: int = 64):
    """The counted fit of ``config`` (50 steps of the small MLP on 2 processes), with ``first`` as its first
    callback; returns the trainer."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    steps = WINDOW[1] + 2
    net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(16 * steps, 32, generator=generator), torch.randint(0, 10, (16 * steps,), generator=generator)
    )
    trainer = quiet_trainer(config, first, steps)
    trainer.fit(classifier_module(net), DataLoader(data, batch_size=8))
    return trainer


def quiet_trainer(config: str, first, steps: int):
    """A 2-process CPU Trainer of ``config``'s strategy and callbacks after ``first``: no logger, bar or checkpoint."""
    import lightning.pytorch as pl

    strategy, callbacks = make_callbacks(config)
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=[first, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def count_worker(configs: list[str], out: Path, width: int) -> None:
    """Train each configuration in turn in these 2 processes; rank 0 writes the counts of its window to ``out``."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    class Window(pl.Callback):  # listed first: traces from one batch start to another, a whole number of steps
        def __init__(self) -> None:
            self.tracer: Tracer | None = None
            self.batches = 0  # training batches started inside the window

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_rank != 0:
                return
            if trainer.global_step == WINDOW[1] and self.tracer is not None:
                sys.settrace(None)
            elif trainer.global_step == WINDOW[0] and self.tracer is None:
                self.tracer = Tracer()
                sys.settrace(self.tracer)
            if self.tracer is not None and trainer.global_step < WINDOW[1]:
                self.batches += 1

    torch.set_num_threads(1)
    results = {}
    for config in configs:
        window = Window()
        trainer = small_fit(config, window, width)
        if trainer.global_rank == 0:
            tracer, steps = window.tracer, WINDOW[1] - WINDOW[0]
            functions: dict[str, list[float]] = {}
            for code in tracer.calls.keys() | tracer.instructions.keys():
                entry = functions.setdefault(function_name(code), [0.0, 0.0])
                entry[0] += tracer.calls[code] / steps
                entry[1] += tracer.instructions[code] / steps
            results[config] = {
                "calls": sum(tracer.calls.values()) / steps,
                "instructions": sum(tracer.instructions.values()) / steps,
                "functions": functions,
                "batches": window.batches,
            }
    if dist.is_initialized():
        dist.destroy_process_group()  # stock DDP leaves its group to the interpreter's teardown, which can abort
    if results:
        out.write_text(json.dumps({"versions": versions(), "configs": results}, indent=0, sort_keys=True))


def count(configs: list[str], width: int = 64, timeout: float = 900) -> dict:
    """Run :func:`count_worker` afresh on 2 processes (Lightning launches rank 1) and return its counts."""
    # what else in the environment changes the Python a step runs is left out, or fixed
    skipped = (*LAUNCHER_ENV_VARS, "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL", "PYTHONWARNINGS")
    env = {k: v for k, v in os.environ.items() if k not in skipped}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent), PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts.json"
        command = [sys.executable, str(HERE / "step_cost.py"), "--count-worker", *configs, "--out", str(out)]
        command += ["--width", str(width)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the counting fits failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())["configs"]


def rounded(counts: dict) -> dict:
    """``counts`` with every figure to two decimals, as the baseline file keeps them."""
    return {
        config: {
            "calls": round(entry["calls"], 2),
            "instructions": round(entry["instructions"], 2),
            "functions": {name: [round(value, 2) for value in pair] for name, pair in entry["functions"].items()},
        }
        for config, entry in counts.items()
    }


def budgets() -> dict:
    """The budgets of ``benchmarks/step_cost_budgets.json``: per configuration, the one it is compared with and
    the calls and instructions per step it may add to it."""
    return json.loads(BUDGETS.read_text())["configs"]


def over_budget(counts: dict, tolerance: float = 0.0) -> list[str]:
    """What goes over its budget, one line each (empty when everything fits).

    Args:
        counts: what :func:`count` returned.
        tolerance: a fraction of the compared configuration's own figure allowed on top of each budget: 0 where the
            versions are the baseline's, a little where a Lightning or torch release moved the code both sides run.
    """
    lines = []
    for config, budget in budgets().items():
        if config not in counts or budget["over"] not in counts:
            continue
        for measure in ("calls", "instructions"):
            base = counts[budget["over"]][measure]
            added = counts[config][measure] - base
            if added > budget[measure] + tolerance * base:
                lines.append(
                    f"{config}: {added:+,.1f} {measure} per step over {budget['over']}, budget {budget[measure]:+,}"
                    + (f" (+{tolerance:.0%} of {base:,.1f})" if tolerance else "")
                )
    return lines


def grown_functions(counts: dict, config: str, against: dict, top: int = 15) -> list[str]:
    """The functions whose calls or instructions per step grew most in ``config`` against the profile ``against``."""
    now, before = counts[config]["functions"], against.get(config, {}).get("functions", {})
    rows = []
    for name in now.keys() | before.keys():
        calls_now, instructions_now = now.get(name, (0.0, 0.0))
        calls_before, instructions_before = before.get(name, (0.0, 0.0))
        if instructions_now > instructions_before or calls_now > calls_before:
            rows.append((instructions_now - instructions_before, calls_now - calls_before, name))
    rows.sort(reverse=True)
    return [f"{di:+9.1f} instructions {dc:+7.2f} calls  {name}" for di, dc, name in rows[:top]]


def table(counts: dict, walls: dict[str, list[float]] | None = None, instructions: dict | None = None) -> str:
    """The per-step cost table in Markdown: what each configuration adds to the one its budget compares with."""
    rules = budgets()
    rows = [
        "| configuration | Python calls / step | added | bytecode instructions / step | added | budget |",
        "|---|---|---|---|---|---|",
    ]
    if walls:
        rows[0] += " wall-clock vs mgpu, median (range) |"
        rows[1] += "---|"
    if instructions:
        rows[0] += " machine instructions / step (callgrind) |"
        rows[1] += "---|"
    for config in CONFIGS:
        if config not in counts:
            continue
        rule = rules.get(config)
        base = counts.get(rule["over"]) if rule else None
        calls, instr = counts[config]["calls"], counts[config]["instructions"]
        added_calls = f"{calls - base['calls']:+,.1f} vs {rule['over']}" if base else ""
        added_instr = f"{instr - base['instructions']:+,.1f}" if base else ""
        budget = f"{rule['calls']:+,} / {rule['instructions']:+,}" if rule else ""
        row = f"| `{config}` | {calls:,.1f} | {added_calls} | {instr:,.1f} | {added_instr} | {budget} |"
        if walls:
            ratios = walls.get(config)
            shown = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else ""
            row += f" {shown} |"
        if instructions:
            runs = instructions.get(config)
            row += f" {', '.join(f'{run:,.0f}' for run in runs)} |" if runs else " |"
        rows.append(row)
    return "\n".join(rows)


def write_table(path: Path, shown: str) -> None:
    """Put ``shown`` between the ``step-cost-table`` marks of ``path`` (the docs' page), or make ``path`` hold it."""
    start, end = "<!-- step-cost-table: start -->", "<!-- step-cost-table: end -->"
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = f"{before}{start}\n{shown}\n{end}{rest.split(end, 1)[1]}"
    else:
        text = shown + "\n"
    path.write_text(text)


def wall_worker(config: str, steps: int, warmup: int) -> None:
    """One 2-process fit of the FACTS model (MLP 1024-1024-1024-10, batch 32 a process): samples per second."""
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    torch.manual_seed(0)
    clock = batch_clock(warmup, steps)
    trainer = quiet_trainer(config, clock, steps)
    trainer.fit(classifier_module(mlp()), DataLoader(synthetic_dataset(steps, 32), batch_size=32))
    if trainer.global_rank == 0:
        result = {"samples_per_s": (steps - warmup) * 64 / (clock.stop - clock.start)}
        print(WALL_RESULT + json.dumps(result), flush=True)


def wall_ratios(rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Each configuration's throughput over mgpu's, one ratio a round, in alternating orders."""
    ratios: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for index in range(rounds):
        order = list(CONFIGS) if index % 2 == 0 else list(reversed(CONFIGS))
        measured = {
            config: run_worker(__file__, [config, "--steps", str(steps), "--warmup", str(warmup)], WALL_RESULT)
            for config in order
        }
        for config in CONFIGS:
            ratios[config].append(measured[config]["samples_per_s"] / measured["mgpu"]["samples_per_s"])
        print(f"wall round {index + 1}: " + ", ".join(f"{c} {ratios[c][-1]:.3f}" for c in CONFIGS), flush=True)
    return ratios


def callgrind_worker(config: str) -> None:
    """Rank 0 under callgrind, instrumented for the window's steps only; rank 1 as usual (started by Lightning)."""
    import lightning.pytorch as pl

    pid = os.getpid()

    class Toggle(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_rank == 0 and trainer.global_step in WINDOW:
                state = "on" if trainer.global_step == WINDOW[0] else "off"
                subprocess.run(["callgrind_control", "-i", state, str(pid)], check=True, capture_output=True)

    small_fit(config, Toggle())


def callgrind_instructions(config: str) -> float:
    """Machine instructions per step of rank 0 over the window, under callgrind (minutes)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes"]
        command += [f"--callgrind-out-file={report}", sys.executable, str(HERE / "step_cost.py")]
        command += ["--callgrind-worker", config]
        subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600, cwd=tmp, check=True)
        # thread 1 is the training thread; gloo's and a watchdog's threads have files of their own
        main_thread = Path(f"{report}-01").read_text().splitlines()
        totals = [line for line in main_thread if line.startswith("totals:")]
        return int(totals[0].split()[1]) / (WINDOW[1] - WINDOW[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count-worker", nargs="+", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--callgrind-worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)  # the wall-clock worker
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--wall-rounds", type=int, default=0, help="also time every configuration, this many rounds")
    parser.add_argument("--steps", type=int, default=120, help="wall-clock fits: steps (first --warmup not timed)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--callgrind", type=int, default=0, help="runs of stock_ddp and mgpu under callgrind")
    parser.add_argument("--write-baseline", action="store_true", help=f"write {BASELINE.name} from this run")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    add_json_out(parser)
    args = parser.parse_args()
    if args.count_worker:
        count_worker(args.count_worker, args.out, args.width)
        return
    if args.callgrind_worker:
        callgrind_worker(args.callgrind_worker)
        return
    if args.worker:
        wall_worker(args.worker, args.steps, args.warmup)
        return
    print(f"machine: {describe_machine()}")
    started = time.monotonic()
    counts = count(args.configs)
    print(f"counted {len(counts)} configurations in {time.monotonic() - started:.0f} s (window: steps {WINDOW})")
    walls = wall_ratios(args.wall_rounds, args.steps, args.warmup) if args.wall_rounds else None
    instructions = None
    if args.callgrind:
        instructions = {config: [] for config in ("stock_ddp", "mgpu")}
        for _ in range(args.callgrind):
            for config in instructions:
                instructions[config].append(callgrind_instructions(config))
                print(f"callgrind {config}: {instructions[config][-1]:,.0f} instructions per step", flush=True)
    shown = table(rounded(counts), walls, instructions)  # the figures as the baseline keeps them
    print(shown)
    for line in over_budget(counts) or ["every configuration is within its budget"]:
        print(line)
    if args.markdown is not None:
        write_table(args.markdown, shown)
    if args.write_baseline:
        baseline = {"versions": versions(), "configs": rounded(counts)}
        BASELINE.write_text(json.dumps(baseline, indent=0, sort_keys=True) + "\n")
        print(f"wrote {BASELINE}")
    if walls:
        rows = [
            ratio_row("step_cost", config, "throughput vs mgpu (higher is faster)", ratios, "higher", "mgpu")
            for config, ratios in walls.items()
            if config != "mgpu"
        ]
        write_rows(args.json_out, rows)


if __name__ == "__main__":
    main()
